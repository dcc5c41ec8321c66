"""Baselines: MirroredStrategy data parallelism equals single-device training."""

import numpy as np
import pytest

from tests import helpers
from tests.conftest import DEVICES
from tfpipe.rules import optimizers
import tfpipe


def test_dataparallel_equals_single_at_the_same_global_batch():
  x, y = helpers.as_arrays(helpers.batches(10))
  single_model, dp_model = helpers.mlp(), helpers.mlp()
  single = tfpipe.create(single_model, "single")
  single.compile(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
  single.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  dp = tfpipe.create(dp_model, "dataparallel", devices=DEVICES[:2])
  dp.compile(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
  history = dp.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  assert "samples_per_second" in history.history
  helpers.assert_weights_close(dp_model.get_weights(), single_model.get_weights(), rtol=1e-5,
                               atol=1e-5)


def test_dataparallel_refuses_a_batch_that_does_not_split():
  dp = tfpipe.create(helpers.mlp(), "dataparallel", devices=DEVICES[:2])
  dp.compile(optimizers.SpecTrain(0.05), "sparse_categorical_crossentropy")
  with pytest.raises(ValueError, match="batch size 15 is not divisible by 2 replicas"):
    dp.fit(np.zeros((30, 8)), np.zeros(30), batch_size=15, verbose=0)


def test_create_names_methods():
  assert isinstance(tfpipe.create(helpers.mlp(), "vanilla", num_stages=2), tfpipe.Pipeline)
  with pytest.raises(ValueError, match="did you mean 'dataparallel'"):
    tfpipe.create(helpers.mlp(), "dataparalel")


def test_every_method_has_one_kind_that_callers_dispatch_on():
  kinds = {m: tfpipe.methods.kind(m) for m in tfpipe.METHODS}
  # "auto" is a pipeline whose method is chosen at its first fit.
  assert {m for m, k in kinds.items() if k.pipeline} == set(tfpipe.PIPELINE_METHODS) | {"auto"}
  assert {m for m, k in kinds.items() if k.parameter_servers} == set(tfpipe.CLUSTER_METHODS)
  assert kinds["single"].devices == "one" and kinds["grid"].devices == "grid"
  assert [m for m, k in kinds.items() if k.across_processes] == ["dataparallel"]
  with pytest.raises(ValueError, match="method"):
    tfpipe.methods.kind("gpipe2")


def test_baselines_take_keras_fit_arguments_like_the_pipeline():
  x, y = helpers.as_arrays(helpers.batches(6))
  weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
  trained = []
  for method in ("single", "sequential"):
    model = helpers.mlp()
    runner = tfpipe.create(model, method, num_stages=None if method == "single" else 2)
    runner.compile(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
    history = runner.fit(x, y, batch_size=16, shuffle=False, verbose=0, sample_weight=weights,
                         validation_split=0.25, validation_freq=1)
    assert "val_loss" in history.history
    trained.append(model.get_weights())
  helpers.assert_weights_close(trained[1], trained[0])
