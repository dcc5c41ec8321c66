"""The compiled executor's task timeline, read from the TensorFlow profiler.

K: stages, k: stage index. Inside a window's graph no Python runs between
tasks, so the executor cannot time them itself; TensorFlow's profiler times
every op the graph executor runs, on every local device. The compiled
executor traces task i of a window under the name scope `scope(i)` and calls
each window inside a profiler trace named `tfpipe_window`, so:
  a task's records are the runs of its ops within its window's call: a
      pause of more than `MERGE_GAP` between its ops (e.g. a forward reads
      its weights early, then waits for its input) starts a new record of
      the same task, so records cover the time its ops ran, and the
      breakdown sees the pause as a wait;
  a transfer's record (XF: stage k to k+1, XB: k to k-1) spans the `_Send`
      ops from one stage's task to a task of its neighbour in the same call;
      a tensor carried to the next window moves as that call's input (a
      `_Send` from the carry argument to the task that takes it), recorded as
      its sender's transfer too.
Tasks of one stage may overlap in time in a graph (a forward may start while
the previous backward still runs, where their data allow). Times are moved
onto `time.perf_counter`'s clock, like the threaded executor's records.

The profiler sees this process's devices: stages on TF servers (other
processes) leave no ops here. A session can keep its TensorBoard profile
(`.xplane.pb`).
"""

import bisect
import collections
import glob
import os
import shutil
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import records, schedules
from tfpipe.plan.records import TaskRecord

__all__ = ["scope", "Session", "Event", "describe", "task_records"]

_SCOPE = "tfpipe_task"
_WINDOW = "tfpipe_window"
MERGE_GAP = 20e-6   # seconds: the executor's pauses between one task's ops are a few µs
_GRADIENT = "gradient_tape/"   # how a tape names the gradient ops of a forward's ops
_CARRY = "carry"   # the window function's argument of values carried in from the window before

Event = collections.namedtuple("Event", ["name", "start", "end", "args"])
Event.__doc__ = "One profiled event: `start` and `end` in seconds on the profile's clock."
Spans = Dict[int, Tuple[float, float]]   # per window call n: (start, end)
# A task as `describe` gives it: (k, kind, batch, micro, version, s), None: not recorded.
Task = Tuple[int, str, int, Optional[int], Any, Any]
Entry = Optional[Task]
Described = Tuple[List[Entry], Dict[int, int]]   # (entries, backward_of) of a window


def scope(i: int) -> Any:
  """The name scope of a window's task i (its place in the window's trace)."""
  return tf.name_scope(f"{_SCOPE}{i}")


def _task_index(op_name: str, backward_of: Dict[int, int]) -> Optional[int]:
  """i of the task that ran an op: the op was traced under `scope(i)`; or, for a gradient op
  named after forward i's op ("gradient_tape/" + its name), the task `backward_of[i]` that
  took the gradient through i's kept tape. None for ops of no task."""
  gradient = op_name.startswith(_GRADIENT)
  head = op_name[len(_GRADIENT) if gradient else 0:].split("/", 1)[0]
  if not (head.startswith(_SCOPE) and head[len(_SCOPE):].isdigit()):
    return None
  i = int(head[len(_SCOPE):])
  return backward_of.get(i, i) if gradient else i


def _read_trace(path: str) -> List[Event]:
  """The profile's trace events (`Event`s) of one `.xplane.pb` file."""
  return [Event(name, start * 1e-12, (start + duration) * 1e-12, args)
          for name, start, duration, args in compat.profile_trace_events(path)]


