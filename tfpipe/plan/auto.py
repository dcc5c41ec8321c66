"""`method="auto"`: the candidate with the least predicted time to accuracy (pure Python).

K: stages, M: micro-batches per mini-batch. A candidate is a method with its M and
options. Its time to accuracy is its start-up (the graphs it traces and optimises, predicted
from the profile's own) plus the seconds an epoch takes on these devices (the simulator's,
from a profile of these stages at the candidate's micro-batch size) times the epochs it needs
to reach the accuracy `fit`'s epochs of synchronous training reach (a synchronous schedule
equals Keras, so the fit's epochs; an asynchronous method's factor over them is measured,
`tfpipe.rules.epochs`). A short fit weighs start-up; a long one, speed. A method whose factor
is unknown for the optimizer, or that did not reach that accuracy in the measured runs, is
not chosen. A micro-batch size is a candidate
only where the profile shows a device kept busy: a mini-batch's compute cut into M
micro-batches costs at most `BUSY` times the compute of the mini-batch taken whole.
A candidate whose least possible time (`least_batch_seconds`: its compute over the cores,
or its busiest device's, at the compute of a smaller M) is no better than a time already
predicted is neither profiled nor played out (`bounded`): the profile costs what a short fit
can least afford.
Candidates of one M predicted within `TIE` of each other rank by what they keep: 1f1b
(stage k keeps K - k micro-batches), zb (up to K), gpipe (M), then the asynchronous methods
(their weights do not equal Keras's). Where the stages share the cores, the simulator
predicts the three schedules alike at one M (the cores, not the bubble, bound them), and
their order had followed the last digits of the prediction.
"""

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["AUTO", "BUSY", "TIE", "NOISE", "Candidate", "Row", "candidates", "epochs_out", "rank",
           "report_lines", "by_micro_batches", "synchronous_micro_batches", "too_small",
           "least_batch_seconds", "seconds_to_accuracy"]

AUTO = "auto"   # the method name that asks for the choice
BUSY = 2.0
TIE = 1e-3   # relative: predicted seconds to accuracy this close are a tie
# What a larger M's compute per mini-batch may be measured below a smaller M's: on
# `bench/time_to_accuracy.py`'s 10 tasks and depths, M = 1, 2, 4, .., 2K, 33 of 35 steps up
# in M grew it (1.3-2.6x from M = 1 to 2K), 2 fell, by 2% each.
NOISE = 0.05

SYNCHRONOUS = ("1f1b", "zb", "gpipe")   # the schedules, least kept first (ties go that way)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A method with its M and options; `kind` names its row in the epochs table
  ("synchronous", "spectrain", "spectrain advised", "2bw")."""
  method: str
  micro_batches: int
  kind: str
  options: Tuple[Tuple[str, object], ...] = ()

  @property
  def name(self) -> str:
    extra = "".join(f", {k}={v}" for k, v in self.options)
    return f"{self.method} M={self.micro_batches}{extra}"


@dataclasses.dataclass
class Row:
  """A candidate's line in the plan report. samples_per_second: predicted; epochs: the
  factor (None: unknown or not reached); seconds: predicted seconds to accuracy (None: not
  a contender); start: of those, its predicted start-up; why: why it is out, if it is;
  least: where it was not played out for its bound, its least possible seconds."""
  candidate: Candidate
  samples_per_second: float
  epochs: Optional[float]
  seconds: Optional[float]
  why: str = ""
  start: float = 0.0
  least: Optional[float] = None


def synchronous_micro_batches(num_stages: int) -> List[int]:
  """The M the synchronous schedules are candidates at on K = `num_stages`: K and 2K (the
  bubble's fill), and the powers of two from 2 below K (fewer copies of each stage's tasks to
  trace, larger micro-batches: on `bench/time_to_accuracy.py`'s 12-layer transformer at K=4,
  1f1b's first epoch took 4.3 s at M=2 against 6.5 s at M=4, its later ones 0.85 against
  0.91 s). M = 1 is 1f1b's alone (every schedule is the same there)."""
  K = num_stages
  return sorted({K, 2 * K} | {2 ** i for i in range(1, K.bit_length()) if 2 ** i < K})


