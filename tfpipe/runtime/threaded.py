"""The threaded executor: worker threads run each stage's task list; transfer threads move tensors.

K: stages, k: stage index, b: mini-batch index, s: version difference.

Stage k's worker runs its (verified) schedule in order. Stage 0 splits a
mini-batch into micro-batches when the schedule has them, each carrying its
share of the mini-batch (the `scale` of its loss). Forward outputs go into a
bounded channel; a transfer thread copies them onto stage k+1's device and
hands them on; gradients flow back the same way. At the last stage a
backward follows the forwards it covers and runs with them as one compiled
step (the stage joins a TiMePReSt mini-batch's). The first exception in any
thread sets a shared stop event: every blocked thread wakes within `poll`
seconds and exits, and the caller re-raises that first exception with its
traceback.
"""

import functools
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from tfpipe.plan import schedules, verify, windows
from tfpipe.plan.records import TaskRecord
from tfpipe.runtime import interpreter
from tfpipe.runtime.interpreter import Micro
from tfpipe.runtime.base import Before, Executor, OnResult
from tfpipe.runtime.links import Channel, Countdown, Links, Skipped, copy_to, spawn
from tfpipe.runtime.protocol import StageProtocol

__all__ = ["Runtime"]

class Runtime(Executor):
  """Runs schedules task by task: a worker thread per stage, transfer threads between them.

  The reference interpreter of a schedule (and the one to debug with): it
  pays Python and eager TensorFlow work per task, so it does not scale with
  stages; `tfpipe.runtime.compiled` does. `maxsize`: each link holds at most
  2 * maxsize + 1 items in flight (a sender queue, the transfer thread, a
  receiver queue): `link_capacity`.
  """

  def __init__(self, programs: Sequence[StageProtocol], record: bool = False,
               poll: float = 0.05, maxsize: Optional[int] = None) -> None:
    super().__init__(programs, record=record, maxsize=maxsize)
    self.poll = poll

  def train_epoch(self, schedule: schedules.Lists, diffs: windows.Diffs, batches: Iterator[Any],
                  num_batches: int, on_result: OnResult, before: Before = None,
                  continuing: bool = False) -> int:
    """Runs one epoch of `schedule` (verified) over `num_batches` mini-batches from `batches`.

    `diffs[k][task]` is the version difference of each task. In the caller's
    thread, for every mini-batch b in order: `before(b)` when it starts
    waiting for b, then `on_result(b, loss, logs)` when b is done (`logs`: the
    running loss and metrics). When `on_result` returns True, the batches
    already due (at most L-1, `schedules.lead`) drain and no further batch is
    trained (see `links.Gate`). Returns the number of mini-batches trained.
    `continuing`: the call runs the rest of the last epoch, stopped part way (its records
    and counts are that epoch's).
    """
    self._start_epoch(schedule, continuing)
    K = self.K
    links = Links(K, self.poll, self.maxsize, schedules.micro_batches(schedule),
                  lead=schedules.lead(schedule))

    lanes = schedules.lanes(schedule)   # a device's stages run their tasks in its lane's order
    # Joint updates (`tfpipe.rules.joint`): an update waits for every stage's backwards of its
    # batch.
    countdown = (Countdown(schedule, links.stop, self.poll) if getattr(schedule, "joint", False)
                 else None)
    covers = [verify.covered_units(tasks) for tasks in schedule]

    def worker(d: int) -> None:
      moves = _LinkMoves(self, links, batches, diffs, countdown)
      stages = {k: interpreter.Stage(k, self.programs[k], k == K - 1)
                for k in {k for k, _ in lanes[d]}}
      for k, task in lanes[d]:
        if links.gate.gone(task.batch):
          continue
        action = schedules.Action(k, task, diffs[k].get(task, 0), tuple(covers[k].get(task, ())))
        try:
          interpreter.run(action, stages[k], moves)
        except Skipped:
          continue
        if countdown is not None and task.kind in ("B", "W"):
          countdown.done(task.batch)

    sent = [([t.batch for t in schedule[k] if t.kind == "F"],
             [t.batch for t in schedule[k + 1] if t.kind == "B"]) for k in range(K - 1)]
    return self._execute(links, worker, num_batches, on_result, sent, before, record=True,
                         workers=len(lanes))

  def _receivers(self, k: int, forward: bool) -> Union[str, Sequence[str]]:
    """Where stage k takes what crosses a cut: its device, or its replicas' devices when the
    items travel as one group per replica (data-parallel pipelines)."""
    program = self.programs[k]
    grouped = program.grouped_in if forward else program.grouped_out
    return program.replica_devices if grouped else program.device

  def infer_epoch(self, batches: Iterator[Any], num_batches: int, on_result: OnResult,
                  with_labels: bool, before: Before = None) -> None:
    """Forward-only pipeline with current weights (evaluate and predict).

    With labels, the last stage updates the loss and metrics and `on_result`
    gets (b, running logs); without, it gets (b, outputs). `before(b)` as in
    `train_epoch`.
    """
    K, links = self.K, Links(self.K, self.poll, self.maxsize)
    fwd, results = links.forward, links.results

    def worker(k: int) -> None:
      program = self.programs[k]
      for b in range(num_batches):
        xs, y, _ = links.inputs(k, batches, labelled=with_labels, b=b)
        if k < K - 1:
          fwd[k][0].put(((b, None), (program.forward(xs, training=False), 1.0)))
        elif with_labels:
          results.put((b, program.forward(xs, labels=y, training=False)))
        else:
          results.put((b, program.forward(xs, training=False)))

    sent: List[Tuple[List[int], List[int]]] = [(list(range(num_batches)), []) for _ in range(K - 1)]
    self._execute(links, worker, num_batches, on_result, sent, before)

  def _execute(self, links: Links, worker: Callable[[int], None], num_batches: int,
               on_result: OnResult, sent: Sequence[Tuple[List[int], List[int]]],
               before: Before = None, record: bool = False,
               workers: Optional[int] = None) -> int:
    """Runs the stage workers and the transfer threads; hands results to `on_result`.

    `sent[k]`: the batch of every item that crosses cut k forward and backward
    this epoch, in order; `record`: log the transfers (when the runtime
    records). Returns the number of results handed on.
    """
    def transfer(src: Channel, dst: Channel, device: Union[str, Sequence[str]],
                 batches: List[int], k: int, kind: str) -> None:
      for b in batches:
        if links.gate.gone(b):
          return
        try:
          unit, payload = src.get(links.cancel(b))
        except Skipped:
          return
        start = time.perf_counter()
        payload = copy_to(device, payload)
        if self.record and record:
          self.records.append(TaskRecord(k, kind, unit[0], None, None, start, time.perf_counter(),
                                         unit[1], self.epoch))
        dst.put((unit, payload))

    done = 0
    with spawn(links.stop) as launch:
      for k in range(workers or self.K):   # a worker per stage, or per device (its lane)
        launch(functools.partial(worker, k), f"tfpipe-{'device' if workers else 'stage'}{k}")
      for k in range(self.K - 1):
        launch(functools.partial(transfer, links.forward[k][0], links.forward[k][1],
                                 self._receivers(k + 1, forward=True), sent[k][0], k, "XF"),
               f"tfpipe-fwd{k}")
        if sent[k][1]:
          launch(functools.partial(transfer, links.backward[k][0], links.backward[k][1],
                                   self._receivers(k, forward=False), sent[k][1], k + 1, "XB"),
                 f"tfpipe-bwd{k}")
      for b in range(num_batches):
        if before is not None:
          before(b)
        try:
          result = links.results.get(links.cancel(b))
        except Skipped:
          break
        done += 1
        links.gate.handled(b, stop=bool(on_result(*result)))
    return done


