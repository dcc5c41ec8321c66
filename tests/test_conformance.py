"""Keras conformance: every case of `tests/conformance_cases.py` through plain Keras and a pipeline.

A "same" case asserts equal weights, equal History (every key, every epoch;
`samples_per_second` is the one key a pipeline adds), equal `evaluate` and
`predict`; a refusal case asserts the one-line message before any training.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import tfpipe
from tests import conformance_cases as cc
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA_KEYS = {"samples_per_second"}


def _fit_args(case, x, y):
  args = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
  args.update(case.fit(x, y))
  return args


def _run_keras(case):
  """Keras's own run of the case. Eager (`run_eagerly=True`: the same train, test and predict
  steps, untraced): a few small batches run faster than Keras's three traces."""
  x, y = case.data()
  model = case.model()
  model.compile(**{"run_eagerly": True, **case.compile()})
  history = model.fit(x, y, callbacks=case.callbacks(), **_fit_args(case, x, y))
  logs = model.evaluate(x, y, verbose=0, return_dict=True, **case.evaluate(x, y))
  return model.get_weights(), history.history, logs, model.predict(x, verbose=0)


def _pipeline(model, method, micro_batches, **options):
  return tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=micro_batches,
                         **options)


def _run_pipeline(case, method, micro_batches, options=None):
  x, y = case.data()
  model = case.model()
  pipe = _pipeline(model, method, micro_batches, **(options or {}))
  pipe.compile(**case.compile())
  history = pipe.fit(x, y, callbacks=case.callbacks(), **_fit_args(case, x, y))
  logs = pipe.evaluate(x, y, verbose=0, return_dict=True, **case.evaluate(x, y))
  return model.get_weights(), history.history, logs, pipe.predict(x, verbose=0)


def _close(a, b, atol):
  return np.allclose(np.asarray(a, "float64"), np.asarray(b, "float64"), atol=atol, rtol=1e-5,
                     equal_nan=True)


def assert_same(keras_run, pipe_run, atol):
  weights, history, logs, predicted = keras_run
  p_weights, p_history, p_logs, p_predicted = pipe_run
  for a, b in zip(weights, p_weights):
    assert _close(a, b, atol), f"weights differ by {np.nanmax(np.abs(a - b))}"
  assert set(p_history) - EXTRA_KEYS == set(history)
  for key, values in history.items():
    assert _close(values, p_history[key], atol), (key, values, p_history[key])
  assert set(p_logs) == set(logs)
  for key, value in logs.items():
    assert _close(value, p_logs[key], atol), (key, value, p_logs[key])
  if predicted is not None:   # several outputs: the same structure (list or dict) of each
    assert type(predicted) is type(p_predicted)
    for a, b in zip(keras.tree.flatten(predicted), keras.tree.flatten(p_predicted)):
      assert _close(a, b, atol)


def _param(case, pipeline):
  # A case's pipelines run on one pytest-xdist worker, where one Keras run serves them all.
  options = "".join(f"-{k}={v}" for k, v in (pipeline[2] if len(pipeline) > 2 else {}).items())
  return pytest.param(case, pipeline, id=f"{case.name}-{pipeline[0]}{pipeline[1]}{options}",
                      marks=pytest.mark.xdist_group(f"conformance-{case.name}"))


SAME = [_param(c, p) for c in cc.CASES if not c.refusal for p in c.pipelines]
REFUSED = [pytest.param(c, id=c.name) for c in cc.CASES if c.refusal]
_KERAS = {}


@pytest.mark.parametrize("case,pipeline", SAME)
def test_same_as_keras(case, pipeline):
  if case.name not in _KERAS:
    _KERAS[case.name] = _run_keras(case)
  assert_same(_KERAS[case.name], _run_pipeline(case, *pipeline), case.atol)


@pytest.mark.parametrize("case", REFUSED)
def test_refused_in_one_line(case):
  x, y = case.data()
  model = case.model()
  before = model.get_weights()
  with pytest.raises(ValueError, match=case.refusal) as raised:
    pipe = _pipeline(model, *case.refused_on)
    pipe.compile(**case.compile())
    pipe.fit(x, y, **_fit_args(case, x, y))
  assert "\n" not in str(raised.value)
  for a, b in zip(before, model.get_weights()):   # refused before any training
    np.testing.assert_array_equal(a, b)


def test_the_documented_contract_table_is_the_cases_table():
  with open(os.path.join(ROOT, "docs", "keras-contract.md")) as f:
    readme = f.read()
  assert cc.table() in readme, "docs/keras-contract.md's table: paste `python -m tests.conformance_cases`"


# Cases with a procedure of their own.

class _Interrupt(keras.callbacks.Callback):
  def on_epoch_begin(self, epoch, logs=None):
    if epoch == 2:
      raise RuntimeError("interrupted")


