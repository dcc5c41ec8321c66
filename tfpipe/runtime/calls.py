"""What the compiled executor's calls share: the feed of mini-batches, their shapes, the
window functions per batch size, and the clearer error when a stage fails inside a call."""

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

  def __init__(self, fn):
    self.fn, self.functions = fn, {}

  def key(self, data, batch_axis):
    """Which function serves `data` (tensors, nested) whose batch is axis `batch_axis`."""
    return tuple(tuple(t.shape[:batch_axis + 1]) for t in tf.nest.flatten(data)
                 if isinstance(t, tf.Tensor))

  def get(self, data, batch_axis):
    """The function for `data` (tensors, nested) whose batch is axis `batch_axis`."""
    key = self.key(data, batch_axis)
    if key not in self.functions:
      self.functions[key] = compat.own_function(self.fn, autograph=False, reduce_retracing=True)
    return self.functions[key]

  def tracing_count(self):
    """Traces of every function so far."""
    return sum(f.experimental_get_tracing_count() for f in self.functions.values())


class Feed:
  """Mini-batches read in order from `batches`, kept until their window has taken them."""

  def __init__(self, batches, labelled):
    self.batches, self.labelled, self.items, self.read = batches, labelled, {}, 0

  def get(self, b):
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

  def drop_before(self, b):
    for old in [i for i in self.items if i < b]:
      del self.items[old]


def shapes(item):
  return tuple(tuple(t.shape) for t in tf.nest.flatten(item) if t is not None)


def raise_clearer(error):
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


def same_shapes(items):
  """`items` (mini-batches) in runs of equal shapes, in order."""
  runs: list = []
  for item in items:
    if runs and shapes(runs[-1][0]) == shapes(item):
      runs[-1].append(item)
    else:
      runs.append([item])
  return runs