class _LinkMoves(interpreter.Moves):
  """How values move between the threaded executor's workers: bounded links (`links.Links`),
  whose transfer threads copy them onto the next stage's device. Stage 0 reads and splits the
  mini-batches; shares are floats until a task takes them; versions are counted and tasks
  timed (`TaskRecord`s); a mini-batch's result goes to the caller's thread."""

  def __init__(self, runtime: Runtime, links: Links, batches: Iterator[Any],
               diffs: windows.Diffs, countdown: Optional[Countdown]) -> None:
    self.runtime, self.links, self.batches, self.diffs = runtime, links, batches, diffs
    self.countdown = countdown
    self.gradients: Dict[Tuple[int, int, Micro], Any] = {}   # received early (R tasks)

  def take_input(self, k: int, b: int, micro: Micro) -> Tuple[Any, Any, Any]:
    xs, labels, share = self.links.inputs(k, self.batches, labelled=True, b=b, micro=micro)
    return xs, share, labels

  def take_gradient(self, k: int, b: int, micro: Micro) -> Any:
    if (k, b, micro) in self.gradients:   # received early (an R task)
      return self.gradients.pop((k, b, micro))
    return self.links.backward[k][1].get(self.links.cancel(b))[1]

  def receive(self, k: int, b: int, micro: Micro) -> None:
    self.gradients[(k, b, micro)] = self.links.backward[k][1].get(self.links.cancel(b))[1]

  def barrier(self, b: int) -> None:
    self.links.barrier.wait(self.links.cancel(b))

  def update(self, program: StageProtocol, b: int) -> None:
    if self.countdown is None:
      program.update()
      return
    self.countdown.wait(b, self.links.cancel(b))
    with program.updates.joint.lock:   # the first update of b decides for every stage
      program.update()

  def send_output(self, k: int, b: int, micro: Micro, ys: Any, share: Any) -> None:
    self.links.forward[k][0].put(((b, micro), (ys, share)))

  def send_gradient(self, k: int, b: int, micro: Micro, dxs: Any) -> None:
    self.links.backward[k - 1][0].put(((b, micro), dxs))

  def weight(self, k: int, share: Any) -> Any:
    return self.runtime.share(k, share)

  def add_loss(self, total: Any, loss: Any, share: Any) -> Any:
    return (total or 0.0) + share * float(loss)

  def finished(self, b: int, loss: Any, logs: Any) -> None:
    self.links.results.put((b, loss, logs))

  def version(self, k: int, s: int) -> Any:
    return self.runtime.programs[k].sources.version(self.runtime.updates[k], s)

  def current(self, k: int) -> Optional[int]:
    return self.runtime.updates[k]

  def updated(self, k: int) -> None:
    self.runtime.count_updates(k)

  def record(self, k: int, kind: str, task: schedules.Task, version: Any, s: int,
             start: float) -> None:
    if self.runtime.record:
      self.runtime.records.append(TaskRecord(k, kind, task.batch, version, s, start,
                                             time.perf_counter(), task.micro,
                                             self.runtime.epoch))

  def saved(self, stage: interpreter.Stage) -> None:
    """Tracks the peak count of kept forward states and of the weight versions they hold: a
    kept tape (or a blend's kept weights) holds the weights its forward read, version v
    (stashed) or the prediction (v, s) of that forward; inputs-only states, and the last
    stage's forwards held for its step, hold none."""
    k, runtime = stage.k, self.runtime
    runtime.peak_saved[k] = max(runtime.peak_saved[k], len(stage.saved))
    versions = {(part.version, self.diffs[k].get(schedules.Task("F", *unit), 0))
                for unit, part in stage.saved.items() if part.kept.weights is not None}
    runtime.peak_versions[k] = max(runtime.peak_versions[k], len(versions))
