"""What every executor shares: the stage programs, update counts and hooks, records, peaks."""

import collections
from typing import Any, Callable, Hashable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfpipe.plan import schedules, verify, windows
from tfpipe.plan.records import TaskRecord
from tfpipe.runtime.protocol import StageProtocol

__all__ = ["Executor", "Recent", "key", "Hook", "OnResult", "Before"]

Hook = Callable[[int, StageProtocol], None]   # after updates of stage k: hook(k, program)
OnResult = Callable[..., Any]   # on_result(b, loss, logs) (training: True stops) or (b, values)
Before = Optional[Callable[[int], None]]   # before(b), as the caller starts waiting for b


class Executor:
  """Runs verified schedules on stage programs (`tfpipe.stage.program`) placed on their devices.

  `maxsize`: how many items a link between two stages may hold (the
  verifier checks the schedule against `link_capacity`).

  What callers ask of an executor is declared here, so none tests an executor's type:
  `windowed` (it runs `window` mini-batches per call; `set_window`), `profiles` (it reads
  its timeline and a run's step trace from TensorFlow's profiler, in this process), and
  `inlines`, `crossing`, `traced_copies` (how it traces an epoch: what a profile and
  `method="auto"` price).
  """
  windowed = False
  profiles = False
  window = 1

  def inlines(self, schedule: schedules.Lists, diffs: windows.Diffs, num_batches: int,
              loops: Optional[bool] = None) -> bool:
    """Whether an epoch of `schedule` traces its tasks' bodies into one graph: never here
    (each task runs as its stage's call)."""
    return False

  def crossing(self, schedule: schedules.Lists, diffs: windows.Diffs,
               num_batches: int) -> List[float]:
    """Per stage, the share of its backwards that recompute their forward: none here."""
    return [0.0] * self.K

  def traced_copies(self, schedule: schedules.Lists, diffs: windows.Diffs, num_batches: int,
                    loops: Optional[bool] = None) -> List[int]:
    """Per stage, how many copies of its tasks an epoch traces: one here."""
    return [1] * self.K

  def __init__(self, programs: Sequence[StageProtocol], record: bool = False,
               maxsize: Optional[int] = None):
    self.programs = programs
    self.epoch = -1                      # epochs trained so far, minus one
    self.update_hooks: List[Hook] = []   # run after updates of a stage (`count_updates`)
    self.K = len(programs)
    self.record = record
    self.maxsize = maxsize or self.K
    self.records: List[TaskRecord] = []
    self.report: Optional[verify.Report] = None   # the verifier's report on the last schedule run
    self._verified = Recent()            # schedules verified lately (as keys): their reports
    self.schedule_key: Optional[Tuple[Any, ...]] = None   # the last epoch's schedule (`key`)
    self.updates = [0] * self.K          # updates applied per stage so far
    self.peak_saved = [0] * self.K       # most forward states kept (or held for a step) at once
    self.peak_versions = [0] * self.K    # most weight versions kept at once, per stage

  def take_over(self, before: "Executor") -> None:
    """Continues the counts of `before`, the executor this one replaces in the middle of a fit
    (`method="auto"` taking its choice): epochs, updates (the learning-rate link reads them),
    records and peaks."""
    self.epoch, self.updates = before.epoch, list(before.updates)
    self.records = before.records
    self.peak_saved = list(before.peak_saved)
    self.peak_versions = list(before.peak_versions)

  @property
  def link_capacity(self) -> int:
    return 2 * self.maxsize + 1

  def _start_epoch(self, schedule: schedules.Lists, continuing: bool = False) -> verify.Report:
    """Verifies `schedule` (a broken one is refused) and counts the epoch (not where the call
    is `continuing` the last one, stopped part way: `method="auto"` handing over). A schedule
    verified lately (`Recent`) is not verified again: the verifier plays out every task in
    Python (at K=4, M=4 0.15 ms a mini-batch: a fifth of a tiny model's step)."""
    self.schedule_key = key(schedule)   # also what an executor keeps its own plans under
    report: verify.Report = self._verified.get(
        (self.schedule_key, self.link_capacity),
        lambda: verify.verify(schedule, self.link_capacity))
    self.report = report
    self.epoch += 0 if continuing else 1
    if any(t.kind == "U" for tasks in schedule for t in tasks):
      for program in self.programs:
        program.updates.build_accumulators()
    return report

  def count_updates(self, k: int, count: int = 1) -> None:
    """Counts `count` updates of stage k and runs the update hooks once: the threaded executor
    calls it per update, the compiled one per window (after the window's updates of k; the
    prediction error asks for windows of one mini-batch, so it sees every update)."""
    self.updates[k] += count
    for hook in self.update_hooks:
      hook(k, self.programs[k])

  def share(self, k: int, value: float) -> tf.Tensor:
    """A micro-batch's share of its mini-batch as stage k's tasks take it: a float64 scalar."""
    with tf.device(self.programs[k].device):
      return tf.constant(value, tf.float64)


class Recent:
  """The values made for the last `size` keys: what an executor works out once per schedule
  (its verification, its windows) and would otherwise work out again at every epoch, and at
  every `fit` that alternates between a few epoch lengths."""

  def __init__(self, size: int = 4) -> None:
    self.size = size
    self.values: "collections.OrderedDict[Hashable, Any]" = collections.OrderedDict()

  def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
    """The value of `key`, made by `make()` when it is not among the last `size`."""
    if key in self.values:
      self.values.move_to_end(key)
    else:
      self.values[key] = make()
      if len(self.values) > self.size:
        self.values.popitem(last=False)
    return self.values[key]


def key(schedule: schedules.Lists) -> Tuple[Any, ...]:
  """`schedule` as a hashable key: its stages' tasks, and its devices' lanes and joint updates
  where it has them (`schedules.Schedule`): all the verifier reads of it."""
  lanes = getattr(schedule, "lanes", None)
  return (tuple(map(tuple, schedule)), lanes and tuple(map(tuple, lanes)),
          getattr(schedule, "joint", False))
