"""The tests' reference cache returns what a fresh reference computes, and recomputes when
anything the rule reads differs (a weight, a batch, an option, the optimizer, the advice
tables that resolve the options left unset)."""

import keras
import numpy as np
import pytest

from tests import helpers
from tfpipe import advice, optimizers, partition, reference


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
  monkeypatch.setattr(helpers, "_REFERENCES", {})
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
    kwargs["nesterov"] = True
  elif change == "optimizer":
    kwargs["optimizer"] = optimizers.SpecTrain(lr, 0.5)
  else:   # what spectrain's unset options resolve to
    monkeypatch.setitem(advice.SPECTRAIN, "sgd", {"spike_compensation": True})
  got = helpers.reference_train(stages, loss, batches, method, lr, momentum, **kwargs)
  assert len(counted) == 2
  assert _same(got, reference.reference_train(stages, loss, batches, method, lr, momentum,
                                              **kwargs))