def _epochs_run(fit, tmp_path):
  seen = []
  record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: seen.append(e))
  backup = keras.callbacks.BackupAndRestore(str(tmp_path))
  with pytest.raises(RuntimeError, match="interrupted"):
    fit([backup, _Interrupt()])
  first = list(seen)
  seen.clear()
  fit([keras.callbacks.BackupAndRestore(str(tmp_path)), record])
  return first, list(seen)


def test_keras_backup_and_restore_resumes_as_in_keras(tmp_path):
  x, y = cc.data()
  runs = []
  for where, make in (("keras", lambda m: m), ("pipe", lambda m: _pipeline(m, "sequential", 1))):
    model = cc.mlp()
    trainer = make(model)
    trainer.compile(**cc.compiled()())
    runs.append(_epochs_run(lambda cbs: trainer.fit(x, y, batch_size=16, epochs=4, shuffle=False,
                                                   verbose=0, callbacks=cbs),
                            tmp_path / where))
    runs[-1] += (model.get_weights(),)
  (k_first, k_second, k_weights), (p_first, p_second, p_weights) = runs
  assert k_second == [2, 3] and p_second == k_second
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(k_weights, p_weights)) < 2e-5
  assert not os.path.exists(tmp_path / "pipe")   # deleted after a finished fit, as Keras's


def test_keras_backup_and_restore_with_batch_saves_is_refused(tmp_path):
  x, y = cc.data()
  pipe = _pipeline(cc.mlp(), "sequential", 1)
  pipe.compile(**cc.compiled()())
  with pytest.raises(ValueError, match=r"save_freq=2\) saves within epochs"):
    pipe.fit(x, y, batch_size=16, verbose=0,
             callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path), save_freq=2)])


def test_trainable_changed_after_compile():
  x, y = cc.data()
  model, reference = cc.mlp(), cc.mlp()
  pipe = _pipeline(model, "sequential", 1)
  pipe.compile(**cc.compiled()())
  reference.compile(**cc.compiled()())
  for m in (model, reference):
    m.layers[0].trainable = False
  helpers.assert_close(pipe.predict(x, verbose=0), reference.predict(x, verbose=0))
  helpers.assert_close(pipe.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0))
  with pytest.raises(ValueError, match=r"layer '\w+' changed `trainable` since `compile`"):
    pipe.fit(x, y, batch_size=16, verbose=0)
  pipe.compile(**cc.compiled()())
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    reference.compile(**cc.compiled()())
  pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  for a, b in zip(model.get_weights(), reference.get_weights()):
    assert np.allclose(a, b, atol=2e-5)


def test_micro_batch_statistics_warn_or_refuse():
  x, y = cc.data()
  with pytest.warns(UserWarning, match=r"BatchNormalization .* per micro-batch"):
    pipe = _pipeline(cc.with_batch_norm(), "gpipe", 2)
  pipe.compile(**cc.compiled()())
  pipe.fit(x, y, batch_size=16, verbose=0)
  with pytest.raises(ValueError, match=r"BatchNormalization .* per micro-batch"):
    _pipeline(cc.with_batch_norm(), "gpipe", 2, batch_statistics="refuse")
  # M = 1 and sequential: the mini-batch's statistics, as Keras.
  case = cc.Case("bn", "bn", model=cc.with_batch_norm)
  expected = _run_keras(case)
  for method, m in (cc.SEQUENTIAL, cc.GPIPE_1):
    assert_same(expected, _run_pipeline(case, method, m), 2e-5)


