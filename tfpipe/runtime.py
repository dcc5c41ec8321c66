"""Runtime: worker threads run each stage's task list; transfer threads move tensors.

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
import contextlib
import queue
import sys
import threading
import time

import tensorflow as tf

from tfpipe import schedules, verify

__all__ = ["Barrier", "Channel", "OutOfData", "Stopped", "spawn", "Runtime", "TaskRecord"]

TaskRecord = collections.namedtuple(
    "TaskRecord", ["stage", "kind", "batch", "version", "s", "start", "end", "micro", "epoch"],
    defaults=(None, 0))
TaskRecord.__doc__ = """One task as it ran: `stage` k, `kind`, mini-batch `batch` (its index in
`epoch`), micro-batch `micro` or None, `version` (updates of stage k whose weights it read), `s`
(version difference), `start` and `end` (time.perf_counter seconds). Kinds: F (forward), B
(backward and update), FB (the last stage's forward and backward as one step), U (apply
accumulated gradients), R (early receive of a gradient), S (barrier), and the transfer threads'
XF (stage k's output to k+1) and XB (stage k's input gradient to k-1), each recorded under the
sending stage k, with version and s None."""


_Saved = collections.namedtuple("_Saved", ["xs", "tape", "version", "scale", "state"])
_Saved.__doc__ = """What stage k keeps from a forward for its backward: the stage inputs, the
kept tape (or None: the backward recomputes), the weight version read, the
micro-batch's share of its mini-batch, and the non-trainable state the
forward read (its random layers' seeds), so a recomputation draws the same."""


class Stopped(Exception):
  """Raised in a thread when another thread failed and the pipeline stops."""


class OutOfData(Exception):
  """The input iterator ended before the epoch's batch count."""


class Channel:
  """A bounded FIFO whose blocking put/get give up when `stop` is set."""

  def __init__(self, stop, maxsize=0, poll=0.05):
    self._queue, self._stop, self._poll = queue.Queue(maxsize), stop, poll

  def put(self, item):
    while True:
      if self._stop.is_set():
        raise Stopped()
      try:
        return self._queue.put(item, timeout=self._poll)
      except queue.Full:
        pass

  def get(self):
    while True:
      if self._stop.is_set():
        raise Stopped()
      try:
        return self._queue.get(timeout=self._poll)
      except queue.Empty:
        pass


@contextlib.contextmanager
def spawn(stop):
  """Starts threads with `launch(fn, name)`; always joins them; re-raises the first error.

  The body runs in the caller's thread (it may consume results); an exception
  there also stops the threads.
  """
  threads, errors = [], []

  def launch(fn, name):
    def run():
      try:
        fn()
      except Stopped:
        pass
      except BaseException:  # pylint: disable=broad-except
        errors.append(sys.exc_info())
        stop.set()
    thread = threading.Thread(target=run, name=name, daemon=True)
    threads.append(thread)
    thread.start()

  try:
    yield launch
  except Stopped:
    pass
  except BaseException:
    stop.set()
    raise
  finally:
    for thread in threads:
      thread.join()
  if errors:
    _, error, traceback = errors[0]
    raise error.with_traceback(traceback)


def _copy_to(device, payload):
  """Copies a payload's tensors onto `device`: a tensor list or (tensor list, scale)."""
  tensors, meta = payload if isinstance(payload, tuple) else (payload, None)
  with tf.device(device):
    copied = [tf.identity(t) if t is not None else None for t in tensors]
  return copied if meta is None else (copied, meta)


def _split(value, sizes):
  """Splits a tensor (or a list of tensors) along the batch axis into pieces of `sizes`."""
  if isinstance(value, (list, tuple)):
    parts = [tf.split(v, sizes) for v in value]
    return [list(p) for p in zip(*parts)]
  return tf.split(value, sizes)


def _concat(values):
  """The inverse of `_split`: pieces (tensors or tensor lists) joined along the batch axis."""
  if isinstance(values[0], (list, tuple)):
    return [None if parts[0] is None else tf.concat(parts, 0) for parts in zip(*values)]
  return tf.concat(values, 0)


class Barrier:
  """All `parties` threads wait in `wait()` until the last arrives; gives up when `stop` is set."""

  def __init__(self, parties, stop, poll=0.05):
    self._parties, self._stop, self._poll = parties, stop, poll
    self._cond = threading.Condition()
    self._arrived, self._generation = 0, 0

  def wait(self):
    with self._cond:
      generation = self._generation
      self._arrived += 1
      if self._arrived == self._parties:
        self._arrived, self._generation = 0, generation + 1
        self._cond.notify_all()
        return
      while self._generation == generation:
        if self._stop.is_set():
          raise Stopped()
        self._cond.wait(self._poll)


class _Links:
  """The channels of one epoch: per cut a (sender, receiver) pair each way, labels, results."""

  def __init__(self, K, poll, maxsize, micro_batches=1):
    self.K, self.stop, self.micro_batches = K, threading.Event(), micro_batches
    pair = lambda: (Channel(self.stop, maxsize, poll), Channel(self.stop, maxsize, poll))
    self.forward = [pair() for _ in range(K - 1)]
    self.backward = [pair() for _ in range(K - 1)]
    self.barrier = Barrier(K, self.stop, poll)  # S tasks (lock-step steps)
    self.labels = Channel(self.stop, 0, poll)   # stage 0 -> last stage
    self.results = Channel(self.stop, 0, poll)  # last stage -> caller
    self._pieces = collections.deque()          # stage 0: the current mini-batch's micro-batches

  def inputs(self, k, batches, labelled, micro=None):
    """Stage k's next inputs, their share of the mini-batch, and labels at the last stage.

    Stage 0 reads a mini-batch at its first micro-batch and splits it.
    """
    if k > 0:
      _, (xs, scale) = self.forward[k - 1][1].get()
      y = self.labels.get() if labelled and k == self.K - 1 else None
      return xs, y, scale
    if not self._pieces:
      try:
        item = next(batches)
      except StopIteration:
        raise OutOfData() from None
      x, y = item if labelled else (item, None)
      xs = list(x) if isinstance(x, (tuple, list)) else [x]
      if micro is None:
        self._pieces.append((xs, y, 1.0))
      else:
        n = int(tf.shape(xs[0])[0])
        sizes = schedules.micro_sizes(n, self.micro_batches)
        ys = _split(y, sizes) if labelled else [None] * len(sizes)
        self._pieces.extend((x_i, y_i, size / n)
                            for x_i, y_i, size in zip(_split(xs, sizes), ys, sizes))
    xs, y, scale = self._pieces.popleft()
    if labelled and self.K > 1:
      self.labels.put(y)
    return xs, y, scale


class Runtime:
  """Runs schedules on stage programs (see stage.py) placed on their devices.

  `maxsize`: each link holds at most 2 * maxsize + 1 items in flight (a
  sender queue, the transfer thread, a receiver queue): `link_capacity`.
  """

  def __init__(self, programs, record=False, poll=0.05, maxsize=None):
    self.programs = programs
    self.epoch = -1                      # epochs trained so far, minus one
    self.update_hooks = []               # hook(k, program) after every update of stage k
    self.K = len(programs)
    self.record = record
    self.poll = poll
    self.maxsize = maxsize or self.K
    self.records = []
    self.report = None                   # the verifier's report on the last schedule run
    self.updates = [0] * self.K          # updates applied per stage so far
    self.peak_saved = [0] * self.K       # most forward states kept at once, per stage
    self.peak_versions = [0] * self.K    # most weight versions kept at once, per stage

  @property
  def link_capacity(self):
    return 2 * self.maxsize + 1

  def _log(self, k, kind, task, version, s, start):
    if self.record:
      self.records.append(TaskRecord(k, kind, task.batch, version, s, start, time.perf_counter(),
                                     task.micro, self.epoch))

  def _updated(self, k):
    self.updates[k] += 1
    for hook in self.update_hooks:
      hook(k, self.programs[k])

  def _scale(self, k, value):
    with tf.device(self.programs[k].device):
      return tf.constant(value, tf.float64)

  def train_epoch(self, schedule, diffs, batches, num_batches, on_result):
    """Runs one epoch of `schedule` (verified) over `num_batches` mini-batches from `batches`.

    `diffs[k][task]` is the version difference of each task; `on_result(b,
    loss)` is called in the caller's thread for every finished mini-batch, in order.
    """
    self.report = verify.verify(schedule, self.link_capacity)  # refuses a broken schedule
    self.epoch += 1
    K = self.K
    links = _Links(K, self.poll, self.maxsize, schedules.micro_batches(schedule))
    fwd, bwd, results = links.forward, links.backward, links.results
    if any(t.kind == "U" for tasks in schedule for t in tasks):
      for program in self.programs:
        program.build_accumulators()

    def worker(k):
      program, last = self.programs[k], k == K - 1
      cover = verify.covered_units(schedule[k])
      saved, grads_in, batch_loss = {}, {}, collections.defaultdict(float)
      for task in schedule[k]:
        kind, b, micro = task
        unit, s = (b, micro), diffs[k].get(task, 0)
        start = time.perf_counter()
        if kind == "F":
          xs, y, scale = links.inputs(k, batches, labelled=True, micro=micro)
          start = time.perf_counter()
          if last:
            saved[unit] = (xs, y, scale, s)
            continue  # the last stage runs its forward with the backward
          if program.policy.recompute:
            ys, _, state_read = program.forward(xs, s)
            saved[unit] = _Saved(xs, None, self.updates[k], scale, state_read)
          else:
            ys, tape = program.forward_saved(xs, s)
            saved[unit] = _Saved(xs, tape, self.updates[k], scale, None)
          self._note_saved(k, saved, diffs[k])
          self._log(k, "F", task, self.updates[k], s, start)
          fwd[k][0].put((unit, (ys, scale)))
        elif kind == "R":
          grads_in[unit] = bwd[k][1].get()[1]
          self._log(k, "R", task, self.updates[k], s, start)
        elif kind == "S":
          links.barrier.wait()
          self._log(k, "S", task, self.updates[k], s, start)
        elif kind == "U":
          program.apply_accumulated()
          self._log(k, "U", task, self.updates[k], s, start)
          self._updated(k)
          if last:
            results.put((b, batch_loss.pop(b)))
        elif last:
          parts = [saved.pop(u) for u in cover[task]]
          xs, y = (parts[0][0], parts[0][1]) if len(parts) == 1 else (
              _concat([p[0] for p in parts]), _concat([p[1] for p in parts]))
          scale = sum(p[2] for p in parts)
          loss, dxs = program.last_step(xs, y, parts[0][3], self._scale(k, scale),
                                        micro is not None)
          self._log(k, "FB", task, self.updates[k], parts[0][3], start)
          if micro is None:
            self._updated(k)
          if k > 0:
            bwd[k - 1][0].put((unit, dxs))
          if micro is None:
            results.put((b, loss))
          else:
            batch_loss[b] += scale * float(loss)
        else:
          dys = grads_in.pop(unit) if unit in grads_in else bwd[k][1].get()[1]
          start = time.perf_counter()
          parts = [saved.pop(u) for u in cover[task]]
          accumulate = micro is not None
          if len(parts) == 1 and parts[0].tape is not None:
            part = parts[0]
            dxs = program.backward_saved(part.tape, dys, self._scale(k, part.scale), accumulate)
            version = part.version
          else:
            scale = sum(p.scale for p in parts)
            dxs = program.backward_recompute([(p.xs, p.state) for p in parts], dys, s,
                                             self._scale(k, scale), accumulate)
            version = self.updates[k]
          self._log(k, "B", task, version, s, start)
          if not accumulate:
            self._updated(k)
          if k > 0:
            bwd[k - 1][0].put((unit, dxs))

    counts = [(sum(t.kind == "F" for t in schedule[k]), sum(t.kind == "B" for t in schedule[k + 1]))
              for k in range(K - 1)]
    self._execute(links, worker, num_batches, on_result, counts, record=True)

  def _note_saved(self, k, saved, diffs):
    """Tracks the peak count of kept forward states and of weight versions they hold.

    A kept tape holds the weights its forward read: version v (stashed) or
    the prediction (v, s) of that forward; inputs-only states hold none.
    """
    self.peak_saved[k] = max(self.peak_saved[k], len(saved))
    versions = {(part.version, diffs.get(schedules.Task("F", *unit), 0))
                for unit, part in saved.items() if part.tape is not None}
    self.peak_versions[k] = max(self.peak_versions[k], len(versions))

  def infer_epoch(self, batches, num_batches, on_result, with_labels):
    """Forward-only pipeline with current weights (evaluate and predict).

    With labels, the last stage updates the loss and metrics and `on_result`
    gets (b, loss); without, it gets (b, outputs).
    """
    K, links = self.K, _Links(self.K, self.poll, self.maxsize)
    fwd, results = links.forward, links.results

    def worker(k):
      program = self.programs[k]
      for b in range(num_batches):
        xs, y, _ = links.inputs(k, batches, labelled=with_labels)
        if k < K - 1:
          fwd[k][0].put(((b, None), (program.infer(xs), 1.0)))
        elif with_labels:
          results.put((b, program.evaluate_last(xs, y)))
        else:
          results.put((b, program.infer(xs)))

    self._execute(links, worker, num_batches, on_result, [(num_batches, 0)] * (K - 1))

  def _execute(self, links, worker, num_batches, on_result, counts, record=False):
    """Runs the stage workers and the transfer threads; hands results to `on_result`.

    `counts[k]`: how many items cross cut k forward and backward this epoch; `record`: log
    the transfers (when the runtime records).
    """
    def transfer(src, dst, device, count, k, kind):
      for _ in range(count):
        unit, payload = src.get()
        start = time.perf_counter()
        payload = _copy_to(device, payload)
        if self.record and record:
          self.records.append(TaskRecord(k, kind, unit[0], None, None, start, time.perf_counter(),
                                         unit[1], self.epoch))
        dst.put((unit, payload))

    with spawn(links.stop) as launch:
      for k in range(self.K):
        launch(lambda k=k: worker(k), f"tfpipe-stage{k}")
      for k in range(self.K - 1):
        launch(lambda k=k: transfer(*links.forward[k], self.programs[k + 1].device,
                                    counts[k][0], k, "XF"), f"tfpipe-fwd{k}")
        if counts[k][1]:
          launch(lambda k=k: transfer(*links.backward[k], self.programs[k].device, counts[k][1],
                                      k + 1, "XB"), f"tfpipe-bwd{k}")
      for _ in range(num_batches):
        on_result(*links.results.get())
