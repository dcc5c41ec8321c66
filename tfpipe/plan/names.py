"""Name lookups that answer a typo with "did you mean"."""

import difflib
from typing import Any, Iterable


def lookup(kind: str, name: Any, choices: Iterable[Any]) -> Any:
  """Returns `name` if it is one of `choices`, else raises a ValueError that suggests one."""
  choices = list(choices)
  if name in choices:
    return name
  close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
  hint = f"; did you mean {close[0]!r}?" if close else ""
  raise ValueError(
      f"unknown {kind} {name!r}{hint} (choices: {', '.join(map(str, choices))})")
