"""The threaded executor: worker threads run each stage's task list; transfer threads move tensors.

K: stages, k: stage index, b: mini-batch index, s: version difference.

Stage k's worker runs its (verified) schedule in order. Stage 0 splits a
mini-batch into micro-batches when the schedule has them, each carrying its
share of the mini-batch (the `scale` of its loss). Forward outputs go into a
bounded channel; a transfer thread copies them onto stage k+1's device and
hands them on; gradients flow back the same way. At the last stage a
backward follows the forwards it covers and runs with them as one compiled
step (on their concatenation, for a TiMePReSt mini-batch). The first exception in any thread sets a shared stop
event: every blocked thread wakes within `poll` seconds and exits, and the
caller re-raises that first exception with its traceback.
"""

import collections
import time

from tfpipe.plan import schedules, verify
from tfpipe.runtime.base import Executor
from tfpipe.runtime.links import Countdown, Links, Skipped, concat, copy_to, spawn
from tfpipe.runtime.records import TaskRecord

__all__ = ["Runtime"]

_Saved = collections.namedtuple("_Saved", ["kept", "version", "scale"])
_Saved.__doc__ = """A forward waiting for its backward at stage k: what the stage kept
(`tfpipe.stage.Kept`), the weight version it read and the micro-batch's share of its
mini-batch."""
_Held = collections.namedtuple("_Held", ["xs", "labels", "scale", "s"])
_Held.__doc__ = """A last-stage forward held for its step: inputs, (labels, sample weights),
share of the mini-batch and version difference."""


