"""Links: the threads, channels, barrier and stop gate that executors run stages with.

K: stages, b: mini-batch. Channels are bounded FIFOs whose blocking calls
give up when the epoch's `stop` event is set (an error somewhere) or when a
`cancel` test says the item will never come (training stopped, see `Gate`). `spawn` starts threads
and always joins them; the first exception
in any thread stops the others and is re-raised in the caller.
"""

import collections
import contextlib
import queue
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import keras
import tensorflow as tf

from tfpipe.plan import pieces, schedules

__all__ = ["Stopped", "Skipped", "OutOfData", "Channel", "Barrier", "Countdown", "Gate", "Links",
           "spawn", "copy_to", "Cancel"]

Cancel = Optional[Callable[[], bool]]   # a blocking call gives up once it is true


class Stopped(Exception):
  """Raised in a thread when another thread failed and the pipeline stops."""


class Skipped(Exception):
  """Raised by a blocking call whose item never comes: its batch was not admitted (`Gate`)."""


class OutOfData(Exception):
  """The input iterator ended before the epoch's batch count."""


class Channel:
  """A bounded FIFO whose blocking put/get give up when `stop` is set."""

  def __init__(self, stop: threading.Event, maxsize: int = 0, poll: float = 0.05) -> None:
    self._queue: "queue.Queue[Any]" = queue.Queue(maxsize)
    self._stop, self._poll = stop, poll

  def put(self, item: Any) -> None:
    while True:
      if self._stop.is_set():
        raise Stopped()
      try:
        return self._queue.put(item, timeout=self._poll)
      except queue.Full:
        pass

  def get(self, cancel: Cancel = None) -> Any:
    """The next item; raises Skipped once `cancel()` is true and nothing has come."""
    while True:
      if self._stop.is_set():
        raise Stopped()
      try:
        return self._queue.get(timeout=self._poll)
      except queue.Empty:
        if cancel is not None and cancel():
          raise Skipped() from None


class Barrier:
  """All `parties` threads wait in `wait()` until the last arrives; gives up when `stop` is set."""

  def __init__(self, parties: int, stop: threading.Event, poll: float = 0.05) -> None:
    self._parties, self._stop, self._poll = parties, stop, poll
    self._cond = threading.Condition()
    self._arrived, self._generation = 0, 0

  def wait(self, cancel: Cancel = None) -> None:
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
        if cancel is not None and cancel():
          self._arrived -= 1
          raise Skipped()
        self._cond.wait(self._poll)


class Countdown:
  """Per mini-batch, the backwards (B and W tasks) still to run on every stage: with joint
  updates (`schedules.jointly_updated`) an update of b `wait`s until none of b's is left;
  gives up when `stop` is set."""

  def __init__(self, schedule: schedules.Lists, stop: threading.Event,
               poll: float = 0.05) -> None:
    self._left = collections.Counter(t.batch for tasks in schedule for t in tasks
                                     if t.kind in ("B", "W"))
    self._stop, self._poll = stop, poll
    self._cond = threading.Condition()

  def done(self, b: int) -> None:
    with self._cond:
      self._left[b] -= 1
      if self._left[b] <= 0:
        self._cond.notify_all()

  def wait(self, b: int, cancel: Cancel = None) -> None:
    with self._cond:
      while self._left[b] > 0:
        if self._stop.is_set():
          raise Stopped()
        if cancel is not None and cancel():
          raise Skipped()
        self._cond.wait(self._poll)


class Gate:
  """Stage 0 admits mini-batch b once the caller has handled batch b - `lead`, until a stop.

  `lead` L (`schedules.lead`) is how far ahead the schedule itself lets stage
  0 run, so holding batch b until batch b-L's hooks have run costs nothing
  but the hooks' own time, and it makes a stop exact: `model.stop_training`
  set in batch b's hooks admits batches up to b+L-1 (already in flight or
  due) and none after. The L-1 batches in flight drain; with sequential and
  GPipe (L = 1) none, so training stops exactly where Keras stops. Every
  stage skips the tasks of batches >= `limit`; a verified schedule restricted
  to the batches below it cannot deadlock, because every task of a batch
  depends on stage 0 admitting it. `lead=None` admits at once (evaluate, predict).
  """

  def __init__(self, stop: threading.Event, lead: Optional[int] = None,
               poll: float = 0.05) -> None:
    self.lead, self._stop, self._poll = lead, stop, poll
    self.limit: Optional[int] = None
    self._handled = -1
    self._cond = threading.Condition()

  def admit(self, b: int) -> bool:
    """Stage 0, before reading batch b: waits for batch b-L's hooks; True to train b."""
    with self._cond:
      while self.lead is not None and self.limit is None and self._handled < b - self.lead:
        if self._stop.is_set():
          raise Stopped()
        self._cond.wait(self._poll)
      return self.limit is None or b < self.limit

  def handled(self, b: int, stop: bool = False) -> None:
    """The caller, after batch b's hooks; `stop`: train no batch from b + L on."""
    with self._cond:
      self._handled = b
      if stop and self.limit is None:
        self.limit = b + (self.lead or 1)
      self._cond.notify_all()

  def gone(self, b: int) -> bool:
    """True when batch b will never be trained (a stop came before it)."""
    limit = self.limit
    return limit is not None and b >= limit


