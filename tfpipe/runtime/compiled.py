"""The compiled executor: one `tf.function` runs a window of the schedule on every stage.

K: stages, k: stage index, b: mini-batch, W: mini-batches per window (see
`tfpipe.plan.windows`). Python traces a window's tasks in the verifier's
global order, each stage's ops under its device; TensorFlow's executor then
runs the stages' ops concurrently, as their data allow (inter-op threads on
CPU, one stream per GPU, one partitioned function across TF server tasks):
Python runs once per window, not once per task. Variables are read and
updated in each stage's own order (automatic control dependencies order the
ops on one variable as traced), so every task reads the weights of the
weight rule (docs/methods.md), as in the threaded executor.

Inside a window a forward whose backward reads its weights (a stash, or
SpecTrain's reused prediction) keeps its tape; the backward takes the
gradient through it later in the same graph. What crosses a window boundary
is carried as tensors into the next call:
  "x":     forward outputs on their way to stage k+1 (and their share `scale`);
  "saved": forwards waiting for their backward: the stage inputs, the
           non-trainable state they read (random seeds) and, when the
           backward reads the forward's weights, those weights; the backward
           then recomputes the forward on them (same inputs, weights and
           draws: the same values);
  "g":     input gradients on their way to stage k-1.
Batch hooks run after each window (`train_epoch`).

With `record`, each training epoch runs under the TensorFlow profiler and the
tasks' records come from its timeline (`tfpipe.runtime.timeline`).
"""

import collections
import contextlib
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence
from typing import Tuple, Union

import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import records, schedules, tasks as plan_tasks, windows as windows_lib
from tfpipe.runtime import base, calls, grouped, groups, inference, interpreter, loops, parked
from tfpipe.runtime import timeline, window_moves
from tfpipe.runtime.base import Executor
from tfpipe.runtime.calls import StageFailed
from tfpipe.runtime.protocol import StageProtocol

__all__ = ["CompiledRuntime", "StageFailed"]

Key = Tuple[schedules.Action, ...]   # a window's tasks, batches counted from its first


