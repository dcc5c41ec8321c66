"""Integrated batch x model parallelism (Laugier et al.): tensor-parallel Dense layers on a grid.

n_b: batch groups, n_m: model shards, grid device (i, j): batch group i,
shard j; L: Dense layers. Layers alternate: a column layer splits its
kernel's output units over the n_m shards (each computes its slice of the
output, activation included); the next, a row layer, splits its kernel's
input units the same way, so it takes the sharded activations as they are
and its n_m partial products are summed (then the bias and activation). A
column layer at the end gathers its slices. The batch is split over the n_b
groups; every group runs with the same weights.

Shard j's variables live on device (0, j); group i's computation with them
runs on device (i, j), where TensorFlow copies the shard, and the gradients
of the groups add up on the way back: the all-reduce of data parallelism
over the n_b groups. n_m = 1 is plain data parallelism, n_b = 1 plain
tensor (model) parallelism. `communication_bytes` gives the tensor volume
each step moves between grid devices under this placement.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe.baselines import keras as baselines
from tfpipe.plan import schedules

__all__ = ["parse_grid", "dense_layers", "GridMLP", "GridParallel", "communication_bytes"]


def parse_grid(grid):
  """(n_b, n_m) from "2x2" or a pair of positive integers."""
  parts = grid.lower().split("x") if isinstance(grid, str) else list(grid)
  try:
    n_b, n_m = (int(p) for p in parts)
  except (TypeError, ValueError):
    raise ValueError(f"a grid is BATCHxMODEL, e.g. 2x2. Received: {grid!r}") from None
  if n_b < 1 or n_m < 1:
    raise ValueError(f"grid sizes must be >= 1. Received: {grid!r}")
  return n_b, n_m


def dense_layers(model):
  """The model's Dense layers in order; refuses any other layer but Input and Flatten first."""
  layers = [l for l in model.layers if not isinstance(l, keras.layers.InputLayer)]
  dense, started = [], False
  for layer in layers:
    if isinstance(layer, keras.layers.Flatten) and not started:
      continue
    if not isinstance(layer, keras.layers.Dense):
      raise ValueError(
          f"tensor parallelism here shards fully connected models (Dense layers, a Flatten "
          f"first); layer {layer.name!r} is a {type(layer).__name__}")
    started = True
    dense.append(layer)
  if not dense:
    raise ValueError(f"model {model.name!r} has no Dense layer to shard")
  return dense


def _split_sizes(n, parts):
  if n < parts:
    raise ValueError(f"cannot split {n} units over {parts} shards")
  return schedules.micro_sizes(n, parts)


