"""The asynchronous rules of 2021-2025 (DESIGN.md section 3): PipeDream-2BW's one-update-old
weights, Nesterov's look-ahead update and DC-ASGD's delay compensation, each equal to its
slow reference rule and to its rule written out on one whole model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tfpipe import optimizers, reference
import tfpipe

LR, MOMENTUM = 0.05, 0.9


def _stage_weights(pipe):
  return [[v.numpy() for v in p.trainable] for p in pipe.programs]


def _run_both(method, options, K=3, n=12, epochs=1, runtime=helpers.RUNTIMES[0],
              optimizer=lambda: optimizers.SpecTrain(LR, MOMENTUM)):
  """The pipeline (recording its tasks when threaded) and its reference rule, trained."""
  bs = helpers.batches(n)
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(helpers.mlp(), runtime, num_stages=K, method=method,
                                    record=runtime["executor"] == "threaded", **options)
  loss = keras.losses.SparseCategoricalCrossentropy()
  expected, log = reference.reference_train(pipe.stage_models, loss, bs, method, LR, MOMENTUM,
                                            epochs=epochs, optimizer=optimizer(), **options)
  compile_(optimizer(), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=epochs)
  return pipe, expected, log


def _assert_follows(pipe, expected, log, runtime):
  tolerance = {"rtol": 1e-4, "atol": 1e-5} if runtime["executor"] == "compiled" else {}
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, **tolerance)
  if runtime["executor"] == "threaded":   # every task read the version the rule says
    seen = {}
    for r in pipe.records:
      for kind in {"FB": ("F", "B"), "F": ("F",), "B": ("B",)}.get(r.kind, ()):
        seen[(r.stage, kind, r.batch, r.micro)] = r.version
    assert seen == {(k, kind, b, i): v for k, kind, b, i, v in log}


@pytest.mark.parametrize("options,epochs", [({}, 2), ({"micro_batches": 2}, 1)])
@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
def test_2bw_equals_its_reference_rule(options, epochs, runtime):
  pipe, expected, log = _run_both("2bw", options, epochs=epochs, runtime=runtime)
  assert pipe.micro_batches == options.get("micro_batches", 3)   # default M = K
  _assert_follows(pipe, expected, log, runtime)


def test_2bw_reads_weights_one_update_old_at_every_stage():
  _, _, log = _run_both("2bw", {"micro_batches": 2}, K=3)
  assert log and all(v == max(b - 1, 0) for _, _, b, _, v in log)
  _, _, log = _run_both("pipedream", {"micro_batches": 2}, K=3)   # the check can fail
  assert any(v != max(b - 1, 0) for _, _, b, _, v in log)


def _delayed_rule_on_one_model(bs, lr, momentum):
  """W_(t+1) = W_t - eta * v_t, v_t = gamma v_(t-1) + (1 - gamma) g(W_(t-1)) (W_(-1) = W_0),
  written out on the whole model with a plain tape (2BW's rule, PipeDream-2BW eq. 1)."""
  model = helpers.mlp()
  loss = keras.losses.SparseCategoricalCrossentropy()
  W = [v.numpy() for v in model.trainable_variables]
  P = [w.copy() for w in W]
  V = [np.zeros_like(w) for w in W]
  for x, y in bs:
    for v, p in zip(model.trainable_variables, P):
      v.assign(p)
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    grads = [g.numpy() for g in tape.gradient(value, model.trainable_variables)]
    P = [w.copy() for w in W]
    V = [momentum * v + (1 - momentum) * g for v, g in zip(V, grads)]
    W = [w - lr * v for w, v in zip(W, V)]
  return W


def test_2bw_equals_the_delayed_gradient_rule_on_one_model():
  bs = helpers.batches(10)
  x, y = helpers.as_arrays(bs)
  model = helpers.mlp()
  pipe, compile_ = helpers.pipeline(model, helpers.RUNTIMES[1], num_stages=3, method="2bw")
  compile_(optimizers.SpecTrain(LR, MOMENTUM), keras.losses.SparseCategoricalCrossentropy())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  helpers.assert_weights_close(model.get_weights(), _delayed_rule_on_one_model(bs, LR, MOMENTUM),
                               rtol=1e-4, atol=1e-5)


def test_2bw_refuses_too_few_micro_batches():
  with pytest.raises(ValueError, match=r"at least K - 1 = 3 micro-batches.*micro_batches=2"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=4, method="2bw", micro_batches=2)
