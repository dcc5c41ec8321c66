"""Profiling: each layer's measured forward and backward time on a device."""

import numpy as np
import tensorflow as tf

from tfpipe.instruments.costs import median_seconds

__all__ = ["profile_nodes", "Profiler", "example"]


def example(tensor, batch_size, rng):
  shape = (batch_size,) + tuple(d if d is not None else 1 for d in tensor.shape[1:])
  dtype = tf.as_dtype(tensor.dtype)
  if dtype.is_floating:
    return tf.constant(rng.standard_normal(shape), dtype=dtype)
  return tf.zeros(shape, dtype=dtype)


def profile_nodes(nodes, batch_size, device, repeats=5, seed=0):
  """Measures every node's forward and backward seconds at `batch_size` on `device`.

  The layer's input is random data of the shape the layer sees in the model. On a TF
  server's device each call returns the sum of its outputs (what a run reads back stays
  there).
  Returns (forward_times, backward_times), backward = (forward+backward) - forward.
  """
  rng = np.random.default_rng(seed)
  forward_times, backward_times = [], []
  # On a TF server, the outputs are summed there: read back whole, they would cross the link.
  remote = tf.DeviceSpec.from_string(device).job not in (None, "localhost")
  out = (lambda ts: [tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in ts])]
         if remote and ts else ts)
  for node in nodes:
    layer = node.operation
    inputs = list(node.input_tensors)
    with tf.device(device):
      values = [example(t, batch_size, rng) for t in inputs]

    def call(*xs, node=node, inputs=inputs):
      args, kwargs = node.arguments.fill_in({id(t): x for t, x in zip(inputs, xs)})
      return [y for y in tf.nest.flatten(node.operation(*args, **kwargs)) if y.dtype.is_floating]

    @tf.function(autograph=False)   # as the executor traces the stages
    def forward(*xs, call=call):
      with tf.device(device):
        return out(call(*xs))

    @tf.function(autograph=False)   # as the executor traces the stages
    def forward_backward(*xs, call=call, layer=layer):
      with tf.device(device):
        floats = [x for x in xs if x.dtype.is_floating]
        with tf.GradientTape() as tape:
          tape.watch(floats)
          ys = call(*xs)
          total = tf.add_n([tf.reduce_sum(y) for y in ys]) if ys else tf.constant(0.0)
        grads = tape.gradient(total, list(layer.trainable_variables) + floats,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return out(grads + [total])

    f = median_seconds(lambda: forward(*values), repeats)
    fb = median_seconds(lambda: forward_backward(*values), repeats)
    forward_times.append(f)
    backward_times.append(max(fb - f, 0.0))
  return forward_times, backward_times


class Profiler:
  """A `profile` callable for `partition.partition`: nodes -> (forward, backward) times."""

  def __init__(self, batch_size, device, repeats=5):
    self.batch_size, self.device, self.repeats = batch_size, device, repeats

  def __call__(self, nodes):
    return profile_nodes(nodes, self.batch_size, self.device, self.repeats)