def candidates(num_stages: int, batch_size: int, advised_micro_batches: Optional[int],
               advised_options: Mapping[str, object]) -> List[Candidate]:
  """The candidates at K = `num_stages` with mini-batches of `batch_size`: 1f1b with M = 1,
  the synchronous schedules at each of `synchronous_micro_batches` that divides the batch,
  SpecTrain plain (M = 1), SpecTrain with the measured advice (`advised_micro_batches`,
  `advised_options`; None: none for this optimizer) and 2BW."""
  K, found = num_stages, [Candidate("1f1b", 1, "synchronous")]
  for M in synchronous_micro_batches(K):
    if batch_size % M == 0:
      found += [Candidate(method, M, "synchronous") for method in SYNCHRONOUS]
  found.append(Candidate("spectrain", 1, "spectrain"))
  if advised_micro_batches is not None and batch_size % advised_micro_batches == 0:
    found.append(Candidate("spectrain", advised_micro_batches, "spectrain advised",
                           tuple(sorted(advised_options.items()))))
  found.append(Candidate("2bw", 1, "2bw"))
  return found


def epochs_out(c: Candidate, epochs: Mapping[str, Optional[float]]) -> str:
  """Why the epochs table rules `c` out whatever its speed ("" when it does not): no run
  measured its kind for this optimizer and depth, or some run did not reach the accuracy."""
  if c.kind == "synchronous":
    return ""
  if c.kind not in epochs:
    return "epochs to accuracy not measured for this optimizer and depth"
  if epochs[c.kind] is None:
    return "did not reach the synchronous accuracy in the measured runs"
  return ""


def too_small(compute: Mapping[int, float], micro_batches: int) -> bool:
  """Whether the profile's compute per mini-batch at `micro_batches` (`compute`: seconds at
  each M profiled) exceeds `BUSY` times the mini-batch's taken whole (M = 1, else the least
  profiled): micro-batches too small to keep a device busy."""
  if micro_batches <= 1 or micro_batches not in compute:
    return False
  whole = compute.get(1) or min(compute.values())
  return compute[micro_batches] > BUSY * whole


def least_batch_seconds(forward: Sequence[float], backward: Sequence[float], update: float,
                        cores: Optional[float]) -> float:
  """The least seconds a mini-batch can take on stages whose compute per mini-batch is
  `forward`, `backward` (per stage) and `update` (each stage's update): with `cores`, the
  cores all the stages share, their compute over the cores (two tasks of one logical CPU may
  run at once in one graph, so no stage bounds it); else (each stage computes on its own)
  its busiest stage's. No schedule at any M beats it, nor does the simulator predict faster
  (`tests/test_auto.py`); at a larger M, whose micro-batches are smaller, the compute per
  mini-batch grows, so with `NOISE` off it bounds those too."""
  work = sum(forward) + sum(backward) + update * len(forward)
  if cores:
    return work / cores
  return max(f + b for f, b in zip(forward, backward)) + update


def seconds_to_accuracy(c: Candidate, samples_per_second: float,
                        epochs: Mapping[str, Optional[float]], samples: float,
                        start: float = 0.0) -> Optional[float]:
  """`c`'s predicted seconds to accuracy at `samples_per_second`: its start-up and its
  epochs (`epochs`' factor for its kind; synchronous 1) of `samples` samples (None: a
  factor unknown)."""
  factor = 1.0 if c.kind == "synchronous" else epochs.get(c.kind)
  if factor is None or not samples_per_second:
    return None
  return start + factor * samples / samples_per_second


