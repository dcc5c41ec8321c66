"""Shared by the bench scripts: where results go and how tables are written.

Each script prints its tables and writes them, with any plots, under
bench/results/ (or --results_dir), so README can show the latest ones.
"""

import os

__all__ = ["RESULTS", "markdown_table", "write"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def markdown_table(head, rows):
  """A Markdown table: `head` a list of column names, `rows` lists of cells (str() each)."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def write(results_dir, name, text):
  """Writes `text` to results_dir/name; returns the path."""
  os.makedirs(results_dir, exist_ok=True)
  path = os.path.join(results_dir, name)
  with open(path, "w") as f:
    f.write(text.rstrip() + "\n")
  return path
