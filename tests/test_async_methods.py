"""The asynchronous rules of 2021-2025 (docs/methods.md): PipeDream-2BW's one-update-old
weights, Nesterov's look-ahead update (momentum SGD and Adam) and DC-ASGD's delay
compensation, each equal to its slow reference rule and to its rule written out on one whole
model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tfpipe.rules import optimizers
import tfpipe

LR, MOMENTUM = 0.05, 0.9


def _stage_weights(pipe):
  return [[v.numpy() for v in p.trainable] for p in pipe.programs]


def _batches(n):
  return [(x.astype("float64"), y) for x, y in helpers.batches(n)]


_model = lambda: helpers.sequential_mlp(dtype="float64")
_loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")


def _run_both(method, options, K=3, n=12, epochs=1, runtime=helpers.RUNTIMES[0],
              optimizer=lambda: optimizers.SpecTrain(LR, MOMENTUM)):
  """The pipeline (recording its tasks when threaded) and its reference rule, trained.

  In float64, as tests/test_mitigations.py explains: a rule that orders its float ops other
  than the reference does differs by round-off, which float32 on these nets amplifies."""
  bs = _batches(n)
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(_model(), runtime, num_stages=K, method=method,
                                    record=runtime["executor"] == "threaded", **options)
  loss = _loss()
  expected, log = helpers.reference_train(pipe.stage_models, loss, bs, method, LR, MOMENTUM,
                                          epochs=epochs, optimizer=optimizer(), **options)
  compile_(optimizer(), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=epochs)
  return pipe, expected, log


def _assert_follows(pipe, expected, log, runtime):
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, rtol=1e-7, atol=1e-9)
  if runtime["executor"] == "threaded":   # every task read the version the rule says
    seen = {}
    for r in pipe.records:
      for kind in {"FB": ("F", "B"), "F": ("F",), "B": ("B",)}.get(r.kind, ()):
        seen[(r.stage, kind, r.batch, r.micro)] = r.version
    assert seen == {(k, kind, b, i): v for k, kind, b, i, v in log}


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("options,epochs", helpers.on_one_worker("2bw-rule", [({}, 2), ({"micro_batches": 2}, 1)]))
def test_2bw_equals_its_reference_rule(options, epochs, runtime):
  pipe, expected, log = _run_both("2bw", options, epochs=epochs, runtime=runtime)
  assert pipe.micro_batches == options.get("micro_batches", 3)   # default M = K
  _assert_follows(pipe, expected, log, runtime)


def test_2bw_reads_weights_one_update_old_at_every_stage():
  _, _, log = _run_both("2bw", {"micro_batches": 2}, K=3)
  assert log and all(v == max(b - 1, 0) for _, _, b, _, v in log)
  _, _, log = _run_both("pipedream", {"micro_batches": 2}, K=3)   # the check can fail
  assert any(v != max(b - 1, 0) for _, _, b, _, v in log)


def _delayed_rule_on_one_model(bs, lr, momentum, nesterov=False, lam=0.0):
  """W_(t+1) = W_t - eta * v_t, v_t = gamma v_(t-1) + (1 - gamma) g(W_(t-1)) (W_(-1) = W_0),
  written out on the whole model with a plain tape (2BW's rule, PipeDream-2BW eq. 1);
  `nesterov`: the step is eta * (gamma v_t + (1 - gamma) g); `lam`: g is first DC-ASGD's
  g + lam g g (W_t - W_(t-1))."""
  model, loss = _model(), _loss()
  lr = float(np.float32(lr))   # Keras keeps the learning rate in float32
  W = [v.numpy() for v in model.trainable_variables]
  P = [w.copy() for w in W]
  V = [np.zeros_like(w) for w in W]
  for x, y in bs:
    for v, p in zip(model.trainable_variables, P):
      v.assign(p)
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    grads = [g.numpy() for g in tape.gradient(value, model.trainable_variables)]
    grads = [g + lam * g * g * (w - p) for g, w, p in zip(grads, W, P)]
    P = [w.copy() for w in W]
    V = [momentum * v + (1 - momentum) * g for v, g in zip(V, grads)]
    steps = [momentum * v + (1 - momentum) * g for v, g in zip(V, grads)] if nesterov else V
    W = [w - lr * v for w, v in zip(W, steps)]
  return W


def _delayed_adam_rule_on_one_model(bs, lr, nesterov):
  """2BW's rule (gradients taken at the weights one update old) with Keras's Adam written
  out: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, W -= alpha m / (sqrt(v) + eps), alpha = lr
  sqrt(1 - b2^t) / (1 - b1^t); `nesterov`: W -= alpha (b1 m + (1-b1) g) / (sqrt(v) + eps)."""
  model, loss = _model(), _loss()
  lr, b1, b2, eps = float(np.float32(lr)), 0.9, 0.999, 1e-7   # Keras keeps lr in float32,
  f1, f2 = float(np.float32(b1)), float(np.float32(b2))   # and casts the betas of its powers
  W = [v.numpy() for v in model.trainable_variables]
  P = [w.copy() for w in W]
  m = [np.zeros_like(w) for w in W]
  q = [np.zeros_like(w) for w in W]
  for t, (x, y) in enumerate(bs, start=1):
    for v, p in zip(model.trainable_variables, P):
      v.assign(p)
    with tf.GradientTape() as tape:
      value = loss(y, model(x, training=True))
    grads = [g.numpy() for g in tape.gradient(value, model.trainable_variables)]
    P = [w.copy() for w in W]
    m = [b1 * mi + (1 - b1) * g for mi, g in zip(m, grads)]
    q = [b2 * qi + (1 - b2) * g * g for qi, g in zip(q, grads)]
    alpha = lr * np.sqrt(1 - f2 ** t) / (1 - f1 ** t)
    steps = [f1 * mi + (1 - f1) * g for mi, g in zip(m, grads)] if nesterov else m
    W = [w - alpha * s / (np.sqrt(qi) + eps) for w, s, qi in zip(W, steps, q)]
  return W


@pytest.mark.parametrize("nesterov", [False, True])
def test_2bw_with_adam_equals_the_delayed_adam_rule_on_one_model(nesterov):
  bs = _batches(10)
  x, y = helpers.as_arrays(bs)
  model = _model()
  pipe, compile_ = helpers.pipeline(model, helpers.RUNTIMES[1], num_stages=3, method="2bw",
                                    nesterov=nesterov)
  compile_(keras.optimizers.Adam(1e-2), _loss())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  expected = _delayed_adam_rule_on_one_model(bs, 1e-2, nesterov)
  helpers.assert_weights_close(model.get_weights(), expected, rtol=1e-7, atol=1e-9)
  if nesterov:   # the look-ahead changes the result: the comparison can fail
    plain = _delayed_adam_rule_on_one_model(bs, 1e-2, False)
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), plain)) > 1e-4


@pytest.mark.parametrize("options", [{}, {"nesterov": True}, {"delay_compensation": 2.0},
                                     {"nesterov": True, "delay_compensation": 2.0}])
def test_2bw_equals_the_delayed_gradient_rule_on_one_model(options):
  bs = _batches(10)
  x, y = helpers.as_arrays(bs)
  model = _model()
  pipe, compile_ = helpers.pipeline(model, helpers.RUNTIMES[1], num_stages=3, method="2bw",
                                    **options)
  compile_(optimizers.SpecTrain(LR, MOMENTUM), _loss())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  expected = _delayed_rule_on_one_model(bs, LR, MOMENTUM, options.get("nesterov", False),
                                        options.get("delay_compensation", 0.0))
  helpers.assert_weights_close(model.get_weights(), expected, rtol=1e-7, atol=1e-9)
  if options:   # the options change the result: the comparison can fail
    plain = _delayed_rule_on_one_model(bs, LR, MOMENTUM)
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), plain)) > 1e-3


SGD = lambda: keras.optimizers.SGD(LR, momentum=MOMENTUM)


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,options,optimizer", helpers.on_one_worker("update-rule", [
    ("pipedream", {"nesterov": True}, SGD),
    ("pipedream", {"nesterov": True, "micro_batches": 2}, SGD),
    ("vanilla", {"nesterov": True}, lambda: optimizers.SpecTrain(LR, MOMENTUM)),
    ("pipedream", {"delay_compensation": 2.0}, SGD),
    ("pipedream", {"delay_compensation": 2.0, "micro_batches": 2}, SGD),
    ("spectrain", {"delay_compensation": 2.0, "version_difference": "exact"},
     lambda: optimizers.SpecTrain(LR, MOMENTUM)),
    ("ddg", {"delay_compensation": 2.0, "nesterov": True}, SGD),
    ("pipedream", {"delay_compensation": 2.0}, lambda: keras.optimizers.Adam(1e-2)),
    # Nesterov's look-ahead with Adam: on PipeDream's stash (the paper's code, with NAdam)
    # and on SpecTrain's prediction over M=K micro-batches (`spectrain+mb+nesterov/adam`).
    ("pipedream", {"nesterov": True}, lambda: keras.optimizers.Adam(1e-2)),
    ("spectrain", {"nesterov": True, "micro_batches": 3, "version_difference": "exact"},
     lambda: keras.optimizers.Adam(1e-2)),
]))
def test_update_options_equal_their_reference_rule(method, options, optimizer, runtime):
  pipe, expected, log = _run_both(method, options, runtime=runtime, optimizer=optimizer)
  _assert_follows(pipe, expected, log, runtime)
  without = {k: v for k, v in options.items() if k not in ("nesterov", "delay_compensation")}
  plain = helpers.reference_train(pipe.stage_models, _loss(), _batches(12), method, LR,
                                  MOMENTUM, optimizer=optimizer(), **without)[0]
  assert max(np.abs(a - b).max() for ws, ps in zip(_stage_weights(pipe), plain)
             for a, b in zip(ws, ps)) > 1e-4   # the options act


@pytest.mark.parametrize("options,message", [
    ({"method": "pipedream", "nesterov": True, "spike_compensation": True}, "choose one"),
    ({"method": "vanilla", "delay_compensation": 0.5}, "recomputes"),
    ({"method": "pipedream", "delay_compensation": -1.0}, "delay_compensation=-1.0"),
    ({"method": "pipedream", "nesterov": "yes"}, "nesterov='yes'"),
])
def test_bad_update_options_are_refused_by_name(options, message):
  with pytest.raises(ValueError, match=message):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, **options)


@pytest.mark.parametrize("optimizer,message", [
    (lambda: keras.optimizers.RMSprop(), "nesterov changes a momentum SGD or Adam update.*"
                                         "Received: RMSprop"),
    (lambda: keras.optimizers.Adam(amsgrad=True), "Received: Adam with amsgrad=True"),
    (lambda: keras.optimizers.AdamW(), "without weight_decay.*AdamW with weight_decay=0.004"),
    (lambda: keras.optimizers.SGD(momentum=0.9, gradient_accumulation_steps=2),
     "without gradient_accumulation_steps.*SGD with gradient_accumulation_steps=2"),
])
def test_nesterov_needs_a_momentum_sgd_or_adam_optimizer(optimizer, message):
  pipe, compile_ = helpers.pipeline(_model(), helpers.RUNTIMES[1], num_stages=2,
                                    method="pipedream", nesterov=True)
  with pytest.raises(ValueError, match=message):
    compile_(optimizer(), keras.losses.SparseCategoricalCrossentropy())


def test_2bw_refuses_too_few_micro_batches():
  with pytest.raises(ValueError, match=r"at least K - 1 = 3 micro-batches.*micro_batches=2"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=4, method="2bw", micro_batches=2)


@pytest.mark.parametrize("asked,advice_table,expected", [
    ({}, {"spike_compensation": True, "version_difference": "exact"},
     {"spike_compensation": True, "version_difference": "exact"}),
    ({"spike_compensation": False}, {"spike_compensation": True, "version_difference": "exact"},
     {"spike_compensation": False, "version_difference": "exact"}),   # a value passed is kept
    ({"spike_compensation": True}, {"nesterov": True}, {"spike_compensation": True,
                                                        "nesterov": False}),   # excluded
    ({}, {}, {"spike_compensation": False, "version_difference": "paper"}),
])
def test_spectrain_takes_the_advised_options_it_was_left(monkeypatch, asked, advice_table,
                                                         expected):
  from tfpipe.rules import advice
  monkeypatch.setitem(advice.SPECTRAIN, "sgd", advice_table)
  monkeypatch.delitem(advice.MICRO_BATCHES, "sgd")   # SPECTRAIN's table alone: M = 1
  monkeypatch.delitem(advice.ONE_UPDATE, "sgd")
  pipe, compile_ = helpers.pipeline(_model(), helpers.RUNTIMES[1], num_stages=2,
                                    method="spectrain", advice=True, **asked)
  assert "advised for the optimizer at compile" in pipe.describe() or asked
  compile_(SGD(), _loss())
  for name, value in expected.items():
    assert getattr(pipe.options, name) == value, name
  advised = {n: v for n, v in advice_table.items() if n not in asked and expected.get(n, v)}
  said = (f"({', '.join(sorted(advised))} advised for sgd" if advised else
          "(no option advised for sgd")
  assert said in pipe.describe()
  # The advised run is the rule of those options: the reference, asked the same, resolves
  # the options left unset the same way.
  bs = _batches(6)
  x, y = helpers.as_arrays(bs)
  ref = helpers.reference_train(pipe.stage_models, _loss(), bs, "spectrain", LR, MOMENTUM,
                                optimizer=SGD(), advice=True, **asked)[0]
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, r in zip(_stage_weights(pipe), ref):
    helpers.assert_weights_close(actual, r, rtol=1e-7, atol=1e-9)


def test_other_methods_and_optimizers_take_no_advice(monkeypatch):
  from tfpipe.rules import advice
  monkeypatch.setitem(advice.SPECTRAIN, "sgd", {"spike_compensation": True})
  monkeypatch.delitem(advice.MICRO_BATCHES, "sgd")
  pipe, compile_ = helpers.pipeline(_model(), helpers.RUNTIMES[1], num_stages=2,
                                    method="pipedream", advice=True)
  compile_(SGD(), _loss())
  assert pipe.options.spike_compensation is False and "advised" not in pipe.describe()
  pipe, compile_ = helpers.pipeline(_model(), helpers.RUNTIMES[1], num_stages=2,
                                    method="spectrain", advice=True)
  compile_(keras.optimizers.Adam(), _loss())   # the Adam family's advice at K=2: Nesterov's
  assert pipe.options.spike_compensation is False
  assert "(nesterov advised for adam: tfpipe.rules.advice)" in pipe.describe()


@pytest.mark.parametrize("K,optimizer", [(2, lambda: keras.optimizers.Adam()),
                                         (4, lambda: optimizers.SpecTrain(LR, MOMENTUM)),
                                         (8, lambda: keras.optimizers.SGD(0.1, momentum=0.9))])
def test_a_method_name_means_its_papers_rule_unless_advice_is_asked_for(K, optimizer):
  # Nothing asked: the paper's SpecTrain (one batch per update, its version differences, no
  # update option), whatever the optimizer and depth; the summary says so in plain words.
  from tfpipe.training import options as options_lib
  model = helpers.sequential_mlp(dtype="float64")
  given = options_lib.Asked(method="spectrain")
  options, _, _ = options_lib.resolved(options_lib.checked(given, model, K), given, model,
                                       optimizer(), K)
  assert options.micro_batches == 1 and options.version_difference == "paper"
  assert options.update_options() == [] and not options.advised
  line = options.describe(K, batch_size=32)
  assert line.startswith("method=spectrain (asynchronous: stale updates, its weights will not "
                         "equal Keras fit's), ") and "one update per mini-batch taken whole" in line
  assert "advised" not in line
  # Asked for, the advice applies, and the line names the micro-batches' size.
  given = options_lib.Asked(method="spectrain", advice=True)
  options, _, _ = options_lib.resolved(options_lib.checked(given, model, K), given, model,
                                       optimizer(), K)
  assert options.advised
  if options.micro_batches > 1:
    assert (f"{options.micro_batches} micro-batches of {32 // options.micro_batches} samples "
            "per update") in options.describe(K, batch_size=32)
  with pytest.raises(ValueError, match="`advice` must be True or False. Received: advice='yes'"):
    options_lib.checked(options_lib.Asked(method="spectrain", advice="yes"), model, K)


@pytest.mark.parametrize("optimizer,words", [
    (lambda: optimizers.SpecTrain(0.1, 0.9),
     "momentum SGD (SpecTrain's optimizer, momentum 0.9)"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.5), "momentum SGD (momentum 0.5)"),
    (lambda: keras.optimizers.SGD(0.1), "SGD"), (lambda: keras.optimizers.Adam(), "Adam")])
def test_the_summary_line_names_the_optimizer_in_plain_words(optimizer, words):
  pipe, compile_ = helpers.pipeline(_model(), helpers.RUNTIMES[1], num_stages=2, method="1f1b")
  compile_(optimizer(), _loss())
  line = pipe.describe()
  assert line.startswith("method=1f1b (synchronous: the updates of Keras fit), 2 stages, 4 "
                         "micro-batches (1/4 of a mini-batch each) per update, " + words), line


def _adam():
  return keras.optimizers.Adam(0.01)


def _spectrain_sgd():
  return optimizers.SpecTrain(LR, MOMENTUM)


@pytest.mark.parametrize("K,optimizer,asked,batch_norm,expected", [
    (4, _adam, {}, False, 4),                                   # advised: M = K
    (8, _adam, {}, False, 8),
    (9, _adam, {}, False, 9),                                   # deeper than Nesterov's was run
    (2, _adam, {}, False, 1),                                   # below MICRO_BATCHES' depth
    (2, _spectrain_sgd, {}, False, 1),                          # M=1 bounds K=2's predictions
    (2, _spectrain_sgd, {"micro_batches": 1}, False, 1),
    (2, _spectrain_sgd, {"version_difference": "paper"}, False, 1),   # the paper's rule
    (4, _spectrain_sgd, {}, False, 8),                          # momentum SGD: from K=4, M=2K
    (8, SGD, {}, False, 16),
    (4, _adam, {"micro_batches": 1}, False, 1),                 # a value passed is kept
    (4, _adam, {"micro_batches": 2}, False, 2),
    (4, _spectrain_sgd, {"micro_batches": 1}, False, 1),
    (4, _adam, {"version_difference": "paper"}, False, 1),      # "paper" counts whole batches
    (4, _spectrain_sgd, {"version_difference": "paper"}, False, 1),
    (4, _adam, {"version_difference": "exact"}, False, 4),
    (4, _adam, {}, True, 1),                                    # BatchNormalization's statistics
    (4, _spectrain_sgd, {}, True, 1),
    (4, _adam, {"batch_statistics": "micro_batch"}, True, 4),
])
def test_spectrain_splits_batches_into_one_micro_batch_per_stage_where_advised(
    K, optimizer, asked, batch_norm, expected):
  from tfpipe.training import options as options_lib
  model = helpers.sequential_mlp(dtype="float64")
  if batch_norm:
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
  given = options_lib.Asked(method="spectrain", advice=True, **asked)
  checked = options_lib.checked(given, model, K)
  options, _, _ = options_lib.resolved(checked, given, model, optimizer(), K)
  assert options.micro_batches == expected
  line = options.describe(K)
  family = "adam" if optimizer is _adam else "sgd"
  advised = expected > 1 and "micro_batches" not in asked
  assert ("micro_batches" in options.advised) == advised
  # Momentum SGD takes Nesterov's step where M bounds every prediction to one update
  # (M >= K - 1 > 0: K=2 with M=1 too), whether M was advised or passed, unless the paper's
  # version differences were asked for; Adam too, at the depths it was measured at (K <= 8).
  nesterov = ((family == "sgd" or K <= 8) and expected >= K - 1
              and asked.get("version_difference") != "paper")
  assert options.nesterov is nesterov
  words = "Adam" if family == "adam" else "momentum SGD ("
  if nesterov and not advised and expected == 1:
    assert f"{K} stages, one update per mini-batch taken whole, {words}" in line, line
    assert f", nesterov (nesterov advised for {family}: tfpipe.rules.advice)" in line, line
  if nesterov and not advised and expected > 1:
    assert f"{expected} micro-batches (1/{expected} of a mini-batch each) per update" in line
    assert f", nesterov (nesterov advised for {family}" in line, line
  if advised:
    names = ["micro_batches"] + ([] if "version_difference" in asked else ["version_difference"])
    names = ", ".join(sorted(names + (["nesterov"] if nesterov else [])))
    assert f"{expected} micro-batches (1/{expected} of a mini-batch each) per update" in line
    assert f"{', nesterov' if nesterov else ''} ({names} advised for " \
           f"{family}: tfpipe.rules.advice)" in line, line
    assert options.version_difference == "exact"
  # Compiled again with an optimizer of no family, the advice follows it: none.
  options, _, _ = options_lib.resolved(options, given, model, keras.optimizers.RMSprop(0.01), K)
  assert options.micro_batches == asked.get("micro_batches", 1)
  assert "micro_batches" not in options.advised and options.nesterov is False


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("family,optimizer,rule,M", [
    ("adam", _adam, {"nesterov": True}, 4), ("sgd", _spectrain_sgd, {"nesterov": True}, 8)])
def test_advised_micro_batches_train_by_the_rule_they_name(runtime, family, optimizer, rule, M):
  # spectrain at K=4 and nothing asked equals the reference asked for M=K (Adam) or 2K
  # (momentum SGD), exact version differences and Nesterov's step: the advice is that rule,
  # not another.
  bs = _batches(8)
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(_model(), runtime, num_stages=4, method="spectrain",
                                    advice=True)
  expected = helpers.reference_train(pipe.stage_models, _loss(), bs, "spectrain", LR, MOMENTUM,
                                     optimizer=optimizer(), micro_batches=M,
                                     version_difference="exact", **rule)[0]
  # The reference left unset resolves the same advice; without Nesterov's step it differs.
  unset = helpers.reference_train(pipe.stage_models, _loss(), bs, "spectrain", LR, MOMENTUM,
                                  optimizer=optimizer(), advice=True)[0]
  for a, b in zip(expected, unset):
    helpers.assert_weights_close(a, b, rtol=0, atol=0)
  if rule:
    plain = helpers.reference_train(pipe.stage_models, _loss(), bs, "spectrain", LR, MOMENTUM,
                                    optimizer=optimizer(), micro_batches=M, nesterov=False)[0]
    assert not np.allclose(plain[0][0], expected[0][0])
  compile_(optimizer(), _loss())
  assert pipe.micro_batches == M and pipe.options.nesterov is bool(rule)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, r in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, r, rtol=1e-7, atol=1e-9)
  # A last batch too small to split says where M came from and how to opt out.
  with pytest.raises(ValueError, match=r"last batch of 2 samples \(130 in batches of 16\).*"
                     rf"micro_batches={M} was advised for {family} by tfpipe.rules.advice: pass "
                     r"micro_batches=1"):
    pipe.fit(np.concatenate([x] * 2)[:130], np.concatenate([y] * 2)[:130], batch_size=16,
             verbose=0)
