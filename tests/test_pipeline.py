"""Pipeline: staleness-free methods equal Keras; every method equals its reference rule."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.conftest import DEVICES
from tfpipe import models
from tfpipe.plan import versions
from tfpipe.rules import optimizers
import tfpipe

LR, MOMENTUM = 0.05, 0.9


def _stage_weights(pipe):
  return [[v.numpy() for v in p.trainable] for p in pipe.programs]


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("build", helpers.on_one_worker("keras-fit", [helpers.sequential_mlp, helpers.skip_model],
                                            key=lambda build: build.__name__))
def test_sequential_equals_keras(build, K, runtime):
  _assert_equals_keras(build, K, "sequential", runtime=runtime)


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("build", helpers.on_one_worker("keras-fit", [helpers.sequential_mlp, helpers.skip_model],
                                            key=lambda build: build.__name__))
def test_gpipe_equals_keras_at_the_mini_batch_size(build, recompute, runtime):
  # 4 micro-batches of 4, gradients accumulated, one update per mini-batch of 16. Summing
  # micro-batch gradients rounds differently from one mean over 16 samples (~1e-7), and these
  # small random-label nets amplify float32 round-off to 1e-4..1e-1 in 20 steps, for micro-
  # batches in any code (measured with a plain GradientTape loop). In float64 the two agree
  # to 1e-9, so the equivalence is checked there.
  pipe = _assert_equals_keras(functools.partial(build, dtype="float64"), 3, "gpipe",
                              loss_dtype="float64", micro_batches=4, recompute=recompute,
                              runtime=runtime)
  assert pipe.policy.recompute == recompute


def test_gpipe_uneven_micro_batches_weigh_by_size():
  # 18 samples per mini-batch in 4 micro-batches of 5, 5, 4, 4: still the mini-batch's gradient.
  _assert_equals_keras(functools.partial(helpers.sequential_mlp, dtype="float64"), 2, "gpipe",
                       loss_dtype="float64", micro_batches=4, batch_size=18)


def _assert_equals_keras(build, K, method, batch_size=16, lr=LR, loss_dtype=None,
                         runtime=helpers.RUNTIMES[1], **options):
  bs = helpers.batches(20)
  x, y = helpers.as_arrays(bs)
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype=loss_dtype)
  expected = helpers.keras_fit_weights(build(), keras.optimizers.SGD(lr, momentum=MOMENTUM),
                                      loss(), x, y, batch_size=batch_size, shuffle=False,
                                      verbose=0)
  model = build()
  pipe, compile_ = helpers.pipeline(model, runtime, num_stages=K, method=method, **options)
  compile_(keras.optimizers.SGD(lr, momentum=MOMENTUM), loss())
  pipe.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
  helpers.assert_weights_close(model.get_weights(), expected)
  return pipe


def _mean_gap(weights, other):
  return float(np.mean([np.abs(a - b).mean() for ws, os_ in zip(weights, other)
                        for a, b in zip(ws, os_)]))


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,other", [("pipedream", "vanilla"), ("vanilla", "pipedream")])
def test_xla_compiled_stages_follow_their_rule(method, other, runtime):
  # XLA fuses and reorders float ops, and round-off can flip a SELU input across 0, so
  # weights match the rule to ~1e-5 on average rather than element for element. The test
  # asserts the rule: far closer to its own reference than to the other method's.
  bs = helpers.batches(10)
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(helpers.mlp(), runtime, num_stages=2, method=method,
                                    jit_compile=True)
  loss = keras.losses.SparseCategoricalCrossentropy()
  own = helpers.reference_train(pipe.stage_models, loss, bs, method, LR, MOMENTUM)[0]
  alt = helpers.reference_train(pipe.stage_models, loss, bs, other, LR, MOMENTUM)[0]
  compile_(optimizers.SpecTrain(LR, MOMENTUM), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  got = _stage_weights(pipe)
  assert _mean_gap(got, own) < 1e-4
  assert _mean_gap(got, alt) > 100 * _mean_gap(got, own)


CASES = [
    ("sequential", {}),
    ("vanilla", {}),
    ("pipedream", {}),
    # The prediction rule itself: without the update options tfpipe.rules.advice adds (their own
    # equivalence is tests/test_mitigations.py's and tests/test_async_methods.py's).
    ("spectrain", {"spectrain_backward": "reuse", "version_difference": "paper",
                   "spike_compensation": False}),
    ("spectrain", {"spectrain_backward": "reuse", "version_difference": "exact",
                   "spike_compensation": False}),
    ("spectrain", {"spectrain_backward": "repredict", "version_difference": "paper",
                   "spike_compensation": False}),
    ("spectrain", {"spectrain_backward": "repredict", "version_difference": "exact",
                   "spike_compensation": False}),
    ("gpipe", {"micro_batches": 4}),
    ("gpipe", {"micro_batches": 3, "recompute": True}),
    ("1f1b", {"micro_batches": 4}),
    ("zb", {"micro_batches": 4}),
    ("ddg", {}),
    ("feature_replay", {}),
    ("ddg", {"lockstep": True}),
    ("feature_replay", {"lockstep": True}),
    ("timeprest", {"micro_batches": 2}),
    ("timeprest", {"micro_batches": 4}),
    ("vanilla", {"micro_batches": 2}),
    ("pipedream", {"micro_batches": 2}),
    ("spectrain", {"micro_batches": 2, "version_difference": "exact",
                   "spike_compensation": False}),
]


def _run_both(method, options, K=3, n=20, epochs=1, runtime=helpers.RUNTIMES[0], train=True):
  """The pipeline (recording its tasks when threaded) and its reference rule, trained (the
  pipeline only partitioned, not compiled or trained, without `train`)."""
  bs = helpers.batches(n)
  x, y = helpers.as_arrays(bs)
  model = helpers.mlp()
  pipe, compile_ = helpers.pipeline(model, runtime, num_stages=K, method=method,
                                    record=runtime["executor"] == "threaded", **options)
  loss = keras.losses.SparseCategoricalCrossentropy()
  expected, log = helpers.reference_train(pipe.stage_models, loss, bs, method, LR, MOMENTUM,
                                          epochs=epochs, **options)
  if train:
    compile_(optimizers.SpecTrain(LR, MOMENTUM), loss)
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=epochs)
  return pipe, expected, log


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,options", helpers.on_one_worker("rule", CASES))
def test_method_equals_reference_rule(method, options, runtime):
  pipe, expected, log = _run_both(method, options, runtime=runtime)
  # A tensor carried across a window boundary is a fresh buffer, and oneDNN's kernels may
  # round differently on it (timeprest, M=4: 4e-16 in float64, measured; 20 float32 steps of
  # these random-label nets amplify that to 9e-6), so the compiled runs compare to round-off.
  tolerance = {"rtol": 1e-4, "atol": 1e-5} if runtime["executor"] == "compiled" else {}
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, **tolerance)
  if runtime["executor"] == "compiled":
    return   # a window runs as one call: no per-task record (the weights say it all)
  # Every task read the weight version the rule says.
  seen = {}
  for r in pipe.records:
    for kind in {"FB": ("F", "B"), "F": ("F",), "B": ("B",)}.get(r.kind, ()):
      seen[(r.stage, kind, r.batch, r.micro)] = r.version
  assert seen == {(k, kind, b, i): v for k, kind, b, i, v in log}


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
def test_two_epochs_drain_and_continue(runtime):
  pipe, expected, _ = _run_both("spectrain", {"spike_compensation": False}, K=2, n=6, epochs=2,
                                runtime=runtime)
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref)


def test_a_token_model_follows_the_rule():
  # The staleness benchmark's attention model (bench/staleness.py, task `counting`): an
  # embedding (its gradient comes as IndexedSlices), attention and layer norms across a cut,
  # under SpecTrain's predicted weights.
  rng = np.random.default_rng(1)
  x = rng.integers(0, 16, (48, 10)).astype("int32")
  y = rng.integers(0, 10, 48)
  bs = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)]
  keras.utils.set_random_seed(0)
  model = models.build("counter", (10,), 10, scale=0.25, vocab_size=16, encoders=2)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  pipe = tfpipe.Pipeline(model, num_stages=2, method="spectrain", spike_compensation=False)
  expected, _ = helpers.reference_train(pipe.stage_models, loss, bs, "spectrain", LR, MOMENTUM,
                                        spike_compensation=False)
  pipe.compile(optimizers.SpecTrain(LR, MOMENTUM), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, rtol=1e-4, atol=1e-5)


def test_methods_differ_from_each_other():
  # The reference rules are not all the same rule: a check that the equivalences above bite.
  finals = {}
  for method in tfpipe.PIPELINE_METHODS:   # (interleaved, zbv: 2 devices x 2 of the 5 layers)
    K = 2 if method in ("interleaved", "zbv") else 3
    finals[method] = _run_both(method, {}, K=K, n=8, train=False)[1][0][0]
  # Same weights by design: ddg is pipedream's rule and feature_replay vanilla's, on another
  # timing (Kang's model-parallelism report section 2); the synchronous methods all equal plain
  # training, here at
  # other batch sizes (micro-batches) of the same data, so they differ by round-off only.
  same = {("ddg", "pipedream"), ("feature_replay", "vanilla")}
  sync = set(tfpipe.SYNCHRONOUS_METHODS)
  for a in finals:
    for b in finals:
      if a < b and (a, b) not in same and not {a, b} <= sync:
        assert not np.allclose(finals[a], finals[b], rtol=1e-6), (a, b)
  for a, b in same:
    np.testing.assert_array_equal(finals[a], finals[b])
  for method in sync:
    helpers.assert_close(finals[method], finals["sequential"], rtol=1e-5)


def test_exact_version_differences_equal_the_counts_observed_in_a_run():
  # For each forward, count the updates its stage really applied for earlier batches after
  # the forward started; `exact` must have predicted exactly that many.
  pipe, _, _ = _run_both("spectrain", {"version_difference": "exact"}, K=3, n=10)
  updates = [r for r in pipe.records if r.kind in ("B", "FB")]
  for r in pipe.records:
    if r.kind in ("F", "FB"):
      observed = sum(1 for u in updates
                     if u.stage == r.stage and u.batch < r.batch and u.start >= r.start)
      assert r.s == observed, r


def test_paper_version_differences_are_the_ones_used():
  pipe, _, _ = _run_both("spectrain", {"version_difference": "paper"}, K=3, n=6)
  for r in pipe.records:
    if r.kind.startswith("X"):
      continue  # transfers read no weights
    kind = "B" if r.kind == "B" else "F"
    assert r.s == versions.paper_version_difference(r.stage, 3, kind)


def test_pipedream_forward_and_backward_read_the_same_version():
  pipe, _, _ = _run_both("pipedream", {}, K=3, n=12)
  forward = {(r.stage, r.batch): r.version for r in pipe.records if r.kind in ("F", "FB")}
  backward = {(r.stage, r.batch): r.version for r in pipe.records if r.kind in ("B", "FB")}
  assert forward == backward
  # Forwards at stage k are stale by K-1-k in steady state.
  assert forward[(0, 10)] == 10 - 2 and forward[(1, 10)] == 10 - 1 and forward[(2, 10)] == 10
  # Stage k keeps at most K-k weight versions (and reaches it in steady state).
  assert pipe.runtime.peak_versions == [3, 2, 0]
  assert all(v <= 3 - k for k, v in enumerate(pipe.runtime.peak_versions))


def test_vanilla_backward_reads_current_weights():
  pipe, _, _ = _run_both("vanilla", {}, K=3, n=12)
  for r in pipe.records:
    if r.kind == "B":  # version = updates before it: every earlier batch's backward at k
      assert r.version == r.batch
  assert pipe.runtime.peak_versions == [0, 0, 0]  # inputs only
  assert pipe.runtime.peak_saved == [3, 2, 1]   # the last stage's step holds its forward


def test_spectrain_copies():
  # repredict: no weight copy outlives a task; the prediction is made inside it.
  pipe, _, _ = _run_both("spectrain", {"spectrain_backward": "repredict"}, K=3, n=12)
  assert pipe.runtime.peak_versions == [0, 0, 0]
  # reuse: the backward reads the forward's prediction, kept with its saved forward.
  pipe, _, _ = _run_both("spectrain", {"spectrain_backward": "reuse"}, K=3, n=12)
  assert all(v <= 3 - k for k, v in enumerate(pipe.runtime.peak_versions))


def test_weights_land_in_the_user_model_and_evaluate_matches_keras():
  bs = helpers.batches(8)
  x, y = helpers.as_arrays(bs)
  model = helpers.mlp()
  pipe = tfpipe.Pipeline(model, devices=DEVICES[:2], method="spectrain")
  pipe.compile(optimizers.SpecTrain(LR, MOMENTUM), "sparse_categorical_crossentropy",
               metrics=["accuracy"])
  history = pipe.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x, y))
  assert set(history.history) >= {"loss", "accuracy", "val_loss", "val_accuracy",
                                  "samples_per_second"}
  assert len(history.history["loss"]) == 2
  # Each stage has its own optimizer (own step counter and slots) from the user's config.
  assert len({id(p.optimizer) for p in pipe.programs}) == 2
  assert [int(p.optimizer.iterations.numpy()) for p in pipe.programs] == [16, 16]
  assert all(p.optimizer.get_config()["momentum"] == MOMENTUM for p in pipe.programs)
  for w, p in zip(model.get_weights(), [v.numpy() for prog in pipe.programs for v in prog.trainable]):
    np.testing.assert_array_equal(w, p)
  model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
  keras_loss, keras_acc = model.evaluate(x, y, batch_size=16, verbose=0)
  loss, acc = pipe.evaluate(x, y, batch_size=16)
  assert loss == pytest.approx(keras_loss, rel=1e-5) and acc == pytest.approx(keras_acc)
  helpers.assert_close(pipe.predict(x, batch_size=32), model.predict(x, verbose=0),
                             rtol=1e-5)
  assert history.history["val_loss"][-1] == pytest.approx(keras_loss, rel=1e-5)


def test_callbacks_early_stopping():
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="pipedream")
  pipe.compile(optimizers.SpecTrain(0.0, MOMENTUM), "sparse_categorical_crossentropy")
  stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1.0)
  history = pipe.fit(x, y, batch_size=16, epochs=10, verbose=0, callbacks=[stop])
  assert len(history.history["loss"]) == 2  # no improvement with learning rate 0


def test_bad_input_errors():
  model = helpers.mlp(depth=1)
  with pytest.raises(ValueError, match="unknown method 'spectrian'; did you mean 'spectrain'"):
    tfpipe.Pipeline(model, num_stages=2, method="spectrian")
  with pytest.raises(ValueError, match="too few devices for 5 stages"):
    tfpipe.Pipeline(model, num_stages=5)
  with pytest.raises(ValueError, match="cannot cut model 'mlp' into 3 stages: it has 2 cuttable layers"):
    tfpipe.Pipeline(model, num_stages=3)
  with pytest.raises(ValueError, match="`num_stages` must equal the number of devices"):
    tfpipe.Pipeline(model, devices=DEVICES[:2], num_stages=3)
  with pytest.raises(ValueError, match="no such local device"):
    tfpipe.Pipeline(model, devices=["/device:CPU:0", "/device:CPU:7"])
  with pytest.raises(ValueError, match=r"`micro_batches` must be at most 1024 .* Received: "
                     r"micro_batches=1000000"):   # refused before any planning
    tfpipe.Pipeline(model, num_stages=2, method="gpipe", micro_batches=10**6)
  pipe = tfpipe.Pipeline(model, num_stages=2, method="spectrain")
  with pytest.raises(ValueError, match="SGD without momentum keeps none"):
    pipe.compile(keras.optimizers.SGD(0.1), "mse")
  with pytest.raises(RuntimeError, match="call `compile"):
    pipe.fit(np.zeros((4, 8)), np.zeros(4))
  pipe.compile(optimizers.SpecTrain(0.1), "sparse_categorical_crossentropy")
  with pytest.raises(ValueError, match="`epochs` must be a positive integer. Received: epochs=0"):
    pipe.fit(np.zeros((4, 8)), np.zeros(4), epochs=0)
  with pytest.raises(ValueError, match="`x` and `y` must have the same length"):
    pipe.fit(np.zeros((4, 8)), np.zeros(3))
  data = tf.data.Dataset.from_tensor_slices((np.zeros((32, 8), "float32"), np.zeros(32))).batch(16)
  with pytest.raises(ValueError, match="the data ran out before 5 batches in epoch 0"):
    pipe.fit(data, steps_per_epoch=5, verbose=0)
  with pytest.raises(ValueError, match="size is unknown or infinite"):
    pipe.fit(data.repeat(), verbose=0)


# Every method whose backward recomputes its stage (and pipedream, which keeps the tape, as a
# control), on a model with Dropout in every stage: the recomputation replays the forward's
# masks, and the reference rule replays the same draws.
DROPOUT_CASES = [
    ("vanilla", {}),
    ("feature_replay", {}),
    ("timeprest", {"micro_batches": 2}),
    ("spectrain", {"spectrain_backward": "repredict"}),
    ("gpipe", {"micro_batches": 2, "recompute": True}),
    ("sequential", {"recompute": True}),
    ("pipedream", {}),
]


def _dropout_pipe(method, options, K=3, dtype=None, runtime=helpers.RUNTIMES[1]):
  return helpers.pipeline(helpers.dropout_mlp(dtype=dtype), runtime, num_stages=K, method=method,
                          partition=helpers.DROPOUT_CUTS[K], **options)


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,options", helpers.on_one_worker("dropout-rule", DROPOUT_CASES))
def test_dropout_method_equals_reference_rule(method, options, runtime):
  bs = helpers.batches(8)
  x, y = helpers.as_arrays(bs)
  # In float64, with the reference given the optimizer's float32 learning rate, the pipeline
  # equals the rule to round-off (measured: exactly); one mask drawn differently moves the
  # weights by ~1e-2 (before masks were replayed).
  pipe, compile_ = _dropout_pipe(method, options, dtype="float64", runtime=runtime)
  loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  expected, _ = helpers.reference_train(pipe.stage_models, loss, bs, method,
                                        float(np.float32(LR)), MOMENTUM, **options)
  compile_(optimizers.SpecTrain(LR, MOMENTUM), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method,options", [("sequential", {}), ("gpipe", {"micro_batches": 2})])
def test_dropout_recompute_equals_keeping_activations(method, options):
  x, y = helpers.as_arrays(helpers.batches(10))
  finals = []
  for recompute in (False, True):
    pipe, compile_ = _dropout_pipe(method, dict(options, recompute=recompute), K=2)
    compile_(keras.optimizers.SGD(LR, momentum=MOMENTUM), "sparse_categorical_crossentropy")
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    finals.append(_stage_weights(pipe))
  for a, b in zip(*finals):
    helpers.assert_weights_close(a, b, rtol=1e-6, atol=1e-7)