def copy_to(device: Union[str, Sequence[str]], payload: Any) -> Any:
  """Copies a payload's tensors onto `device`: a tensor list or (tensor list, scale). With a
  list of R devices (replicas of a pipeline) the list is R equal groups, group r to device r."""
  tensors, meta = payload if isinstance(payload, tuple) else (payload, None)
  devices = [device] if isinstance(device, str) else list(device)
  size = max(1, len(tensors) // len(devices))
  copied = []
  for i, t in enumerate(tensors):
    with tf.device(devices[min(i // size, len(devices) - 1)]):
      copied.append(tf.identity(t) if t is not None else None)
  return copied if meta is None else (copied, meta)


class Links:
  """The channels of one epoch: per cut a (sender, receiver) pair each way, labels, results.

  Stage 0 reads mini-batches `(inputs, y[, sample_weight])` (inputs a tuple,
  see `tfpipe.training.data`); labels and sample weights travel to the last stage on
  their own channel.
  """

  def __init__(self, K: int, poll: float, maxsize: int, micro_batches: int = 1,
               lead: Optional[int] = None) -> None:
    self.K, self.stop, self.micro_batches = K, threading.Event(), micro_batches

    def pair() -> Tuple[Channel, Channel]:
      return Channel(self.stop, maxsize, poll), Channel(self.stop, maxsize, poll)
    self.forward = [pair() for _ in range(K - 1)]
    self.backward = [pair() for _ in range(K - 1)]
    self.barrier = Barrier(K, self.stop, poll)  # S tasks (lock-step steps)
    self.labels = Channel(self.stop, 0, poll)   # stage 0 -> last stage
    self.results = Channel(self.stop, 0, poll)  # last stage -> caller (the gate bounds it)
    self.gate = Gate(self.stop, lead, poll)
    # stage 0: the current mini-batch's micro-batches
    self._pieces: "collections.deque[Any]" = collections.deque()

  def cancel(self, b: int) -> Callable[[], bool]:
    """The cancel test of a blocking call for batch b."""
    return lambda: self.gate.gone(b)

  def inputs(self, k: int, batches: Iterator[Any], labelled: bool, b: int,
             micro: Optional[int] = None) -> Tuple[List[Any], Any, Any]:
    """Stage k's next inputs, their share of the mini-batch, and at the last stage the
    labels and sample weights (y, sample_weight).

    Stage 0 reads a mini-batch at its first micro-batch (if the gate admits
    it) and splits it. Raises Skipped for a batch that will not be trained.
    """
    if k > 0:
      _, (xs, scale) = self.forward[k - 1][1].get(self.cancel(b))
      y = self.labels.get(self.cancel(b)) if labelled and k == self.K - 1 else None
      return xs, y, scale
    if not self._pieces:
      if not self.gate.admit(b):
        raise Skipped()
      try:
        item = next(batches)
      except StopIteration:
        raise OutOfData() from None
      x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(item) if labelled else (
          item, None, None)
      xs = list(x) if isinstance(x, (tuple, list)) else [x]
      M = 1 if micro is None else self.micro_batches
      self._pieces.extend(pieces.split((xs, (y, sample_weight)), M, cut=tf.split))
    (xs, y), scale = self._pieces.popleft()
    if labelled and self.K > 1:
      self.labels.put(y)
    return xs, y, scale


@contextlib.contextmanager
def spawn(stop: threading.Event) -> Iterator[Callable[[Callable[[], None], str], None]]:
  """Starts threads with `launch(fn, name)`; always joins them; re-raises the first error.

  The body runs in the caller's thread (it may consume results); an exception
  there also stops the threads.
  """
  threads, errors = [], []

  def launch(fn: Callable[[], None], name: str) -> None:
    def run() -> None:
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
    assert error is not None
    raise error.with_traceback(traceback)
