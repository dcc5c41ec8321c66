"""`method="auto"`'s probe training first: where only the synchronous schedules can win (the
epochs table rules out every other candidate for this optimizer and K: momentum SGD), the
probe, one of them, trains from the first batch (`trains_first`): each schedule equals
Keras at any M, so the choice can take over between two mini-batches without changing what
is computed. `Probe` times its first two windows (the first holds its start-up); a profile
then runs only where the rest of the fit can pay for it (`PROFILE_SHARE`), and its choice
takes over for the rest of the fit (`tfpipe.training.chooser`).
"""

import time
from typing import List, Tuple

from tfpipe.plan import auto as auto_plan
from tfpipe.rules import advice, epochs as epochs_lib

__all__ = ["PROBE", "PROFILE_SHARE", "PROFILE_PER_START", "Probe", "probe_candidate",
           "trains_first"]

PROBE = {"method": "1f1b", "micro_batches": 2}
# A probe training first is profiled only where the profile, predicted at PROFILE_PER_START
# times the probe's own start-up (the profile traces and first runs each stage's tasks, as
# the probe's first window did), costs at most PROFILE_SHARE of the rest of the fit at the
# probe's measured speed. Measured on `bench/time_to_accuracy.py`'s tasks, the profile over
# the probe's start-up: 0.5-1.0 (MLPs), 0.8-1.1 (the 12-layer transformer), 1.2-1.6 (the
# CNN): the largest is taken, so a profile runs where it surely costs under a tenth of the
# rest. There (fits of 3-30 s), on 8 of 10 rows the probe was kept and took 0.71-1.24x the
# fastest column (the same configuration as its own column moved by up to 25% between
# timings); where it profiled (the CNN), the profile took 12-13% and chose the probe.
PROFILE_SHARE = 0.1
PROFILE_PER_START = 1.5


def trains_first(pipe, batch_size: int, last_batch: int = 0) -> bool:
  """Whether `method="auto"` trains its probe from the first batch (`Probe`): every candidate
  besides the synchronous schedules is out by the epochs table for `pipe`'s optimizer at its
  K (or by clipping or loss scaling), and the probe's M divides the batch (and a smaller
  `last_batch`, if any, holds M samples at least)."""
  M = PROBE["micro_batches"]
  if batch_size % M or 0 < last_batch < M:
    return False
  if pipe.programs[0].updates.joint is not None:
    return True
  factors = epochs_lib.factor(advice.family(pipe.inner_optimizer), pipe.num_stages)
  return all(c.kind == "synchronous" or auto_plan.epochs_out(c, factors)
             for c in auto_plan.candidates(pipe.num_stages, batch_size, 1, {"advice": True}))


class Probe:
  """The probe training first: its windows (of the executor's window of mini-batches, given at
  each epoch's start) timed as they end (the first holds its start-up; the mark restarts with
  each epoch, so validation is not counted; windows handed on together time as one), and at the
  end of its second the verdict, "profile" where the profile (`PROFILE_PER_START` times the
  probe's start-up) costs at most `PROFILE_SHARE` of the rest of the fit at the probe's speed,
  else "keep". `features`, `labels`: the first mini-batch, for the profile; `last_batch`: the
  fit's smaller last batch (0: none), which a choice's micro-batches must fit in."""

  def __init__(self, features, labels, batch_size: int, last_batch: int = 0):
    self.features, self.labels, self.last_batch = features, labels, last_batch
    self.batch_size, self.window = batch_size, 1
    self.spans: List[Tuple[float, int]] = []   # (seconds, mini-batches) per window ended
    self.verdict = None
    self.rest = 0   # mini-batches of the fit left after the verdict
    self.batch_seconds = self.start = self.profile = 0.0
    self._mark, self._count, self._num_batches = 0.0, 0, 0

  def epoch_begins(self, num_batches: int, window: int):
    """An epoch of `num_batches` mini-batches starts, in windows of `window`."""
    self._mark, self._count, self._num_batches = time.perf_counter(), 0, num_batches
    self.window = max(1, window)

  def result(self, b: int, rest: int) -> bool:
    """Mini-batch b of the epoch finished, `rest` left in the fit after it: True where the
    verdict, just reached, is to profile (stop the epoch here)."""
    if self.verdict is not None:
      return False
    self._count += 1
    if (b + 1) % self.window and b + 1 < self._num_batches:
      return False
    now = time.perf_counter()
    if self.spans and now - self._mark < 1e-3:   # handed on with the last: one span with it
      return False
    self.spans.append((now - self._mark, self._count))
    self._mark, self._count = now, 0
    if len(self.spans) < 2:
      return False
    (first, n), (second, m) = self.spans[:2]
    self.batch_seconds = second / m
    self.start = max(first - n * self.batch_seconds, 0.0)
    self.profile, self.rest = PROFILE_PER_START * self.start, rest
    pays = self.profile <= PROFILE_SHARE * rest * self.batch_seconds
    self.verdict = "profile" if pays else "keep"
    return pays

  def why_kept(self) -> str:
    """Why the probe was kept without a profile."""
    if self.verdict is None:
      return "the fit ended before the probe had run two windows"
    return (f"a profile (~{self.profile:.1f} s, from the probe's start-up) would cost over "
            f"{PROFILE_SHARE:.0%} of the rest of the fit (~{self.rest * self.batch_seconds:.1f} "
            "s at the probe's speed)")


def probe_candidate() -> auto_plan.Candidate:
  """The probe as a candidate (a synchronous schedule)."""
  return auto_plan.Candidate(PROBE["method"], PROBE["micro_batches"], "synchronous")
