"""What the compiled executor's calls share: the feed of mini-batches, their shapes, the
window functions per batch size, and the clearer error when a stage fails inside a call."""

from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfpipe import compat
from tfpipe.runtime.links import OutOfData

__all__ = ["StageFailed", "Feed", "Relaxed", "shapes", "same_shapes", "raise_clearer"]


class StageFailed(RuntimeError):
  """A stage's task failed in a compiled window; TensorFlow reported only what followed."""


class Relaxed:
  """`fn` traced as one `tf.function` per shape of its data up to the batch axis: inside one,
  a length that varies between calls (bucketed sequences) is traced once more at most, then
  relaxed to any length (TensorFlow's `reduce_retracing`), while the batch size, which a
  window splits into micro-batches by its static value, stays fixed (a smaller last batch
  has a function of its own)."""

  def __init__(self, fn: Callable[..., Any]) -> None:
    self.fn = fn
    self.functions: Dict[Tuple[Any, ...], Any] = {}   # per key: a tf.function

  def key(self, data: Any, batch_axis: int) -> Tuple[Tuple[Optional[int], ...], ...]:
    """Which function serves `data` (tensors, nested) whose batch is axis `batch_axis`."""
    return tuple(tuple(t.shape[:batch_axis + 1]) for t in tf.nest.flatten(data)
                 if isinstance(t, tf.Tensor))

  def get(self, data: Any, batch_axis: int) -> Any:
    """The function for `data` (tensors, nested) whose batch is axis `batch_axis`."""
    key = self.key(data, batch_axis)
    if key not in self.functions:
      self.functions[key] = compat.own_function(self.fn, autograph=False, reduce_retracing=True)
    return self.functions[key]

  def tracing_count(self) -> int:
    """Traces of every function so far."""
    return sum(f.experimental_get_tracing_count() for f in self.functions.values())


class Feed:
  """Mini-batches read in order from `batches`, kept until their window has taken them."""

  def __init__(self, batches: Iterator[Any], labelled: bool) -> None:
    self.batches, self.labelled, self.read = batches, labelled, 0
    self.items: Dict[int, Tuple[List[Any], Any, Any]] = {}   # b: (inputs, labels, weights)

  def get(self, b: int) -> Tuple[List[Any], Any, Any]:
    while self.read <= b:
      try:
        item = next(self.batches)
      except StopIteration:
        raise OutOfData() from None
      x, y, sample_weight = (keras.utils.unpack_x_y_sample_weight(item) if self.labelled
                             else (item, None, None))
      self.items[self.read] = (list(x) if isinstance(x, (tuple, list)) else [x], y, sample_weight)
      self.read += 1
    return self.items[b]

  def drop_before(self, b: int) -> None:
    for old in [i for i in self.items if i < b]:
      del self.items[old]


def shapes(item: Any) -> Tuple[Tuple[Optional[int], ...], ...]:
  return tuple(tuple(t.shape) for t in tf.nest.flatten(item) if t is not None)


def raise_clearer(error: tf.errors.OpError) -> NoReturn:
  """Re-raises `error` from a window call; a derived one (a cancellation that followed a
  stage's error, which TensorFlow may report instead of it) as `StageFailed`, saying so."""
  if not compat.is_derived(error):
    raise error
  lines = [l.strip() for l in error.message.splitlines()]
  line = next((l for l in lines if "ancel" in l), lines[-1])
  raise StageFailed(
      "a stage's computation failed inside a compiled window, and TensorFlow reported only "
      f"the cancellation that followed it ({line}). TensorFlow logs the first error as a "
      "warning: run with TF_CPP_MIN_LOG_LEVEL=0 to see it, or with executor='threaded', "
      "which runs task by task and raises it") from error


def same_shapes(items: Sequence[Any]) -> List[List[Any]]:
  """`items` (mini-batches) in runs of equal shapes, in order."""
  runs: List[List[Any]] = []
  for item in items:
    if runs and shapes(runs[-1][0]) == shapes(item):
      runs[-1].append(item)
    else:
      runs.append([item])
  return runs