def _embedding_model(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(5, 8),
                           keras.layers.GlobalAveragePooling1D(),
                           keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def test_embedding_adam_same_as_keras_on_sequential_and_gpipe():
  rng = np.random.default_rng(0)
  case = cc.Case("embedding", "embedding", model=_embedding_model,
                 data=lambda: (rng.integers(0, 5, (64, 6)).astype("int32"),
                               rng.integers(0, 3, 64)),
                 compile=cc.compiled(optimizer=lambda: keras.optimizers.Adam(0.01)))
  data = case.data()
  case.data = lambda: data
  expected = _run_keras(case)
  assert_same(expected, _run_pipeline(case, *cc.SEQUENTIAL), 2e-5)
  # The micro-batches' rows kept (summed dense they differed by 7.2e-2).
  assert_same(expected, _run_pipeline(case, *cc.GPIPE_1), 2e-5)


def _hub_model(backbone):
  tokens = backbone.inputs
  sequence = backbone.output
  if isinstance(sequence, dict):   # BERT: {"sequence_output", "pooled_output"}
    sequence = sequence["sequence_output"]
  pooled = keras.layers.GlobalAveragePooling1D()(sequence)
  return keras.Model(tokens, keras.layers.Dense(3, name="head")(pooled), name="hub")


def _llama(seed=0):
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(seed)
  return _hub_model(keras_hub.models.LlamaBackbone(
      vocabulary_size=32, num_layers=2, num_query_heads=2, num_key_value_heads=1,
      hidden_dim=16, intermediate_dim=32, max_sequence_length=8))


def _bert(seed=0):
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(seed)
  return _hub_model(keras_hub.models.BertBackbone(
      vocabulary_size=32, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
      max_sequence_length=8, dropout=0.0))


def _token_data(names):
  rng = np.random.default_rng(2)
  x = {"token_ids": rng.integers(1, 32, (32, 8)).astype("int32"),
       "padding_mask": np.ones((32, 8), "int32")}
  if "segment_ids" in names:
    x["segment_ids"] = np.zeros((32, 8), "int32")
  return x, rng.integers(0, 3, 32)


@pytest.mark.parametrize("build", [_llama, _bert], ids=["llama", "bert"])
def test_keras_hub_backbone_same_as_keras(build):
  names = [t.name for t in build().inputs]
  case = cc.Case("hub", "hub", model=build, data=lambda: _token_data(names),
                 compile=cc.compiled(optimizer=lambda: keras.optimizers.Adam(1e-3)),
                 fit=lambda x, y: {"batch_size": 8})
  assert_same(_run_keras(case), _run_pipeline(case, *cc.SEQUENTIAL), 5e-5)


def test_pipemare_trains_with_adam_and_says_rescheduling_is_off():
  x, y = cc.data()
  pipe = tfpipe.Pipeline(cc.mlp(), num_stages=2, method="pipemare")
  pipe.compile(**cc.compiled(optimizer=lambda: keras.optimizers.Adam(0.01))())
  history = pipe.fit(x, y, batch_size=16, epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert pipe.options.lr_rescheduling == 0 and "lr_rescheduling" not in pipe.describe()
  sgd = tfpipe.Pipeline(cc.mlp(), num_stages=2, method="pipemare")
  sgd.compile(**cc.compiled(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))())
  assert "lr_rescheduling=500" in sgd.describe()


def test_xla_stages_report_every_stage_regularisation():
  case = next(c for c in cc.CASES if c.name == "regularisation_losses")
  expected = _run_keras(case)
  x, y = case.data()
  model = case.model()
  pipe = _pipeline(model, "sequential", 1, jit_compile=True)
  pipe.compile(**case.compile())
  batch_losses = []   # the running loss in the batch hooks: the XLA task's own logs
  record = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda b, logs: batch_losses.append(logs["loss"]))
  history = pipe.fit(x, y, callbacks=[record], **_fit_args(case, x, y))
  logs = pipe.evaluate(x, y, verbose=0, return_dict=True)
  for key in ("loss", "val_loss"):
    assert _close(expected[1][key], history.history[key], 1e-4), key
  per_epoch = len(batch_losses) // len(history.history["loss"])
  assert _close(batch_losses[per_epoch - 1::per_epoch], expected[1]["loss"], 1e-4)
  assert _close(expected[2]["loss"], logs["loss"], 1e-4)


def test_lambda_callback_batch_hooks_see_keras_batch_logs():
  x, y = cc.data()
  seen = {}
  for where, make in (("keras", lambda m: m), ("pipe", lambda m: _pipeline(m, "sequential", 1))):
    trainer = make(cc.mlp())
    trainer.compile(**cc.compiled()())
    out = seen.setdefault(where, [])
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda b, logs, out=out: out.append(
                        (b, logs["loss"], logs["accuracy"])))])
  assert len(seen["keras"]) == 8
  assert [b for b, _, _ in seen["pipe"]] == [b for b, _, _ in seen["keras"]]
  assert _close([v[1:] for v in seen["pipe"]], [v[1:] for v in seen["keras"]], 2e-5)


@pytest.mark.parametrize("pipeline", [cc.THREADED_ZBV],
                         ids=lambda p: f"{p[0]}{p[1]}{'-threaded' if len(p) > 2 else ''}")
def test_loss_scaling_skips_keras_steps_and_ends_on_keras_scale(pipeline):
  case = next(c for c in cc.CASES if c.name == "loss_scale_optimizer")
  x, y = case.data()
  model = case.model()
  model.compile(**case.compile())
  model.fit(x, y, **_fit_args(case, x, y))
  pipe_model = case.model()
  pipe = _pipeline(pipe_model, *pipeline[:2], **(pipeline[2] if len(pipeline) > 2 else {}))
  pipe.compile(**case.compile())
  pipe.fit(x, y, **_fit_args(case, x, y))
  steps = int(model.optimizer.iterations.numpy())
  assert 0 < steps < 8   # some of the 8 steps were skipped (the check can fail)
  assert [int(p.optimizer.iterations.numpy()) for p in pipe.programs] == [steps] * len(
      pipe.programs)
  assert pipe.loss_scale == float(model.optimizer.dynamic_scale.numpy())
