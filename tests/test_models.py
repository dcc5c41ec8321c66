"""Workloads: every model builds small, partitions into stages (2 and 4, or 4) and trains a step."""

import keras
import numpy as np
import pytest

from tests import helpers
import tfpipe
from tfpipe import models
from tfpipe.rules import optimizers

SHAPES = {"image": (32, 32, 3), "flat": (8, 8), "tokens": (12,)}
VOCAB = 50


def _data(name, n=8, seed=0):
  rng = np.random.default_rng(seed)
  shape = SHAPES[models.INPUTS[name]]
  if models.INPUTS[name] == "tokens":
    x = rng.integers(0, VOCAB, (n,) + shape).astype("int32")
  else:
    x = rng.normal(size=(n,) + shape).astype("float32")
  return x, rng.integers(0, 10, n)


def _build(name):
  options = {"vocab_size": VOCAB} if models.INPUTS[name] == "tokens" else {}
  return models.build(name, SHAPES[models.INPUTS[name]], 10, scale=1 / 16, **options)


def _train(model, x, y, **options):
  pipe = tfpipe.Pipeline(model, method="pipedream", **options)
  pipe.compile(optimizers.SpecTrain(0.01, 0.9),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  before = [v.numpy().copy() for v in model.trainable_variables]
  history = pipe.fit(x, y, batch_size=4, verbose=0)
  changed = [not np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables)]
  return pipe, history.history["loss"][0], changed


# The deep models cost ~35-50 s a training step at K=4 (tracing ~40 blocks per stage and their
# gradients); their partition is checked by computing the model: the four stages' forward
# equals the whole model's output (~8 s). Their blocks train at small depth (resnet20's, the
# residual LSTM's), and the transformer trains across cuts in test_token_ids_cross_a_cut_...
_DEEP = ("resnet152", "inception_v4", "transformer")


def _check_partition(pipe, model, K):
  assert len(pipe.stage_models) == K
  assert sum(len(names) for names in pipe.partition.layer_names) == len(
      tfpipe.stage.partition.graph_nodes(model)[2])


# The models whose step costs 3-6 s train at K=4 only (three cuts; residual_lstm's K=3 cut is
# test_embedding_stage_and_recurrent_stages's); the others at K=2 and 4.
_SLOW = ("residual_lstm", "resnet20", "bert", "counter")


@pytest.mark.parametrize("name,K", [(name, K) for name in models.MODELS if name not in _DEEP
                                    for K in ((4,) if name in _SLOW else (2, 4))])
def test_every_model_partitions_and_trains_a_step(name, K):
  model = _build(name)
  x, y = _data(name)
  pipe, loss, changed = _train(model, x, y, num_stages=K)
  _check_partition(pipe, model, K)
  assert np.isfinite(loss)
  # Every stage trained: some weight of each stage moved.
  for stage in pipe.stage_models:
    ids = {id(v) for v in stage.trainable_variables}
    assert any(c for v, c in zip(model.trainable_variables, changed) if id(v) in ids)


@pytest.mark.parametrize("name", _DEEP)
def test_deep_models_partition_into_stages_that_compute_the_model(name):
  model = _build(name)
  x, _ = _data(name)
  # A method that keeps no tape: compile traces no forward (the cut is what is tested).
  pipe = tfpipe.Pipeline(model, num_stages=4, method="vanilla")
  pipe.compile(optimizers.SpecTrain(0.01, 0.9),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  _check_partition(pipe, model, 4)
  # Against the model called eagerly (its predict would trace the whole model once more).
  helpers.assert_close(pipe.predict(x, batch_size=4, verbose=0),
                             np.asarray(model(x, training=False)), rtol=1e-5)


def test_embedding_stage_and_recurrent_stages():
  # The embedding alone on stage 0 (integer ids in, no input gradient), LSTM layers after it.
  model = _build("residual_lstm")
  x, y = _data("residual_lstm")
  n = len(tfpipe.stage.partition.graph_nodes(model)[2])
  pipe, loss, _ = _train(model, x, y, num_stages=3, partition=[0, 1, 5, n])
  assert pipe.partition.layer_names[0] == ["embedding"]
  assert pipe.partition.layer_names[1] == ["lstm0", "lstm1", "lstm2", "lstm3"]
  assert np.isfinite(loss)


def test_token_ids_cross_a_cut_in_the_transformer():
  # The decoder embeds the same tokens: the integer ids travel past the encoder's stage. One
  # block each (the full depth's cut is test_deep_models_...), cut so that stage 1 embeds them.
  model = models.build("transformer", SHAPES["tokens"], 10, scale=1 / 16, vocab_size=VOCAB,
                       blocks=1)
  x, y = _data("transformer")
  pipe, loss, _ = _train(model, x, y, num_stages=3, partition=[0, 2, 5, 8])
  assert pipe.partition.layer_names[1] == ["decoder_tokens", "decoder_positions", "encoder0"]
  crossing = [t for t in pipe.stage_models[1].inputs if "int" in str(t.dtype)]
  assert crossing and np.isfinite(loss)


def test_model_sizes_at_full_scale():
  # The papers' widths: snn 32 x 2048 SELU, dnn 7 x 2048 sigmoid, ResNet20's ~0.27M weights.
  snn = models.build("snn", (32, 32, 3), 10)
  assert len(snn.layers) == 34 and snn.layers[1].units == 2048
  dnn = models.build("dnn", (400,), 10000)
  assert [l.units for l in dnn.layers[1:-1]] == [2048] * 7
  assert dnn.count_params() == 2048 * 401 + 6 * 2048 * 2049 + 2049 * 10000  # the layer-wise partitioning paper's N_W
  assert 0.26e6 < models.build("resnet20", (32, 32, 3), 10).count_params() < 0.28e6


def test_bad_model_input_is_refused():
  with pytest.raises(ValueError, match="did you mean 'resnet20'"):
    models.build("resnet21", (32, 32, 3), 10)
  with pytest.raises(ValueError, match="vgg16 reads images"):
    models.build("vgg16", (64,), 10)
  with pytest.raises(ValueError, match="bert reads token ids"):
    models.build("bert", (12,), 2)
  with pytest.raises(ValueError, match="resnet152 needs images of at least 32x32"):
    models.build("resnet152", (8, 8, 1), 10)
  with pytest.raises(ValueError, match="`scale` must be a positive number"):
    models.build("snn", (8,), 10, scale=0)