class Runtime(Executor):
  """Runs schedules task by task: a worker thread per stage, transfer threads between them.

  The reference interpreter of a schedule (and the one to debug with): it
  pays Python and eager TensorFlow work per task, so it does not scale with
  stages; `tfpipe.runtime.compiled` does. `maxsize`: each link holds at most
  2 * maxsize + 1 items in flight (a sender queue, the transfer thread, a
  receiver queue): `link_capacity`.
  """

  def __init__(self, programs, record=False, poll=0.05, maxsize=None):
    super().__init__(programs, record=record, maxsize=maxsize)
    self.poll = poll

  def _log(self, k, kind, task, version, s, start):
    if self.record:
      self.records.append(TaskRecord(k, kind, task.batch, version, s, start, time.perf_counter(),
                                     task.micro, self.epoch))

  def train_epoch(self, schedule, diffs, batches, num_batches, on_result, before=None):
    """Runs one epoch of `schedule` (verified) over `num_batches` mini-batches from `batches`.

    `diffs[k][task]` is the version difference of each task. In the caller's
    thread, for every mini-batch b in order: `before(b)` when it starts
    waiting for b, then `on_result(b, loss, logs)` when b is done (`logs`: the
    running loss and metrics). When `on_result` returns True, the batches
    already due (at most L-1, `schedules.lead`) drain and no further batch is
    trained (see `links.Gate`). Returns the number of mini-batches trained.
    """
    self._start_epoch(schedule)
    K = self.K
    links = Links(K, self.poll, self.maxsize, schedules.micro_batches(schedule),
                  lead=schedules.lead(schedule))
    fwd, bwd, results, gate = links.forward, links.backward, links.results, links.gate

    lanes = schedules.lanes(schedule)   # a device's stages run their tasks in its lane's order
    # Joint updates (`tfpipe.joint`): an update waits for every stage's backwards of its batch.
    countdown = (Countdown(schedule, links.stop, self.poll) if getattr(schedule, "joint", False)
                 else None)

    def worker(d):
      stages = {k: (self.programs[k], k == K - 1, verify.covered_units(schedule[k]), {}, {},
                    collections.defaultdict(float)) for k in {k for k, _ in lanes[d]}}
      logs = None
      for k, task in lanes[d]:
        if gate.gone(task.batch):
          continue
        try:
          logs = run_task(k, *stages[k], task, logs)
        except Skipped:
          continue
        if countdown is not None and task.kind in ("B", "W"):
          countdown.done(task.batch)

    def run_task(k, program, last, cover, saved, grads_in, batch_loss, task, logs):
      kind, b, micro = task
      unit, s = (b, micro), diffs[k].get(task, 0)
      start, op = time.perf_counter(), program.ops[kind].op   # tfpipe.plan.tasks
      if op in ("hold", "forward"):
        xs, y, scale = links.inputs(k, batches, labelled=True, b=b, micro=micro)
        start = time.perf_counter()
        if op == "hold":
          saved[unit] = _Held(xs, y, scale, s)
          return logs  # the last stage runs its forward with the backward
        ys, kept = program.forward(xs, s)
        version = program.read_version(self.updates[k], s)
        saved[unit] = _Saved(kept, version, scale)
        self._note_saved(k, saved, diffs[k])
        self._log(k, "F", task, version, s, start)
        fwd[k][0].put((unit, (ys, scale)))
      elif op == "receive":
        grads_in[unit] = bwd[k][1].get(links.cancel(b))[1]
        self._log(k, "R", task, self.updates[k], s, start)
      elif op == "barrier":
        links.barrier.wait(links.cancel(b))
        self._log(k, "S", task, self.updates[k], s, start)
      elif op == "update":
        if countdown is not None:
          countdown.wait(b, links.cancel(b))
          with program.joint.lock:   # the first update of b decides for every stage
            program.apply_accumulated()
        else:
          program.apply_accumulated()
        self._log(k, "U", task, self.updates[k], s, start)
        self._updated(k)
        if last:
          results.put((b, batch_loss.pop(b), logs))
      elif op in ("step", "step_input"):
        parts = [saved.pop(u) for u in cover[task]]
        xs = parts[0].xs if len(parts) == 1 else concat([p.xs for p in parts])
        y, sample_weight = (parts[0].labels if len(parts) == 1 else
                            (concat([p.labels[0] for p in parts]),
                             concat([p.labels[1] for p in parts])))
        scale = sum(p.scale for p in parts)
        if op == "step_input":   # a split step: its W takes the weight gradients
          loss, dxs, logs, kept = program.last_step_input(xs, y, sample_weight, parts[0].s,
                                                          self._scale(k, scale))
          saved[unit] = _Saved(kept, program.read_version(self.updates[k], parts[0].s), scale)
        else:
          loss, dxs, logs = program.last_step(xs, y, sample_weight, parts[0].s,
                                              self._scale(k, scale), micro is not None)
        self._log(k, "FB", task, program.read_version(self.updates[k], parts[0].s), parts[0].s,
                  start)
        if micro is None:
          self._updated(k)
        if k > 0:
          bwd[k - 1][0].put((unit, dxs))
        if micro is None:
          results.put((b, loss, logs))
        else:
          batch_loss[b] += scale * float(loss)
      elif op == "step_weights":   # a split step's W
        part = saved.pop(unit)
        program.last_step_weights(part.kept, self._scale(k, part.scale), True)
        self._log(k, "W", task, part.version, s, start)
      elif op == "backward_weights":   # a split backward's W: its B kept the state and dys
        part, dys = saved.pop(unit), grads_in.pop(("W",) + unit)
        program.backward_weights([part.kept], dys, s, self._scale(k, part.scale), True)
        self._log(k, "W", task, self._version(program, [part], k), s, start)
      else:   # "backward", or a split backward's B ("backward_input")
        dys = grads_in.pop(unit) if unit in grads_in else bwd[k][1].get(links.cancel(b))[1]
        start = time.perf_counter()
        scale = lambda parts: self._scale(k, sum(p.scale for p in parts))
        if op == "backward_input":
          parts = [saved[u] for u in cover[task]]
          grads_in[("W",) + unit] = dys
          dxs = program.backward_input([p.kept for p in parts], dys, s, scale(parts))
        else:
          parts = [saved.pop(u) for u in cover[task]]
          dxs = program.backward([p.kept for p in parts], dys, s, scale(parts), micro is not None)
        self._log(k, "B", task, self._version(program, parts, k), s, start)
        if micro is None:
          self._updated(k)
        if k > 0:
          bwd[k - 1][0].put((unit, dxs))
      return logs

    sent = [([t.batch for t in schedule[k] if t.kind == "F"],
             [t.batch for t in schedule[k + 1] if t.kind == "B"]) for k in range(K - 1)]
    return self._execute(links, worker, num_batches, on_result, sent, before, record=True,
                         workers=len(lanes))

  def _receivers(self, k, forward):
    """Where stage k takes what crosses a cut: its device, or its replicas' devices when the
    items travel as one group per replica (data-parallel pipelines)."""
    program = self.programs[k]
    grouped = program.grouped_in if forward else program.grouped_out
    return program.replica_devices if grouped else program.device

  def _version(self, program, parts, k):
    """The weight version a backward read: its forward's (a kept tape) or the current one."""
    return parts[0].version if program.ops["B"].reads == "kept" else self.updates[k]

  def _note_saved(self, k, saved, diffs):
    """Tracks the peak count of kept forward states and of weight versions they hold.

    A kept tape (or a blend's kept weights) holds the weights its forward
    read: version v (stashed) or the prediction (v, s) of that forward;
    inputs-only states hold none.
    """
    self.peak_saved[k] = max(self.peak_saved[k], len(saved))
    versions = {(part.version, diffs.get(schedules.Task("F", *unit), 0))
                for unit, part in saved.items() if part.kept.weights is not None}
    self.peak_versions[k] = max(self.peak_versions[k], len(versions))

  def infer_epoch(self, batches, num_batches, on_result, with_labels, before=None):
    """Forward-only pipeline with current weights (evaluate and predict).

    With labels, the last stage updates the loss and metrics and `on_result`
    gets (b, running logs); without, it gets (b, outputs). `before(b)` as in
    `train_epoch`.
    """
    K, links = self.K, Links(self.K, self.poll, self.maxsize)
    fwd, results = links.forward, links.results

    def worker(k):
      program = self.programs[k]
      for b in range(num_batches):
        xs, y, _ = links.inputs(k, batches, labelled=with_labels, b=b)
        if k < K - 1:
          fwd[k][0].put(((b, None), (program.infer(xs), 1.0)))
        elif with_labels:
          results.put((b, program.evaluate_last(xs, *y)))
        else:
          results.put((b, program.infer(xs)))

    sent = [(list(range(num_batches)), []) for _ in range(K - 1)]
    self._execute(links, worker, num_batches, on_result, sent, before)

  def _execute(self, links, worker, num_batches, on_result, sent, before=None, record=False,
               workers=None):
    """Runs the stage workers and the transfer threads; hands results to `on_result`.

    `sent[k]`: the batch of every item that crosses cut k forward and backward
    this epoch, in order; `record`: log the transfers (when the runtime
    records). Returns the number of results handed on.
    """
    def transfer(src, dst, device, batches, k, kind):
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
        launch(lambda k=k: worker(k), f"tfpipe-{'device' if workers else 'stage'}{k}")
      for k in range(self.K - 1):
        launch(lambda k=k: transfer(*links.forward[k], self._receivers(k + 1, forward=True),
                                    sent[k][0], k, "XF"), f"tfpipe-fwd{k}")
        if sent[k][1]:
          launch(lambda k=k: transfer(*links.backward[k], self._receivers(k, forward=False),
                                      sent[k][1], k + 1, "XB"), f"tfpipe-bwd{k}")
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
