"""Hybrid parallelism: a data-parallel stage inside the pipeline equals the method's rule."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.rules import optimizers
from tests import helpers

LR, MOMENTUM = 0.0625, 0.875  # exact in float32 too: the optimizer's float32 learning rate
                              # then equals the reference's Python float


def _float64_batches(n=12):
  return [(x.astype("float64"), y) for x, y in helpers.batches(n)]


@pytest.mark.parametrize("method,options", [
    ("pipedream", {}), ("spectrain", {}), ("spectrain", {"spectrain_backward": "repredict"}),
    ("vanilla", {}), ("gpipe", {"micro_batches": 2}), ("sequential", {}),
])
def test_replicated_stage_equals_the_reference_rule(method, options):
  # In float64: the replicas change only the order in which the gradient is summed.
  bs = _float64_batches()
  x, y = helpers.as_arrays(bs)
  loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  trained = {}
  for replicas in ({0: 2}, None):
    pipe = tfpipe.Pipeline(helpers.skip_model(dtype="float64"), num_stages=3, method=method,
                           stage_replicas=replicas, **options)
    if replicas:
      expected, _ = helpers.reference_train(pipe.stage_models, loss, bs, method, LR,
                                            MOMENTUM, **options)
    pipe.compile(optimizers.SpecTrain(LR, MOMENTUM), loss)
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    trained[bool(replicas)] = [[v.numpy() for v in p.trainable] for p in pipe.programs]
  for hybrid, plain, ref in zip(trained[True], trained[False], expected):
    helpers.assert_weights_close(hybrid, ref, rtol=1e-9, atol=1e-11)      # the rule
    helpers.assert_weights_close(hybrid, plain, rtol=1e-9, atol=1e-11)    # the same, unreplicated


def test_every_replica_computes_on_its_own_device():
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="pipedream",
                         stage_replicas={0: 3})
  pipe.compile(optimizers.SpecTrain(LR, MOMENTUM), keras.losses.SparseCategoricalCrossentropy())
  program = pipe.programs[0]
  graph = program.task("forward").get_concrete_function(
      [tf.TensorSpec([None, 8], tf.float32)], 0).graph
  devices = {op.device for op in graph.get_operations() if op.type == "MatMul"}
  assert {tf.DeviceSpec.from_string(d).device_index for d in devices} == {0, 1, 2}
  assert pipe.devices == [pipe.stage_devices[0][0], pipe.stage_devices[1][0]]
  printed = []
  pipe.summary(print_fn=printed.append)
  assert any(re.match(r"0\s+3 replicas on", line) for line in printed)   # stage 0's row


def test_replicated_stage_with_batch_norm_trains_and_averages_statistics():
  keras.utils.set_random_seed(0)
  inputs = keras.Input((8,))
  h = keras.layers.Dense(16)(inputs)
  h = keras.layers.BatchNormalization()(h)
  model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(16)(h)))
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe = tfpipe.Pipeline(model, num_stages=2, method="spectrain", stage_replicas={0: 2},
                         partition=[0, 2, 4])
  pipe.compile(optimizers.SpecTrain(LR, MOMENTUM),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  history = pipe.fit(x, y, batch_size=16, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  moving_mean = model.layers[2].moving_mean.numpy()
  assert np.all(np.isfinite(moving_mean)) and np.any(moving_mean != 0)


def test_bad_replicas_are_refused():
  with pytest.raises(ValueError, match="stage_replicas names stage 3, but the pipeline has 2"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, stage_replicas={3: 2})
  with pytest.raises(ValueError, match="STAGE:REPLICAS pairs such as 0:2"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, stage_replicas=["0-2"])
  with pytest.raises(ValueError, match="replicas >= 1"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, stage_replicas={0: 0})
  with pytest.raises(ValueError, match="too few devices"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=3, stage_replicas={0: 3})
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="gpipe", micro_batches=4,
                         stage_replicas={0: 2})
  pipe.compile(optimizers.SpecTrain(LR, MOMENTUM), keras.losses.SparseCategoricalCrossentropy())
  with pytest.raises(ValueError, match="`batch_size` must be at least 8. Received: batch_size=4"):
    pipe.fit(*helpers.as_arrays(helpers.batches(1)), batch_size=4, verbose=0)