class Session:
  """One profiler session over some window calls (the compiled executor runs one per epoch).

  `start()` starts the profiler (False, with a warning, when it cannot: e.g.
  another profile is running); each window call runs inside `window(n)`;
  `stop()` reads the profile and returns its events and, per call n, its
  span, on `time.perf_counter`'s clock. The profile is written to a
  temporary folder; with `keep_in`, it is moved to TensorBoard's place there
  (`plugins/profile/<run>/`, the run named by the time and `run_suffix`).
  """

  def __init__(self, keep_in: Optional[str] = None, run_suffix: str = "") -> None:
    self.keep_in, self.run_suffix = keep_in, run_suffix
    self._entered: Dict[int, float] = {}   # call n -> time.perf_counter() when it began
    self.active, self.logdir = False, ""

  def start(self) -> bool:
    self.logdir = tempfile.mkdtemp(prefix="tfpipe_profile_")
    try:
      tf.profiler.experimental.start(self.logdir)
    except Exception as e:  # pylint: disable=broad-except
      warnings.warn(f"tfpipe: the profiler did not start ({e}); this epoch has no task "
                    "timeline", RuntimeWarning)
      shutil.rmtree(self.logdir, ignore_errors=True)
      return False
    self.active = True
    return True

  def window(self, n: int) -> Any:
    """The context of window call n."""
    self._entered[n] = time.perf_counter()
    return tf.profiler.experimental.Trace(_WINDOW, step_num=n, _r=1)

  def stop(self) -> Tuple[List[Event], Spans]:
    """(events, {n: (start, end)}), both on `time.perf_counter`'s clock; ([], {}) if inactive."""
    if not self.active:
      return [], {}
    self.active = False
    try:
      tf.profiler.experimental.stop()
      written = glob.glob(os.path.join(self.logdir, "plugins", "profile", "*", "*.xplane.pb"))
      if not written:
        raise RuntimeError(f"the profiler wrote no profile under {self.logdir}")
      events = _read_trace(written[0])
      if self.keep_in:
        run = os.path.join(self.keep_in, "plugins", "profile",
                           os.path.basename(os.path.dirname(written[0])) + self.run_suffix)
        os.makedirs(run, exist_ok=True)
        shutil.move(written[0], os.path.join(run, os.path.basename(written[0])))
    finally:
      shutil.rmtree(self.logdir, ignore_errors=True)
    calls: Spans = {}
    for e in events:
      if e.name.startswith(_WINDOW):
        n = int(e.args.get("step_num", e.name[len(_WINDOW):].strip() or -1))
        calls[n] = (e.start, e.end)
    if not calls:
      return [], {}
    # The profile's clock to perf_counter's: a call's trace starts as Python enters it.
    shift = min(self._entered[n] - calls[n][0] for n in calls if n in self._entered)
    events = [e._replace(start=e.start + shift, end=e.end + shift) for e in events]
    return events, {n: (a + shift, b + shift) for n, (a, b) in calls.items()}


def task_records(events: List[Event], calls: Spans, tasks: Dict[int, Described],
                 epoch: int) -> List[TaskRecord]:
  """TaskRecords of the profiled window calls.

  calls: {n: (start, end)} (`Session.stop`); tasks: {n: (entries,
  backward_of)} per call: entries[i] = (k, kind, batch, micro, version, s) of
  the task traced under `scope(i)` (None: not recorded), backward_of {i: j}:
  task j takes the gradient through forward i's kept tape. Tasks with no
  profiled op (e.g. on another process's device) get no record; transfers
  are the `_Send` ops from a task of stage k to one of stage k+1 (XF) or k-1
  (XB), recorded under k.
  """
  spans = sorted((start, end, n) for n, (start, end) in calls.items())
  starts = [s for s, _, _ in spans]

  def call_of(t: float) -> Optional[int]:
    j = bisect.bisect_right(starts, t) - 1
    return spans[j][2] if j >= 0 and t <= spans[j][1] else None

  def entry(n: int, name: str) -> Optional[Tuple[int, Task]]:
    entries, backward_of = tasks[n]
    i = _task_index(name, backward_of)
    task = entries[i] if i is not None and i < len(entries) else None
    return None if i is None or task is None else (i, task)

  ops: Dict[Tuple[int, int], List[Tuple[float, float]]] = collections.defaultdict(list)
  moves: Dict[Tuple[int, int, int], Tuple[float, float]] = {}
  carried: Dict[Tuple[int, int], Tuple[float, float]] = {}
  for e in events:
    n = call_of(e.start)
    if n is None or n not in tasks:
      continue
    found = entry(n, e.args.get("long_name") or e.args.get("tf_op") or "")
    if found is None:
      if e.name == "_Send" and e.args.get("from", "").startswith(_CARRY):
        # A value carried in from the window before (outputs, gradients) moves to the device
        # of the task that takes it when this call starts: the transfer of the stage before
        # (a forward's or step's input) or after (a backward's output gradients).
        taker = entry(n, e.args.get("to", ""))
        if taker is not None:
          j = taker[0]
          lo, hi = carried.get((n, j), (e.start, e.end))
          carried[(n, j)] = (min(lo, e.start), max(hi, e.end))
      continue
    i, task = found
    ops[(n, i)].append((e.start, e.end))
    receiver = entry(n, e.args.get("to", "")) if e.name == "_Send" else None
    if receiver is not None and abs(receiver[1][0] - task[0]) == 1:
      key = (n, i, receiver[1][0])
      lo, hi = moves.get(key, (e.start, e.end))
      moves[key] = (min(lo, e.start), max(hi, e.end))

  def task_at(n: int, i: int) -> Task:
    found = tasks[n][0][i]
    assert found is not None   # `entry` found it
    return found

  out = []
  for (n, i), spans_of_task in ops.items():
    k, kind, batch, micro, version, s = task_at(n, i)
    out += [TaskRecord(k, kind, batch, version, s, start, end, micro, epoch)
            for start, end in _runs(spans_of_task)]
  for (n, i, to), (start, end) in moves.items():
    k, _, batch, micro, _, _ = task_at(n, i)
    out.append(TaskRecord(k, "XF" if to == k + 1 else "XB", batch, None, None, start, end,
                          micro, epoch))
  for (n, j), (start, end) in carried.items():
    k, kind, batch, micro, _, _ = task_at(n, j)
    # A backward's gradients come from the stage after (the last stage has none: its step
    # is "FB"); any other task's input from the stage before (stage 0's are no stage's).
    sender, direction = (k + 1, "XB") if kind == "B" else (k - 1, "XF")
    if sender >= 0:
      out.append(TaskRecord(sender, direction, batch, None, None, start, end, micro, epoch))
  return sorted(out, key=lambda r: r.start)


