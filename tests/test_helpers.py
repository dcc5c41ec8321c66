"""The tests' cache of reference rules and Keras fits returns what a fresh run computes, and
runs again when anything the run reads differs (a weight, a batch, an option, the optimizer,
the advice tables that resolve the options left unset, the fit's arguments)."""

import keras
import numpy as np
import pytest

from tests import helpers
from tfpipe.rules import advice, optimizers, reference
from tfpipe.stage import partition


def _stages():
  return partition.partition(helpers.sequential_mlp(), 2).stages


def _args():
  return ([(x, y) for x, y in helpers.batches(4)], "pipedream", 0.05, 0.9)


def _same(a, b):
  return all(np.array_equal(x, y) for wa, wb in zip(a[0], b[0]) for x, y in zip(wa, wb)) \
      and a[1] == b[1]


@pytest.fixture
def counted(monkeypatch):
  calls = []
  real = reference.reference_train

  def count(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
  monkeypatch.setattr(reference, "reference_train", count)
  monkeypatch.setattr(helpers, "_RESULTS", {})
  return calls


def test_the_same_inputs_are_computed_once_and_equal_a_fresh_reference(counted):
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  batches, method, lr, momentum = _args()
  first = helpers.reference_train(_stages(), loss, batches, method, lr, momentum)
  first[0][0][0][...] = 7.0   # a caller's change does not reach the cache
  again = helpers.reference_train(_stages(), loss, batches, method, lr, momentum)
  assert len(counted) == 1
  fresh = reference.reference_train(_stages(), loss, batches, method, lr, momentum)
  assert _same(again, fresh)


@pytest.mark.parametrize("change", ["weight", "batch", "option", "optimizer", "advice"])
def test_any_input_the_rule_reads_is_computed_afresh(counted, monkeypatch, change):
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  batches, _, lr, momentum = _args()
  method = "spectrain"
  helpers.reference_train(_stages(), loss, batches, method, lr, momentum,
                          optimizer=optimizers.SpecTrain(lr, momentum))
  stages, kwargs = _stages(), {"optimizer": optimizers.SpecTrain(lr, momentum)}
  if change == "weight":
    v = stages[1].trainable_variables[0]
    v.assign(v + 1e-3)
  elif change == "batch":
    batches = [(x + 1e-3, y) for x, y in batches]
  elif change == "option":
    kwargs["nesterov"] = False   # the advice for momentum SGD: True
  elif change == "optimizer":
    kwargs["optimizer"] = optimizers.SpecTrain(lr, 0.5)
  else:   # what spectrain's unset options resolve to
    monkeypatch.setitem(advice.ONE_UPDATE, "sgd", {})
  got = helpers.reference_train(stages, loss, batches, method, lr, momentum, **kwargs)
  assert len(counted) == 2
  assert _same(got, reference.reference_train(stages, loss, batches, method, lr, momentum,
                                              **kwargs))


def _fit(model, lr=0.05, x_shift=0.0, epochs=1):
  x, y = helpers.as_arrays(helpers.batches(4))
  return helpers.keras_fit_weights(model, keras.optimizers.SGD(lr, momentum=0.9),
                                   keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                   x + x_shift, y, batch_size=16, epochs=epochs, shuffle=False,
                                   verbose=0)


def test_a_keras_fit_is_run_once_per_distinct_input_and_equals_a_fresh_fit(monkeypatch):
  monkeypatch.setattr(helpers, "_RESULTS", {})
  first = _fit(helpers.sequential_mlp())
  model = helpers.sequential_mlp()
  cached = _fit(model)
  assert [np.array_equal(a, b) for a, b in zip(model.get_weights(),
                                               helpers.sequential_mlp().get_weights())] \
      == [True] * len(first)   # not trained again: the cached weights came back
  helpers.assert_weights_close(cached, first, rtol=0, atol=0)
  assert len(helpers._RESULTS) == 1   # pylint: disable=protected-access
  # Any change to what the fit reads runs it afresh.
  changed = [_fit(helpers.sequential_mlp(seed=1)), _fit(helpers.sequential_mlp(), lr=0.1),
             _fit(helpers.sequential_mlp(), x_shift=1e-3), _fit(helpers.sequential_mlp(), epochs=2)]
  assert len(helpers._RESULTS) == 5   # pylint: disable=protected-access
  for got in changed:
    assert not all(np.array_equal(a, b) for a, b in zip(got, first))
  # and what it gives is what a fit outside the cache gives.
  model = helpers.sequential_mlp()
  model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = helpers.as_arrays(helpers.batches(4))
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  helpers.assert_weights_close(changed[1], model.get_weights(), rtol=0, atol=0)


def test_the_suite_traces_graphs_without_op_tracebacks():
  import os
  import tensorflow as tf
  from tensorflow.python.framework import ops
  from tests import tracing
  if os.environ.get("TFPIPE_TEST_OP_TRACEBACKS") == "1":
    pytest.skip("TFPIPE_TEST_OP_TRACEBACKS=1 keeps them")

  @tf.function
  def f(x):
    return x * 2.0

  op = f.get_concrete_function(tf.TensorSpec([], tf.float32)).graph.get_operations()[-1]
  assert tracing.skip_op_tracebacks() and not op.traceback
  assert ops._create_c_op.keywords == {"extract_traceback": False}   # pylint: disable=protected-access
