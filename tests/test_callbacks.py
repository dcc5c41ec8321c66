"""The callback protocol is Keras's: the same hooks in the same order, logs, stop_training."""

import keras
import numpy as np
import pytest

from tests import helpers
from tfpipe.training import fit_loop
import tfpipe

LOSS = "sparse_categorical_crossentropy"


def _keras(x, y, epochs=2, callbacks=(), **fit):
  model = helpers.mlp()
  model.compile(keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
  model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
            callbacks=list(callbacks), **fit)
  return model


def _pipe(method="pipedream", K=2, **options):
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=K, method=method, **options)
  optimizer = (tfpipe.optimizers.SpecTrain(0.05, 0.9) if method == "spectrain"
               else keras.optimizers.SGD(0.05, momentum=0.9))
  pipe.compile(optimizer, LOSS, metrics=["accuracy"])
  return pipe


@pytest.mark.parametrize("method", ["sequential", "pipedream", "gpipe"])
def test_fit_sends_the_hooks_keras_fit_sends(method):
  x, y = helpers.as_arrays(helpers.batches(5))
  expected, got = helpers.Recorder(), helpers.Recorder()
  _keras(x, y, callbacks=[expected], validation_data=(x[:40], y[:40]))
  pipe = _pipe(method)
  pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[got],
           validation_data=(x[:40], y[:40]))
  assert got.calls == expected.calls
  assert ("on_test_batch_end", 2) in got.calls   # 40 samples: 3 validation batches
  for name, logs, keras_logs in zip(got.calls, got.logs, expected.logs):
    assert set(logs) - {"samples_per_second"} == set(keras_logs), name
  if method == "sequential":   # staleness-free: the running loss and accuracy are Keras's
    for logs, keras_logs in zip(got.logs, expected.logs):
      for key, value in keras_logs.items():
        assert logs[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_evaluate_and_predict_send_the_test_and_predict_hooks():
  x, y = helpers.as_arrays(helpers.batches(3))
  model = _keras(x, y, epochs=1)
  pipe = tfpipe.Pipeline(model, num_stages=2, method="pipedream")
  pipe.compile(keras.optimizers.SGD(0.05), LOSS, metrics=["accuracy"])
  for run in (lambda m, cb: m.evaluate(x, y, batch_size=16, verbose=0, callbacks=[cb]),
              lambda m, cb: m.predict(x, batch_size=20, verbose=0, callbacks=[cb])):
    expected, got = helpers.Recorder(), helpers.Recorder()
    run(model, expected)
    run(pipe, got)
    assert got.calls == expected.calls
    assert [set(logs) for logs in got.logs] == [set(logs) for logs in expected.logs]


class StopAt(keras.callbacks.Callback):

  def __init__(self, batch):
    super().__init__()
    self.batch = batch

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.batch:
      self.model.stop_training = True


@pytest.mark.parametrize("method,K", [("sequential", 2), ("pipedream", 3), ("spectrain", 3),
                                      ("gpipe", 2), ("ddg", 3)])
def test_stop_training_in_a_batch_hook_stops_after_that_batch(method, K):
  x, y = helpers.as_arrays(helpers.batches(12))
  expected, got = helpers.Recorder(), helpers.Recorder()
  keras_model = _keras(x, y, epochs=3, callbacks=[StopAt(2), expected])
  pipe = _pipe(method, K, **({"micro_batches": 2} if method == "gpipe" else {}))
  history = pipe.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                     callbacks=[StopAt(2), got])
  assert got.calls == expected.calls   # ... batch_end 2, epoch_end 0, train_end
  assert len(history.history["loss"]) == 1
  # Exactly the L-1 batches due drain (L = K for 1F1B and DDG, 1 for sequential and GPipe),
  # whatever the timing: every stage applied 3 + L - 1 updates.
  lead = 1 if method in ("sequential", "gpipe") else K
  assert [int(p.optimizer.iterations.numpy()) for p in pipe.programs] == [3 + lead - 1] * K
  if lead == 1:   # nothing in flight: exactly Keras's training
    helpers.assert_weights_close(pipe.model.get_weights(), keras_model.get_weights(), rtol=1e-4,
                                 atol=1e-5)


def test_terminate_on_nan_stops_at_the_first_nan_batch():
  x, y = helpers.as_arrays(helpers.batches(10))
  x[16 * 4] = np.nan   # batch 4 is NaN
  expected, got = helpers.Recorder(), helpers.Recorder()
  _keras(x, y, epochs=2, callbacks=[keras.callbacks.TerminateOnNaN(), expected])
  pipe = _pipe("pipedream", 3)
  history = pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                     callbacks=[keras.callbacks.TerminateOnNaN(), got])
  assert got.calls == expected.calls
  assert got.calls[-3] == ("on_train_batch_end", 4)
  assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])


def test_early_stopping_finds_the_direction_of_a_compiled_metric():
  # mode="auto" asks the model's metrics whether "accuracy" should rise: the user's model was
  # never compiled, the pipeline's metrics stand in during fit and are gone after.
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe = _pipe()
  stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=1)
  pipe.fit(x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x, y), callbacks=[stop])
  assert stop.monitor_op is not None and stop.min_delta >= 0   # "up": maximise
  assert pipe.model.metrics == [] and not hasattr(pipe.model, "optimizer")


class _Blind(keras.callbacks.Callback):
  reads_weights = False


@pytest.mark.parametrize("callback, reads", [
    (keras.callbacks.History(), False),
    (keras.callbacks.ProgbarLogger(), False),
    (keras.callbacks.ReduceLROnPlateau(), False),
    (keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate), False),
    (keras.callbacks.EarlyStopping(), False),
    (keras.callbacks.EarlyStopping(restore_best_weights=True), True),
    (keras.callbacks.LambdaCallback(), True),
    (keras.callbacks.Callback(), True),
    (_Blind(), False),
    (tfpipe.checkpoint.BackupAndRestore("unused"), False),
])
def test_callbacks_that_may_read_the_model_weights_are_told_apart(callback, reads):
  # With stages on TF servers, only these bring the weights to the client at epoch ends.
  assert fit_loop.reads_weights(callback) is reads
