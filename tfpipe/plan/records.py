"""What executors record: one `TaskRecord` per task, and the peaks of kept state per stage."""

import collections
from typing import Dict, Mapping, Optional, Sequence, Tuple

from tfpipe.plan import schedules

__all__ = ["TaskRecord", "kind_of", "kept_peaks", "STEP"]

STEP = "FB"   # how a record names the last stage's step: its forward and backward as one task

TaskRecord = collections.namedtuple(
    "TaskRecord", ["stage", "kind", "batch", "version", "s", "start", "end", "micro", "epoch"],
    defaults=(None, 0))
TaskRecord.__doc__ = """One task as it ran: `stage` k, `kind`, mini-batch `batch` (its index in
`epoch`), micro-batch `micro` or None, `version` (updates of stage k whose weights it read), `s`
(version difference), `start` and `end` (time.perf_counter seconds). Kinds: F (forward), B
(backward and update), FB (the last stage's forward and backward as one step), U (apply
accumulated gradients), R (early receive of a gradient), S (barrier), and the transfer threads'
XF (stage k's output to k+1) and XB (stage k's input gradient to k-1), each recorded under the
sending stage k, with version and s None. The compiled executor's come from the profiler
(`tfpipe.runtime.timeline`): one record per run of a task's ops, no R or S."""


def kind_of(k: int, K: int, kind: str) -> str:
  """The record kind of a task of kind `kind` at stage k of K: the last stage's backward is
  its step (`STEP`, forward and backward as one task); any other task keeps its kind."""
  return STEP if k == K - 1 and kind == "B" else kind


def kept_peaks(tasks: Sequence[schedules.Task], diffs: Mapping[schedules.Task, int],
               keeps_weights: bool, last: bool) -> Tuple[int, int]:
  """(most forward states kept at once, most weight versions among them) for one stage's list.

  A forward's state lives until the backward that covers it (a split backward's W). With
  `keeps_weights` (the backward reads the forward's weights) each state
  holds the version it read, or its prediction (version, s); otherwise it
  holds inputs only. The last stage runs forward and backward as one step: its forwards are
  held (inputs only) until the step, which then holds every unit it joins at once, so they
  count as states, but they hold no weight version (a split step keeps its tape for its W).
  """
  split = {(t.batch, t.micro) for t in tasks if t.kind == "W"}
  if last and not split:
    keeps_weights = False
  held: Dict[Tuple[int, Optional[int]], Tuple[int, int]] = {}
  updates, peak_states, peak_versions = 0, 0, 0
  for task in tasks:
    unit = (task.batch, task.micro)
    if task.kind == "W":
      held.pop(unit, None)
    if task.kind == "F":
      held[unit] = (updates, diffs.get(task, 0))
      peak_states = max(peak_states, len(held))
      if keeps_weights:
        peak_versions = max(peak_versions, len(set(held.values())))
    elif task.kind == "B" and unit not in split:
      for u in ([unit] if task.micro is not None else
                [u for u in list(held) if u[0] == task.batch]):
        held.pop(u, None)
    if schedules.is_update(task):
      updates += 1
  return peak_states, peak_versions