def rank(found: Sequence[Candidate], samples_per_second: Mapping[Candidate, float],
         compute: Mapping[int, float], epochs: Mapping[str, Optional[float]],
         samples: float = 1.0, start: Optional[Mapping[Candidate, float]] = None,
         bounded: Optional[Mapping[Candidate, float]] = None) -> List[Row]:
  """The candidates' rows, fastest to accuracy first (contenders before the rest).

  samples_per_second: each candidate's, predicted. compute: seconds of compute per
  mini-batch at each M (the profile's, summed over stages). epochs: the factor per kind
  (missing: unknown). samples: the samples synchronous training takes to the accuracy (the
  fit's epochs times an epoch's). start: each candidate's predicted start-up seconds (none:
  0). bounded: the candidates not played out because their least possible seconds to
  accuracy (the value) were no better than a candidate's predicted. A candidate predicted
  at 0 samples/s was not played out (bounded, its micro-batches too small, those of a
  smaller M already too small, or `epochs_out`)."""
  start, bounded = start or {}, bounded or {}
  whole = compute.get(1) or min(compute.values())
  rows = []
  for c in found:
    rate = samples_per_second[c]
    factor = 1.0 if c.kind == "synchronous" else epochs.get(c.kind)
    out = epochs_out(c, epochs)
    if not rate and out:
      why = out
    elif too_small(compute, c.micro_batches):
      share = compute[c.micro_batches] / whole
      why = (f"micro-batches too small to keep a device busy (compute {share:.1f}x the "
             "mini-batch's taken whole)")
    elif not rate and c in bounded:
      why = (f"not played out: at least {bounded[c]:.2g} s to accuracy (its compute over the "
             "cores, or its busiest device's), no faster than the chosen")
    elif not rate:
      why = "not profiled: a larger micro-batch was already too small to keep a device busy"
    else:
      why = out
    seconds = None if why else seconds_to_accuracy(c, rate, epochs, samples, start.get(c, 0.0))
    rows.append(Row(c, rate, factor, seconds, why, start.get(c, 0.0),
                    bounded.get(c) if not rate else None))
  def key(r: Row) -> Tuple[bool, float, int, float]:
    if r.seconds is None:
      return (True, 0.0, 0, -r.samples_per_second)
    # The fastest of its M's candidates within TIE of it stands for them all: a tie.
    tied = min(o.seconds for o in rows if o.seconds is not None
               and o.candidate.micro_batches == r.candidate.micro_batches
               and abs(o.seconds - r.seconds) <= TIE * r.seconds)
    keeps = (SYNCHRONOUS.index(r.candidate.method) if r.candidate.kind == "synchronous"
             else len(SYNCHRONOUS))
    return (False, tied, keeps, -r.samples_per_second)
  return sorted(rows, key=key)


def report_lines(rows: Sequence[Row], batch_size: int, num_batches: int) -> List[str]:
  """The plan report: one line per candidate, the chosen first."""
  best = rows[0].seconds
  lines = [f"{'candidate':<46}{'samples/s':>10}{'start-up':>10}{'epochs':>8}"
           f"{'to accuracy':>13}  note"]
  for i, r in enumerate(rows):
    epoch = num_batches * batch_size / r.samples_per_second if r.samples_per_second else 0.0
    factor = "-" if r.epochs is None else f"{r.epochs:.2f}"
    if r.seconds is None or best is None:
      relative = "-"
    else:
      relative = f"{r.seconds / best:.2f}x"
    note = "chosen" if i == 0 and r.seconds is not None else r.why
    rate = f"{r.samples_per_second:.0f}" if r.samples_per_second else "-"
    begin = f"{r.start:.1f} s" if r.seconds is not None else "-"
    lines.append(f"{r.candidate.name:<46}{rate:>10}{begin:>10}{factor:>8}"
                 f"{relative:>13}  {note}" + (f" ({epoch:.2g} s an epoch)" if note == "chosen"
                                              else ""))
  return lines


def by_micro_batches(found: Sequence[Candidate]) -> Dict[int, List[Candidate]]:
  """The candidates grouped by M (one profile each)."""
  groups: Dict[int, List[Candidate]] = {}
  for c in found:
    groups.setdefault(c.micro_batches, []).append(c)
  return groups
