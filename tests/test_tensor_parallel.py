"""Integrated batch x model parallelism: the grid trains exactly as one device does."""

import keras
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.baselines import tensor_parallel
from tests import helpers


def _fit(trainer_or_model, x, y, steps=20):
  trainer_or_model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                           keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           metrics=["accuracy"])
  return trainer_or_model.fit(x, y, batch_size=16, epochs=steps // 10, shuffle=False, verbose=0)


@pytest.mark.parametrize("grid", ["2x2", "1x3", "4x1", "1x2", "3x1"])
def test_grid_equals_single_device_training(grid):
  x, y = helpers.as_arrays(helpers.batches(10))
  expected = helpers.sequential_mlp(width=16, depth=4)
  _fit(expected, x, y)
  model = helpers.sequential_mlp(width=16, depth=4)
  trainer = tfpipe.create(model, "grid", grid=grid)
  history = _fit(trainer, x, y)
  assert "accuracy" in history.history and len(history.history["loss"]) == 2
  for a, b in zip(model.get_weights(), expected.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)   # 20 steps, weights back in `model`


def test_shards_compute_on_their_grid_devices():
  model = helpers.sequential_mlp(width=16, depth=2)
  trainer = tensor_parallel.GridParallel(model, "2x2")
  layer = trainer.layer
  graph = tf.function(layer.call).get_concrete_function(tf.TensorSpec([None, 8])).graph
  devices = {tf.DeviceSpec.from_string(op.device).device_index
             for op in graph.get_operations() if op.type == "MatMul"}
  assert devices == {0, 1, 2, 3}
  kind, kernels, _ = layer.shards[0]
  assert kind == "column" and [k.shape for k in kernels] == [(8, 8), (8, 8)]
  assert layer.shards[1][0] == "row" and [k.shape for k in layer.shards[1][1]] == [(8, 16)] * 2
  assert "2x2 grid" in trainer.describe()


def test_communication_volume_of_batch_model_and_grid():
  units, n_in, batch = [2048] * 7 + [10], 400, 256
  batch_only = tensor_parallel.communication_bytes(units, n_in, batch, "4x1")
  model_only = tensor_parallel.communication_bytes(units, n_in, batch, "1x4")
  grid = tensor_parallel.communication_bytes(units, n_in, batch, "2x2")
  weights = sum(a * b + b for a, b in zip([n_in] + units[:-1], units))
  assert batch_only["weights"] == 2 * 3 * weights * 4        # every shard to 3 groups and back
  assert model_only["weights"] == 0                          # each weight lives on one device
  assert model_only["activations"] > batch_only["activations"]
  assert grid["weights"] == batch_only["weights"] // 3       # one other group
  assert grid["total"] < batch_only["total"]


def test_what_cannot_be_sharded_is_refused():
  with pytest.raises(ValueError, match="a grid is BATCHxMODEL, e.g. 2x2. Received: '2by2'"):
    tensor_parallel.GridParallel(helpers.sequential_mlp(), "2by2")
  with pytest.raises(ValueError, match="has 3 units, fewer than the 4 model shards"):
    tensor_parallel.GridParallel(helpers.sequential_mlp(width=16, depth=4), "1x4")
  conv = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(2, 3),
                           keras.layers.Flatten(), keras.layers.Dense(3)])
  with pytest.raises(ValueError, match="layer 'conv2d.*' is a Conv2D"):
    tensor_parallel.GridParallel(conv, "2x2")
  with pytest.raises(ValueError, match="too few devices"):
    tensor_parallel.GridParallel(helpers.sequential_mlp(), "4x4")