def _runs(spans: List[Tuple[float, float]]) -> List[Tuple[float, ...]]:
  """`spans` (start, end) merged into runs: a pause longer than `MERGE_GAP` starts a new run."""
  runs: List[List[float]] = []
  for start, end in sorted(spans):
    if runs and start <= runs[-1][1] + MERGE_GAP:
      runs[-1][1] = max(runs[-1][1], end)
    else:
      runs.append([start, end])
  return [tuple(r) for r in runs]


def describe(window: Any, updates: Sequence[int], kept: Sequence[bool], profiled: Sequence[bool],
             forwards: Dict[Tuple[int, int, Optional[int]], Any]) -> Described:
  """(entries, backward_of) of a compiled `window` for `task_records`: per task in trace order
  (k, kind, batch, micro, version, s) as the threaded executor records it (version: updates of
  stage k whose weights the task read; `updates`: each stage's count before the window), None
  for the last stage's forwards (kept for its step) and for stages not `profiled` (on other
  processes); backward_of: {i: j} where backward j takes its gradient through forward i's tape
  (`kept[k]`: stage k's backward reads its forward's kept tape). `forwards` ((k, b, micro) ->
  (version, s, index in its window or None)) carries the forwards waiting for a backward from
  one window to the next."""
  K = len(updates)
  counts, entries, backward_of = list(updates), [], {}
  for j, (k, task, s, units) in enumerate(window.tasks):
    last, unit = k == K - 1, (k, task.batch, task.micro)
    entry = None
    if task.kind == "F":
      forwards[unit] = (counts[k], s, j)
      if not last:
        entry = (k, "F", task.batch, task.micro, counts[k], s)
    elif task.kind in ("U", "W"):
      entry = (k, task.kind, task.batch, task.micro, counts[k], s)
    elif task.kind == "B":
      read = [forwards.pop((k,) + u) for u in units]
      if last:
        entry = (k, records.STEP, task.batch, task.micro, counts[k], read[0][1])
      else:
        through = len(units) == 1 and kept[k]
        entry = (k, "B", task.batch, task.micro, read[0][0] if through else counts[k], s)
        if through and read[0][2] is not None:
          backward_of[read[0][2]] = j
    counts[k] += schedules.is_update(task)
    entries.append(entry if profiled[k] else None)
  for unit, (version, s, _) in forwards.items():   # kept past this window: recomputed
    forwards[unit] = (version, s, None)
  return entries, backward_of