class GridMLP(keras.layers.Layer):
  """The Dense stack of a model, sharded over an n_b x n_m grid of devices."""

  def __init__(self, specs, grid_devices, **kwargs):
    super().__init__(**kwargs)
    self.specs = specs                  # [(units, activation, use_bias)]
    self.grid_devices = grid_devices    # [n_b][n_m] device strings
    self.n_b, self.n_m = len(grid_devices), len(grid_devices[0])

  def build(self, input_shape):
    n_in = int(np.prod(input_shape[1:]))
    self.shards = []   # per layer: (kind, [kernel_j], [bias_j] or bias)
    for l, (units, _, use_bias) in enumerate(self.specs):
      kind = "column" if l % 2 == 0 else "row"
      kernels, biases = [], []
      sizes = _split_sizes(units if kind == "column" else n_in, self.n_m)
      for j, size in enumerate(sizes):
        with tf.device(self.grid_devices[0][j]):
          shape = (n_in, size) if kind == "column" else (size, units)
          kernels.append(self.add_weight(shape=shape, name=f"kernel{l}_{j}"))
          if use_bias and kind == "column":
            biases.append(self.add_weight(shape=(size,), initializer="zeros", name=f"bias{l}_{j}"))
      if use_bias and kind == "row":
        with tf.device(self.grid_devices[0][0]):
          biases.append(self.add_weight(shape=(units,), initializer="zeros", name=f"bias{l}"))
      self.shards.append((kind, kernels, biases))
      n_in = units

  def _group(self, i, h):
    devices = self.grid_devices[i]
    for (kind, kernels, biases), (_, activation, _) in zip(self.shards, self.specs):
      act = keras.activations.get(activation)
      if kind == "column":
        out = []
        for j, kernel in enumerate(kernels):
          with tf.device(devices[j]):
            y = tf.matmul(h if not isinstance(h, list) else h[j], kernel)
            out.append(act(y + biases[j] if biases else y))
        h = out
      else:
        partials = []
        for j, kernel in enumerate(kernels):
          with tf.device(devices[j]):
            partials.append(tf.matmul(h[j], kernel))
        with tf.device(devices[0]):
          y = tf.add_n(partials)
          h = act(y + biases[0] if biases else y)
    if isinstance(h, list):
      with tf.device(devices[0]):
        h = tf.concat(h, axis=-1)
    return h

  def call(self, x):
    x = tf.reshape(x, (tf.shape(x)[0], -1))
    n = tf.shape(x)[0]
    sizes = tf.stack([n // self.n_b + tf.cast(i < n % self.n_b, n.dtype) for i in range(self.n_b)])
    parts = tf.split(x, sizes, num=self.n_b)
    outputs = []
    for i in range(self.n_b):
      with tf.device(self.grid_devices[i][0]):
        outputs.append(self._group(i, parts[i]))
    with tf.device(self.grid_devices[0][0]):
      return tf.concat(outputs, 0)

  def load(self, dense):
    """Takes the kernels and biases of `dense` (the model's Dense layers), cut into shards."""
    for (kind, kernels, biases), layer in zip(self.shards, dense):
      axis = 1 if kind == "column" else 0
      pieces = np.split(layer.kernel.numpy(), np.cumsum([k.shape[axis] for k in kernels])[:-1],
                        axis=axis)
      for var, piece in zip(kernels, pieces):
        var.assign(piece)
      if biases:
        full = layer.bias.numpy()
        if kind == "column":
          for var, piece in zip(biases, np.split(full, np.cumsum([b.shape[0] for b in biases])[:-1])):
            var.assign(piece)
        else:
          biases[0].assign(full)

  def assemble(self):
    """Per layer, the full (kernel, bias or None) from the shards."""
    result = []
    for kind, kernels, biases in self.shards:
      kernel = np.concatenate([k.numpy() for k in kernels], axis=1 if kind == "column" else 0)
      bias = (np.concatenate([b.numpy() for b in biases]) if biases else None)
      result.append((kernel, bias))
    return result


class GridParallel(baselines.KerasRunner):
  """Trains a fully connected Keras model with its Dense layers sharded on an n_b x n_m grid.

  `grid`: (n_b, n_m) or "2x2"; `devices`: n_b * n_m devices, row by row
  (default: the first local GPUs, else logical CPUs). Keras `compile`/`fit`;
  after `fit` the trained weights are in the user's model.
  """

  def __init__(self, model, grid=(2, 2), devices=None):
    super().__init__(model)
    self.grid = parse_grid(grid)
    n_b, n_m = self.grid
    flat = devices_lib.resolve_devices(devices, None if devices is not None else n_b * n_m)
    if len(flat) != n_b * n_m:
      raise ValueError(f"a {n_b}x{n_m} grid needs {n_b * n_m} devices. Received: {flat}")
    self.grid_devices = [flat[i * n_m:(i + 1) * n_m] for i in range(n_b)]
    self.dense = dense_layers(model)
    for l, layer in enumerate(self.dense):
      if l % 2 == 0 and layer.units < n_m:  # a column layer needs a unit per shard
        raise ValueError(f"layer {layer.name!r} has {layer.units} units, fewer than the {n_m} "
                         f"model shards of the grid {n_b}x{n_m}")
    specs = [(l.units, l.activation, l.use_bias) for l in self.dense]
    inputs = keras.Input(model.inputs[0].shape[1:])
    self.layer = GridMLP(specs, self.grid_devices, name="grid_mlp")
    self._trained = keras.Model(inputs, self.layer(inputs), name=f"{model.name}_grid")
    self.layer.load(self.dense)

  def describe(self):
    n_b, n_m = self.grid
    return f"{n_b}x{n_m} grid (batch x model) over {self.grid_devices}"

  def _check_batch(self, x, batch_size):
    size = batch_size
    if isinstance(x, tf.data.Dataset):
      size = tf.nest.flatten(x.element_spec)[0].shape[0]
    if size is not None and size < self.grid[0]:
      raise ValueError(f"a batch of {size} cannot be split over {self.grid[0]} batch groups")

  def fit(self, *args, **kwargs):
    self.layer.load(self.dense)   # the user's model may have changed since
    return super().fit(*args, **kwargs)

  def _sync_back(self):
    for layer, (kernel, bias) in zip(self.dense, self.layer.assemble()):
      layer.kernel.assign(kernel)
      if bias is not None:
        layer.bias.assign(bias)


def communication_bytes(layer_units, input_units, batch_size, grid, itemsize=4):
  """Bytes a training step moves between grid devices under GridMLP's placement.

  Returns {"weights": ..., "activations": ..., "total": ...}: weights, the
  shards copied to the n_b - 1 other batch groups and their gradients summed
  back; activations, per group a column layer's input copied to its n_m - 1
  other shards, a row layer's n_m - 1 partial sums brought together, each
  again as gradients in the backward pass, plus splitting the batch and
  gathering the outputs.
  """
  n_b, n_m = parse_grid(grid)
  n_in, weights, acts = input_units, 0, 0.0
  for l, units in enumerate(layer_units):
    weights += n_in * units + units
    if l % 2 == 0:   # column: its whole input (the batch, or a row layer's sum) to every shard
      acts += 2 * (n_m - 1) * batch_size * n_in
    else:            # row: its input is already sharded; the partial sums go to shard 0
      acts += 2 * (n_m - 1) * batch_size * units
    n_in = units
  if len(layer_units) % 2 == 1:   # a column layer last: gather its slices
    acts += 2 * (n_m - 1) / n_m * batch_size * layer_units[-1]
  acts += 2 * (n_b - 1) / n_b * batch_size * (input_units + layer_units[-1])  # split, gather
  weight_bytes = 2 * (n_b - 1) * weights * itemsize
  act_bytes = int(acts * itemsize)
  return {"weights": weight_bytes, "activations": act_bytes, "total": weight_bytes + act_bytes}
