"""A link's shape as people write it: "1gbit", "100mbit,2ms", "10gbit,200us,1%".

`parse(text)` gives a `Link`: its rate in bits per second, its one-way delay in
seconds and its loss as a fraction. The units are traffic control's (`tc`):
rates in bit, kbit, mbit, gbit (powers of ten), delays in us, ms, s.
"""

import dataclasses
import re

__all__ = ["Link", "parse"]

_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclasses.dataclass(frozen=True)
class Link:
  rate: float            # bits per second
  delay: float = 0.0     # seconds, one way
  loss: float = 0.0      # fraction of packets dropped

  def __str__(self):
    parts = [_format_rate(self.rate)]
    if self.delay or self.loss:
      parts.append("" if not self.delay else f"{self.delay * 1e6:g}us" if self.delay < 1e-3
                   else f"{self.delay * 1e3:g}ms")
    if self.loss:
      parts.append(f"{self.loss * 100:g}%")
    return ",".join(parts)


def _format_rate(rate):
  for unit in ("tbit", "gbit", "mbit", "kbit"):
    if rate >= _RATE[unit]:
      return f"{rate / _RATE[unit]:g}{unit}"
  return f"{rate:g}bit"


def _number(part, units, what, text):
  match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)", part.strip().lower())
  if not match or match.group(2) not in units:
    raise ValueError(f"link {text!r}: {part.strip()!r} is not a {what} (a number with a unit: "
                     f"{', '.join(units)})")
  return float(match.group(1)) * units[match.group(2)]


def parse(text):
  """The `Link` of "RATE[,DELAY[,LOSS%]]", e.g. "1gbit,200us"; a `Link` passes through."""
  if isinstance(text, Link):
    return text
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"a link is \"RATE[,DELAY[,LOSS%]]\", e.g. \"1gbit,200us\". Received: {text!r}")
  parts = text.split(",")
  if len(parts) > 3:
    raise ValueError(f"link {text!r}: at most a rate, a delay and a loss "
                     "(\"RATE[,DELAY[,LOSS%]]\")")
  rate = _number(parts[0], _RATE, "rate", text)
  if rate <= 0:
    raise ValueError(f"link {text!r}: the rate must be > 0")
  delay = _number(parts[1], _TIME, "delay", text) if len(parts) > 1 and parts[1].strip() else 0.0
  loss = 0.0
  if len(parts) > 2:
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*%", parts[2].strip())
    if not match or float(match.group(1)) >= 100:
      raise ValueError(f"link {text!r}: {parts[2].strip()!r} is not a loss (a percentage "
                       "below 100, e.g. 1%)")
    loss = float(match.group(1)) / 100
  return Link(rate, delay, loss)