class CompiledRuntime(Executor):
  """Runs schedules one window of `window` mini-batches per `tf.function` call.

  `window` may change between epochs (`set_window`); each distinct window
  shape traces once (the steady state, plus the warm-up and drain windows)
  and is reused across epochs. `aligned`: results are handed on once per
  `window` mini-batches, as Keras's `steps_per_execution` calls its batch
  hooks; when no batch hook reads them (`set_window(..., aligned=False)`)
  windows end where the steady state allows and the drain runs alone
  (`tfpipe.plan.windows.drained_firsts`), each window's results handed on
  when it ends. With `record`, each epoch is profiled
  (`tfpipe.runtime.timeline`); its TensorBoard profile is kept in
  `profile_dir` when set.
  """

  # The constants below were chosen by measurement; the figures are in bench/results/history.md
  # ("The compiled executor's constants").
  # Small stages: windows whose inlined graph would hold at most this many ops (3 x a
  # forward's, per stage and micro-batch: W x M forwards) trace their tasks inline when they
  # have micro-batches (M > 1), and call them in whole windows with one batch per update.
  INLINE_OPS = 20000
  # A loop window (a schedule that finishes each mini-batch before the next: `loops`) holds one
  # mini-batch's tasks, M micro-batches on every stage, whatever W is: it traces its tasks
  # inline where that graph would hold at most this many ops (3 x the forwards' ops x M).
  INLINE_LOOP_OPS = 60000
  # Windows of stage calls trace at most this many mini-batches; a window of more runs as
  # several calls of them, its results handed on together.
  CALL_WINDOW = 4
  # With micro-batches (M > 1) at most this many: a mini-batch then holds M times the tasks.
  CALL_WINDOW_MICRO = 2

  windowed = True
  profiles = True

  def __init__(self, programs: Sequence[StageProtocol], window: int = 16, record: bool = False,
               maxsize: Optional[int] = None, inline: Union[bool, str] = "auto") -> None:
    super().__init__(programs, record=record, maxsize=maxsize)
    if inline not in ("auto", True, False):
      raise ValueError(f"`inline` must be 'auto', True or False. Received: inline={inline!r}")
    self.window, self.inline, self.aligned = window, inline, True
    self._forward_ops: Optional[int] = None
    self.profile_dir: Optional[str] = None
    self._session: Optional[timeline.Session] = None
    self._calls: Dict[int, Any] = {}   # window call n -> `timeline.describe`'s
    self._forwards: Dict[Any, Any] = {}
    # (window key, inlined) -> its number (the traced function's argument)
    self._keys: Dict[Tuple[Key, bool], int] = {}
    self.numbered: List[_Numbered] = []   # number -> its `_Numbered` window
    # The profiler sees this process's devices only: stages on TF servers get no records.
    self._profiled = [tf.DeviceSpec.from_string(p.device).job in (None, "localhost")
                      for p in programs]
    # Per schedule, window size and way (lately run): its windows, their numbers, and the
    # flush window or None.
    self._plans = base.Recent()
    # The last epoch's (key, windows, numbers, flush).
    self._plan: Tuple[Any, ...] = (None, None, None, None)
    self.remote = any(p.remote for p in programs)   # stages on TF servers: a carry to park
    self.parked = parked.Parked()   # the carry made on TF servers, kept there between calls
    # Per batch size; any sequence length.
    self._train = calls.Relaxed(self._parked_window if self.remote else self._train_window)
    self.grouped = grouped.GroupedWindows(self)   # a plan's windows as one function's branches
    self.loops = loops.LoopWindows(self)   # windows that loop over their mini-batches
    self.inference = inference.InferenceWindows(self)   # evaluate and predict
    self.traces = 0   # windows traced so far (a new window shape traces once)
    # Grappler's layout optimizer serves GPU stages only (`compat.light_calls`).
    specs = [tf.DeviceSpec.from_string(p.device) for p in programs]
    self._gpu = any(s.device_type == "GPU" for s in specs)
    # Every stage a logical CPU of this process: small stages with one batch per update call
    # their functions (`_calls_small`; measured there only).
    self._local_cpus = all(s.device_type == "CPU" and s.job in (None, "localhost")
                           for s in specs)

  def set_window(self, window: int, aligned: bool = True) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
      raise ValueError(f"a window holds a positive number of mini-batches. Received: {window!r}")
    self.window, self.aligned = window, bool(aligned)

  # Training.

  def train_epoch(self, schedule: schedules.Lists, diffs: windows_lib.Diffs,
                  batches: Iterator[Any], num_batches: int, on_result: base.OnResult,
                  before: base.Before = None, continuing: bool = False) -> int:
    """Runs one epoch of `schedule` over `num_batches` mini-batches from `batches`.

    After each window, for every mini-batch b it finished in order:
    `before(b)`, then `on_result(b, loss, logs)`. When `on_result` returns
    True, the batches already started finish (a drain window) and no
    further batch starts. Returns the number of mini-batches trained.
    `continuing`: the call runs the rest of the last epoch, stopped part way (its records
    and counts are that epoch's).
    """
    self._start_epoch(schedule, continuing)
    M = schedules.micro_batches(schedule)
    # Inlined windows (small stages with micro-batches) and calls of small stages run whole
    # windows; other windows of stage calls trace CALL_WINDOW mini-batches at most
    # (CALL_WINDOW_MICRO with micro-batches).
    inlined = self._inlined(num_batches, M)
    size = self._window_size(M, inlined, num_batches)
    key = (self.schedule_key, tuple(tuple(sorted(d.items())) for d in diffs), size, inlined,
           self.aligned)

    def planned() -> Tuple[List[windows_lib.Window], List[int], Optional[windows_lib.Window]]:
      plan = windows_lib.plan(schedule, diffs, size, self.aligned)
      return (plan, [self._number(window, inlined) for window in plan],
              windows_lib.flush_window(schedule, diffs))
    plan, numbers, flush = self._plans.get(key, planned)
    self._plan = (key, plan, numbers, flush)   # this epoch's
    for k, tasks in enumerate(schedule):
      keeps = plan_tasks.keeps_weights(self.programs[k].policy)
      peaks = records.kept_peaks(tasks, diffs[k], keeps, k == self.K - 1)
      self.peak_saved[k] = max(self.peak_saved[k], peaks[0])
      self.peak_versions[k] = max(self.peak_versions[k], peaks[1])
    if self.record:
      self._calls, self._forwards = {}, {}
      self._session = timeline.Session(self.profile_dir, run_suffix=f"_epoch{self.epoch}")
      if not self._session.start():
        self._session = None
    try:
      if flush is not None and self._session is None:
        return self.loops.train(flush, self._number(flush, self._inlined_loop(M)), batches,
                                num_batches, M, on_result, before)
      done = self._train_windows(plan, numbers, batches, M, on_result, before)
      self.parked.release()   # nothing is carried past an epoch
      return done
    finally:
      if self._session is not None:
        events, calls = self._session.stop()
        self._session = None
        self.records += timeline.task_records(events, calls, self._calls, self.epoch)

  def _train_windows(self, plan: List[windows_lib.Window], numbers: List[int],
                     batches: Iterator[Any], M: int, on_result: base.OnResult,
                     before: base.Before) -> int:
    """Runs the windows of `plan`; hands on their results once per `self.window` mini-batches
    (`CALL_WINDOW`: a window may run as several calls), or when not `aligned` as each ends."""
    feed, done = calls.Feed(batches, labelled=True), 0
    carry: groups.Carry = {"x": {}, "saved": {}, "g": {}}
    pending: List[Tuple[int, Any]] = []
    boundary = self.window
    group = self.grouped.group_of(plan, numbers)
    for w, window in enumerate(plan):
      if group is not None:
        ran = self.grouped.run(group, window, numbers[w], carry, feed, M)
        if ran is None:   # ungroupable, or batches of other shapes: each its own function
          group = None
        else:
          carry, results = ran
      if group is None:
        carry, results = self._run(window, numbers[w], carry, feed, M)
      pending += zip(range(window.first, window.last + 1), results)
      if self.aligned and window.last + 1 < boundary and w + 1 < len(plan):
        continue   # the rest of this window of `self.window` mini-batches comes first
      while boundary <= window.last + 1:
        boundary += self.window
      stop = False
      for b, (loss, logs) in pending:
        if before is not None:
          before(b)
        stop = bool(on_result(b, loss, logs)) or stop
        done += 1
      pending = []
      if stop and w + 1 < len(plan):
        last = windows_lib.drain(plan, w)
        if last is not None:
          inline = self.numbered[numbers[w]].inline
          _, results = self._run(last, self._number(last, inline), carry, feed, M)
          for b in range(last.first, last.last + 1):
            on_result(b, *results[b - last.first])
            done += 1
        break
    return done

  def _number(self, window: windows_lib.Window, inline: bool) -> int:
    """The number of `window`'s key and `inline` (whether its tasks' bodies are traced into it,
    `_inlined`): what the traced function takes
    instead of the key (a large Python argument is hashed by tf.function on every call;
    measured: most of a call's cost at K=8). Numbered once per plan."""
    number = self._keys.setdefault((window.key, inline), len(self._keys))
    if number == len(self.numbered):
      self.numbered.append(_Numbered(window.key, inline, window.last + 1 - window.first))
    return number

  def inlines(self, schedule: schedules.Lists, diffs: windows_lib.Diffs, num_batches: int,
              loops: Optional[bool] = None) -> bool:
    """Whether an epoch of `schedule` (version differences `diffs`) over `num_batches`
    mini-batches traces its tasks' bodies into its graphs (else each task calls its stage's
    traced function): what a task costs besides its ops (`tfpipe.instruments.costs`).
    `loops`: whether `schedule` runs as a loop window, if known (`windows.flush_window`)."""
    if self._loops(schedule, diffs, loops):
      return self._inlined_loop(schedules.micro_batches(schedule))
    return self._inlined(num_batches, schedules.micro_batches(schedule))

  def crossing(self, schedule: schedules.Lists, diffs: windows_lib.Diffs,
               num_batches: int) -> List[float]:
    """Per stage, the share of its backwards that recompute their forward because it ran in
    an earlier window (`tfpipe.plan.windows.crossing`) in an epoch of `schedule` over
    `num_batches` mini-batches, cut as `train_epoch` cuts it: what the profile adds to a
    backward that reads a kept tape (`tfpipe.instruments.costs`). Only inlined windows
    recompute: a window of stage calls carries the forward's residuals instead
    (`tfpipe.stage.program.Kept`)."""
    M = schedules.micro_batches(schedule)
    if self._loops(schedule, diffs):
      return [0.0] * self.K   # a loop window holds each mini-batch whole
    inlined = self._inlined(num_batches, M)
    if not inlined:
      return [0.0] * self.K
    return windows_lib.crossing(windows_lib.plan(schedule, diffs, self.window, self.aligned),
                                self.K)

  def traced_copies(self, schedule: schedules.Lists, diffs: windows_lib.Diffs,
                    num_batches: int, loops: Optional[bool] = None) -> List[int]:
    """Per stage, how many copies of its tasks an epoch of `schedule` (version differences
    `diffs`) over `num_batches` mini-batches traces and optimises: a loop window inlined, its
    M micro-batches; inlined windows, the forwards in the distinct windows (the steady ones
    trace once); windows of stage calls, one (each stage function is traced once). What a
    method pays at start-up besides what every method pays (`tfpipe.training.auto`). `loops`
    as `inlines`'s."""
    M = schedules.micro_batches(schedule)
    if self._loops(schedule, diffs, loops):
      return [M if self._inlined_loop(M) else 1] * self.K
    inlined = self._inlined(num_batches, M)
    if not inlined:
      return [1] * self.K
    return windows_lib.traced_forwards(
        windows_lib.plan(schedule, diffs, self.window, self.aligned), self.K)

  def _loops(self, schedule: schedules.Lists, diffs: windows_lib.Diffs,
             loops: Optional[bool] = None) -> bool:
    """Whether an epoch of `schedule` runs as a loop window (`loops`: whether it would, if
    known): one that finishes each mini-batch before the next, unless recorded."""
    if loops is None:
      loops = windows_lib.flush_window(schedule, diffs) is not None
    return loops and not self.record

  def _window_size(self, M: int, inlined: bool, num_batches: int) -> int:
    """Mini-batches a window of an epoch of `num_batches` traces: `window` inlined, or as
    calls of small stages with one batch per update on this process's CPUs (`INLINE_OPS`:
    the calls' cost is a window's, spread over its mini-batches), else at most CALL_WINDOW
    (with micro-batches, CALL_WINDOW_MICRO)."""
    if inlined or (self._calls_small(M) and self._small(num_batches, M)):
      return self.window
    return min(self.window, self.CALL_WINDOW if M == 1 else self.CALL_WINDOW_MICRO)

  def _small(self, num_batches: int, M: int) -> bool:
    """Whether the stages are small: an inlined window of the epoch (W mini-batches, or the
    epoch's when it is shorter, of M micro-batches each) would hold at most `INLINE_OPS`."""
    return self._inlined_ops(min(self.window, num_batches) * M) <= self.INLINE_OPS

  def _calls_small(self, M: int) -> bool:
    """Whether small stages call their functions (in whole windows) rather than inline their
    tasks: with one batch per update, every stage a logical CPU of this process."""
    return M == 1 and self._local_cpus

  def _inlined(self, num_batches: int, M: int) -> bool:
    """Whether an epoch of `num_batches` mini-batches of M micro-batches traces each task's
    body into its windows' graphs rather than a call of the stage's traced function: when
    profiled (the timeline reads each op's task scope), else as `inline` says; "auto": on
    small stages (`_small`) with micro-batches (M > 1), or with one batch per update where a
    stage is not a logical CPU of this process (on TF servers each task call is a remote
    call: `runtime_overhead.py`'s K=2 on servers 5.5 ms a mini-batch as calls against 1.3 ms
    inlined). Calls trace and optimise each stage function once, so start-up does not grow
    with W; each costs a function call per task when it runs (tens of microseconds: felt by
    tiny stages, 2KM calls a mini-batch). On TF servers, calls where a stage runs a while
    loop (`_loops_on_servers`), inline where a stage has replicas (`_replicas_on_servers`)."""
    if self.record:
      return True
    if self.inline != "auto":
      return self.inline is True
    if self._loops_on_servers():
      return False
    if self._replicas_on_servers():
      return True
    return self._small(num_batches, M) and not self._calls_small(M)

  def _inlined_loop(self, M: int) -> bool:
    """Whether a loop window (one mini-batch of M micro-batches, `loops`) traces its tasks'
    bodies inline: as `inline` says; "auto": when that graph is small (`INLINE_LOOP_OPS`),
    unless `_loops_on_servers` (calls) or `_replicas_on_servers` (inline)."""
    if self.inline != "auto":
      return self.inline is True
    if self._loops_on_servers():
      return False
    if self._replicas_on_servers():
      return True
    return self._inlined_ops(M) <= self.INLINE_LOOP_OPS

  def _loops_on_servers(self) -> bool:
    """Whether stages on TF servers run a while loop of their own (a recurrent layer): their
    windows call them, placed on their devices, rather than inline them. Inlined, the
    residual LSTM's stages on 2 loopback servers moved 3.1 GB a step through the loopback
    under spectrain (5.3 MB as calls) and held 11-13 and 7.5 GB under 1f1b (2.2 and 0.9 GB
    as calls; 3.9 GB for the whole run in one process). Why: a loop window's backward from
    a forward's residuals is TensorFlow's gradient function of it, whose ops TensorFlow
    builds with no device; inlined into the window, its loop's control nodes (Enter, Merge,
    Switch) keep none and the placer puts them on the window's device, the client's, so
    every iteration crosses the client's link; in a window of inlined tasks, a weight read
    with no device of its own, which the loop reads at every step, takes its Enter node
    there too (seen in the placed graphs on logical CPUs)."""
    return self.remote and any(p.forward_loops() for p in self.programs)

  def _replicas_on_servers(self) -> bool:
    """Whether a stage's replicas (`data_parallel`) are on TF servers: windows then inline
    their tasks. A replicated stage's task as a call is one function placed on its first
    replica's device, so the other replicas' outputs and kept residuals (the weights they
    read among them) went there and back for every micro-batch: 12 times the ring's bound
    (measured: bench/results/history.md)."""
    return self.remote and any(len(p.replica_devices) > 1 for p in self.programs)

  def _inlined_ops(self, forwards: int) -> int:
    """About the ops an inlined graph of `forwards` forwards on every stage holds: 3 x each
    forward's (its backward and update), the stages' forward ops counted once per runtime."""
    if self._forward_ops is None:
      self._forward_ops = sum(p.forward_ops() for p in self.programs)
    return 3 * self._forward_ops * forwards

  def call(self, function: Callable[..., Any], number: int, *args: Any) -> Any:
    """Calls a window function: an inlined window as it is (its graph optimised as a whole, by
    the lighter Grappler of `compat.light_calls`);
    a window of task calls without optimising its own graph (its trace makes the task calls
    with the stages' options: `_trace_tasks`)."""
    if self.numbered[number].inline:
      with compat.light_calls(layout=self._gpu):
        return function(number, *args)
    with compat.unoptimised_calls():
      return function(number, *args)

  def _run(self, window: windows_lib.Window, number: int, carry: groups.Carry, feed: calls.Feed,
           M: int) -> Tuple[groups.Carry, List[Any]]:
    """Calls the window's function (`number`: `_number(window, inline)`); returns (carry
    rebased to the next window, results)."""
    inputs, labels = self.data(window, feed)
    context = contextlib.nullcontext()
    if self._session is not None:
      n = len(self._calls)
      self._calls[n] = timeline.describe(
          window, self.updates, [p.ops["B"].reads == "kept" for p in self.programs],
          self._profiled, self._forwards)
      context = self._session.window(n)
    traced = self._train.tracing_count()
    with context:
      try:
        slot = None
        args: Tuple[Any, ...] = (carry, inputs, labels, M)   # every stage in this process
        if self.remote:
          slot = (self._train.key(inputs, 0), number)
          args = (slot, self.parked.shapes_of(carry)) + args
        out, results = self.call(self._train.get(inputs, 0), number, *args)
      except tf.errors.OpError as error:
        calls.raise_clearer(error)
    self.traces += self._train.tracing_count() - traced
    self.finished(window, feed)
    return groups.rebase(self.parked.unpark(slot, out), window.last + 1 - window.first), results

  def data(self, window: windows_lib.Window,
           feed: calls.Feed) -> Tuple[Dict[int, Any], Dict[int, Any]]:
    """(inputs, labels) of `window`: {batch counted from its first: stage 0's inputs} and
    {batch: (labels, sample weights)} of the last stage's forwards."""
    inputs, labels = {}, {}
    for k, task, _, _ in window.tasks:
      if task.kind == "F":   # a mini-batch's micro-batches may fall in two windows: both split it
        xs, y, sample_weight = feed.get(task.batch)
        if k == 0:
          inputs[task.batch - window.first] = xs
        if k == self.K - 1:
          labels[task.batch - window.first] = (y, sample_weight)
    return inputs, labels

  def finished(self, window: windows_lib.Window, feed: calls.Feed) -> None:
    """After `window` ran: its mini-batches' data is dropped, its updates counted."""
    feed.drop_before(window.last + 1)   # finished: their labels were used too
    updates = [0] * self.K
    for k, task, _, _ in window.tasks:
      updates[k] += schedules.is_update(task)
    for k, count in enumerate(updates):
      if count:
        self.count_updates(k, count)

  def _train_window(self, number: int, carry: groups.Carry, inputs: Dict[int, Any],
                    labels: Dict[int, Any], M: int) -> Tuple[groups.Carry, List[Any]]:
    """Traces the tasks of key `number` (of `windows.Window.key`s, in `self._keys`); returns
    (carry, per-batch results)."""
    key, inline, _ = self.numbered[number]
    return self.trace_tasks(key, inline, carry, inputs, labels, M)

  def _parked_window(self, number: int, slot: Tuple[Any, ...], shapes: Any, carry: groups.Carry,
                     inputs: Dict[int, Any], labels: Dict[int, Any],
                     M: int) -> Tuple[groups.Carry, List[Any]]:
    """`_train_window` with stages on TF servers: the carry's tensors made there stay there,
    in the variables of `slot` (`tfpipe.runtime.parked`; `shapes`: those read, as traced)."""
    carry, reads = self.parked.read(carry, shapes)
    out, results = self._train_window(number, carry, inputs, labels, M)
    return self.parked.park(slot, out, reads), results

  def trace_tasks(self, key: Key, inline: bool, carry: groups.Carry, inputs: Dict[int, Any],
                  labels: Dict[int, Any], M: int) -> Tuple[groups.Carry, List[Any]]:
    """Traces the tasks of window key `key` (see `_train_window`), their bodies `inline` or as
    calls of the stages' traced functions."""
    # The task calls' options: their functions are optimised. Their outputs' shapes are
    # inferred once per function and input shapes (per call: a fifth of a deep model's trace).
    # Calls (not XLA's) take a marker that spares TensorFlow a scan of each call's callee
    # when it instantiates the window (`compat.calls_marked`). A kept forward's gradient
    # across a call keeps constant exponents constant (`compat.constant_exponents`).
    marked = self.marked() if not inline else contextlib.nullcontext()
    with compat.optimised_calls(), compat.calls_inferred_once(), compat.constant_exponents(), \
        marked, contextlib.ExitStack() as stack:
      for program in self.programs:   # the tracing mode: each stage's tasks in place, or calls
        stack.enter_context(program.inlined(inline))
      return self._traced_tasks(key, carry, inputs, labels, M)

  def marked(self) -> ContextManager[Any]:
    """`compat.calls_marked` for the stages' devices; nothing when a stage runs under XLA."""
    if any(p.jit_compile for p in self.programs):
      return contextlib.nullcontext()
    return compat.calls_marked([p.device for p in self.programs])

  def _traced_tasks(self, key: Key, carry: groups.Carry, inputs: Dict[int, Any],
                    labels: Dict[int, Any], M: int) -> Tuple[groups.Carry, List[Any]]:
    moves = window_moves.WindowMoves(self, carry, inputs, labels, M)
    stages = [interpreter.Stage(k, p, k == self.K - 1) for k, p in enumerate(self.programs)]
    for (k, b, micro), (kept, share) in carry["saved"].items():
      stages[k].saved[(b, micro)] = interpreter.Saved(kept, None, share)
    for i, action in enumerate(key):
      with timeline.scope(i):   # names the task's ops in the profile
        interpreter.run(action, stages[action.stage], moves)
    if any(stage.losses or stage.halves or stage.last and stage.saved for stage in stages):
      # windows.plan prevents it
      raise AssertionError("a window cut a last-stage step or a split backward apart")
    # Forwards still waiting cross into the next window with the residuals their calls output
    # (`StageProgram.carried`), or, inlined, without their tapes: their backward then
    # recomputes them on the kept inputs, weights and random state (the same values).
    saved = {(stage.k,) + unit: (stage.program.carried(part.kept), part.share)
             for stage in stages for unit, part in stage.saved.items()}
    return ({"x": moves.outputs, "saved": saved, "g": moves.gradients},
            [moves.results[b] for b in sorted(moves.results)])

  # Inference.

  def infer_epoch(self, batches: Iterator[Any], num_batches: int, on_result: base.OnResult,
                  with_labels: bool, before: base.Before = None) -> None:
    """Forward-only pass with current weights (evaluate and predict), a window at a time
    (`tfpipe.runtime.inference`)."""
    self.inference.run(batches, num_batches, on_result, with_labels, before)


class _Numbered(collections.namedtuple("_Numbered", ["key", "inline", "shift"])):
  """A numbered window: its key, whether its tasks are inlined, and its mini-batches (what
  its carry is rebased by for the next window)."""
