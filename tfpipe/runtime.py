"""Runtime: worker threads run each stage's task list; transfer threads move tensors.

K: stages, k: stage index, b: batch index, s: version difference.

Stage k's worker runs its schedule in order. Forward outputs go into a
bounded channel; a transfer thread copies them onto stage k+1's device and
hands them on; gradients flow back the same way. At the last stage the
forward and backward of a batch are adjacent in every schedule and run as
one compiled step. The first exception in any thread sets a shared stop
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

__all__ = ["Channel", "OutOfData", "Stopped", "spawn", "Runtime", "TaskRecord"]

TaskRecord = collections.namedtuple(
    "TaskRecord", ["stage", "kind", "batch", "version", "s", "start", "end"])


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


def _copy_to(device, tensors):
  with tf.device(device):
    return [tf.identity(t) if t is not None else None for t in tensors]


class _Links:
  """The channels of one epoch: per cut a (sender, receiver) pair each way, labels, results."""

  def __init__(self, K, poll):
    self.K, self.stop = K, threading.Event()
    pair = lambda: (Channel(self.stop, K, poll), Channel(self.stop, K, poll))
    self.forward = [pair() for _ in range(K - 1)]
    self.backward = [pair() for _ in range(K - 1)]
    self.labels = Channel(self.stop, 0, poll)   # stage 0 -> last stage
    self.results = Channel(self.stop, 0, poll)  # last stage -> caller

  def inputs(self, k, batches, labelled):
    """Stage k's next inputs (and labels at the last stage): from the data or the cut before."""
    if k == 0:
      try:
        item = next(batches)
      except StopIteration:
        raise OutOfData() from None
      x, y = item if labelled else (item, None)
      if labelled and self.K > 1:
        self.labels.put(y)
      return (list(x) if isinstance(x, (tuple, list)) else [x]), y
    y = self.labels.get() if labelled and k == self.K - 1 else None
    return self.forward[k - 1][1].get(), y


class Runtime:
  """Runs schedules on stage programs (see stage.py) placed on their devices."""

  def __init__(self, programs, record=False, poll=0.05):
    self.programs = programs
    self.K = len(programs)
    self.record = record
    self.poll = poll
    self.records = []
    self.updates = [0] * self.K          # updates applied per stage so far
    self.peak_saved = [0] * self.K       # most forward states kept at once, per stage
    self.peak_versions = [0] * self.K    # most weight versions kept at once, per stage

  def _log(self, k, kind, b, version, s, start):
    if self.record:
      self.records.append(TaskRecord(k, kind, b, version, s, start, time.perf_counter()))

  def train_epoch(self, schedule, diffs, batches, num_batches, on_result):
    """Runs one epoch of `schedule` over `num_batches` batches from the iterator `batches`.

    `diffs[k][(kind, b)]` is the version difference of each task; `on_result(b,
    loss)` is called in the caller's thread for every finished batch, in order.
    """
    K, links = self.K, _Links(self.K, self.poll)
    fwd, bwd, results = links.forward, links.backward, links.results

    def worker(k):
      program, saved, last = self.programs[k], {}, k == K - 1
      policy = program.policy
      for kind, b in schedule[k]:
        if last and kind == "B":
          continue  # ran with its forward
        s = diffs[k][(kind, b)]
        if kind == "F":
          xs, y = links.inputs(k, batches, labelled=True)
          start = time.perf_counter()
          if last:
            loss, dxs = program.last_step(xs, y, s)
            self.updates[k] += 1
            self._log(k, "FB", b, self.updates[k] - 1, s, start)
            if k > 0:
              bwd[k - 1][0].put(dxs)
            results.put((b, loss))
            continue
          if policy.recompute:
            ys, _ = program.forward(xs, s)
            saved[b] = (xs, None, self.updates[k])
          else:
            ys, state = program.forward_saved(xs, s)
            saved[b] = (xs, state, self.updates[k])
          self._note_saved(k, saved, diffs[k])
          self._log(k, "F", b, self.updates[k], s, start)
          fwd[k][0].put(ys)
        else:
          dys = bwd[k][1].get()
          start = time.perf_counter()
          xs, state, version = saved.pop(b)
          if state is not None:
            dxs = program.backward_saved(state, dys)
          else:
            dxs = program.backward_recompute(xs, dys, s)
            version = self.updates[k]
          self.updates[k] += 1
          self._log(k, "B", b, version, s, start)
          if k > 0:
            bwd[k - 1][0].put(dxs)

    self._execute(links, worker, num_batches, on_result, backward=True)

  def _note_saved(self, k, saved, diffs):
    """Tracks the peak count of kept forward states and of weight versions they hold.

    A kept tape holds the weights its forward read: version v (stashed) or
    the prediction (v, s) of that forward; inputs-only states hold none.
    """
    self.peak_saved[k] = max(self.peak_saved[k], len(saved))
    versions = {(version, diffs[("F", b)]) for b, (_, state, version) in saved.items()
                if state is not None}
    self.peak_versions[k] = max(self.peak_versions[k], len(versions))

  def infer_epoch(self, batches, num_batches, on_result, with_labels):
    """Forward-only pipeline with current weights (evaluate and predict).

    With labels, the last stage updates the loss and metrics and `on_result`
    gets (b, loss); without, it gets (b, outputs).
    """
    K, links = self.K, _Links(self.K, self.poll)
    fwd, results = links.forward, links.results

    def worker(k):
      program = self.programs[k]
      for b in range(num_batches):
        xs, y = links.inputs(k, batches, labelled=with_labels)
        if k < K - 1:
          fwd[k][0].put(program.infer(xs))
        elif with_labels:
          results.put((b, program.evaluate_last(xs, y)))
        else:
          results.put((b, program.infer(xs)))

    self._execute(links, worker, num_batches, on_result, backward=False)

  def _execute(self, links, worker, num_batches, on_result, backward):
    """Runs the stage workers and the transfer threads; hands results to `on_result`."""
    def transfer(src, dst, device):
      for _ in range(num_batches):
        dst.put(_copy_to(device, src.get()))

    with spawn(links.stop) as launch:
      for k in range(self.K):
        launch(lambda k=k: worker(k), f"tfpipe-stage{k}")
      for k in range(self.K - 1):
        launch(lambda k=k: transfer(*links.forward[k], self.programs[k + 1].device),
               f"tfpipe-fwd{k}")
        if backward:
          launch(lambda k=k: transfer(*links.backward[k], self.programs[k].device),
                 f"tfpipe-bwd{k}")
      for _ in range(num_batches):
        on_result(*links.results.get())
