"""Runtime: the first exception in any stage stops every thread and reaches the caller."""

import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import runtime
from tfpipe.rules import optimizers
from tfpipe.runtime import iterators
import tfpipe


class Boom(keras.layers.Layer):
  """Raises on its `fail_at`-th call in training."""

  def __init__(self, fail_at, **kwargs):
    super().__init__(**kwargs)
    self.fail_at, self.calls = fail_at, 0

  def _check(self, x):
    self.calls += 1
    if self.calls >= self.fail_at:
      raise ValueError(f"boom at call {self.calls}")
    return x

  def call(self, x):
    y = tf.numpy_function(self._check, [x], x.dtype, stateful=True)
    return tf.ensure_shape(y, x.shape)

  def compute_output_shape(self, input_shape):
    return input_shape


def _model(fail_at):
  keras.utils.set_random_seed(0)
  x = keras.Input((8,))
  h = keras.layers.Dense(8)(x)
  h = keras.layers.Dense(8)(h)
  h = Boom(fail_at)(h)
  h = keras.layers.Dense(8)(h)
  return keras.Model(x, keras.layers.Dense(3)(h))


def _pipeline_threads():
  # An iterator's deleting thread (`tfpipe.runtime.iterators`) ends on its own, after the fit.
  return [t for t in threading.enumerate()
          if t.name.startswith("tfpipe-") and t.name != iterators.THREAD_NAME]


# The compiled executor's window calls each stage's task functions; TensorFlow may report the
# cancellation that followed a failed call instead of its error: tfpipe then says so.
_COMPILED_FAILURE = "boom at call 5|failed inside a compiled window.*executor='threaded'"


@pytest.mark.parametrize("method,executor,inline,expected", [
    ("pipedream", "threaded", None, "boom at call 5"),
    ("vanilla", "threaded", None, "boom at call 5"),
    ("pipedream", "compiled", True, "boom at call 5"),
    ("sequential", "compiled", False, _COMPILED_FAILURE),
    ("pipedream", "compiled", False, _COMPILED_FAILURE)])
def test_a_failing_stage_stops_the_pipeline(method, executor, inline, expected):
  pipe = tfpipe.Pipeline(_model(fail_at=5), num_stages=3, method=method, executor=executor)
  pipe.compile(optimizers.SpecTrain(0.01), "sparse_categorical_crossentropy")
  if inline is not None:
    pipe.runtime.inline = inline
  x = np.zeros((64 * 16, 8), "float32")
  y = np.zeros(64 * 16, "int64")
  start = time.perf_counter()
  with pytest.raises(Exception, match=expected):
    pipe.fit(x, y, batch_size=16, verbose=0)
  # Not a speed check: a hang would block here forever; this bounds the wait.
  assert time.perf_counter() - start < 60
  assert _pipeline_threads() == []


def test_channel_get_gives_up_when_stopped():
  stop = threading.Event()
  channel = runtime.Channel(stop, maxsize=1, poll=0.01)
  threading.Timer(0.05, stop.set).start()
  with pytest.raises(runtime.Stopped):
    channel.get()


def test_spawn_reraises_the_first_error_and_joins():
  stop = threading.Event()
  channel = runtime.Channel(stop, poll=0.01)

  def fails():
    raise KeyError("first")

  with pytest.raises(KeyError, match="first"):
    with runtime.spawn(stop) as start:
      start(fails, "tfpipe-test-a")
      start(channel.get, "tfpipe-test-b")  # would block forever without the stop
  assert _pipeline_threads() == []
