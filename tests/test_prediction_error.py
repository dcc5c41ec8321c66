"""Weight-prediction error: zero without learning, prediction beats staleness on a quadratic,
every predicting optimizer's own step."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe.instruments import prediction_error
from tfpipe.rules import optimizers
from tests import helpers


def _quadratic_fit(learning_rate, steps=60):
  # Least squares: a smooth quadratic loss, one batch repeated, so the smoothed gradient
  # changes slowly and extrapolating it should land near where the weights go.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 6)).astype("float32")
  y = (x @ rng.normal(size=(6, 2))).astype("float32")
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
  model.compile(optimizers.SpecTrain(learning_rate, 0.9), "mse")
  recorder = prediction_error.PredictionError()
  model.fit(x, y, batch_size=64, epochs=steps, shuffle=False, verbose=0,
            callbacks=[prediction_error.PredictionErrorCallback(recorder)])
  return recorder


def test_learning_rate_zero_gives_rmse_zero():
  recorder = _quadratic_fit(0.0, steps=8)
  summary = recorder.summary()
  assert set(summary) == {1, 2, 3}
  for predicted, stale in summary.values():
    assert predicted == 0.0 and stale == 0.0
  assert len(recorder.series[("model", 3)]) == 8 - 3


def test_prediction_beats_staleness_on_a_smooth_quadratic(tmp_path):
  recorder = _quadratic_fit(0.05)
  for s, (predicted, stale) in recorder.summary().items():
    assert 0 < predicted < 0.5 * stale, s
  path = recorder.plot(str(tmp_path / "prediction_error.png"))
  assert (tmp_path / "prediction_error.png").stat().st_size > 1000 and path.endswith(".png")
  recorder.write_summaries(str(tmp_path / "tb"))
  assert list((tmp_path / "tb").iterdir())


def test_pipeline_records_per_stage_errors():
  x, y = helpers.as_arrays(helpers.batches(12))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=3, method="spectrain", prediction_error=True)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  series = pipe.prediction_error.series
  assert {key for key, _ in series} == {0, 1, 2}
  assert all(len(series[(k, 1)]) == 12 - 1 for k in range(3))   # one per update after the first
  with pytest.raises(ValueError, match="weight prediction extrapolates the optimizer's step"):
    other = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="vanilla", prediction_error=True)
    other.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  with pytest.raises(ValueError, match="horizons"):
    prediction_error.PredictionError(horizons=(0,))


def _numpy_step(optimizer, variables):
  """Each optimizer's step d, written out from its slots (PipeOptim / XPipe)."""
  weights = [v.numpy() for v in variables]
  if isinstance(optimizer, keras.optimizers.SGD):
    return weights, [-m.numpy() for m in optimizer.momentums]
  t, lr = float(optimizer.iterations.numpy()), float(optimizer.learning_rate.numpy())
  rate = lr * np.sqrt(1 - optimizer.beta_2 ** t) / (1 - optimizer.beta_1 ** t)
  decay = lr * (optimizer.weight_decay or 0.0)
  return weights, [rate * m.numpy() / (np.sqrt(v.numpy()) + optimizer.epsilon) + decay * w
                   for m, v, w in zip(optimizer._momentums, optimizer._velocities, weights)]


@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
], ids=["sgd", "adam", "adamw"])
def test_prediction_error_reads_each_optimizers_own_step(optimizer):
  # The recorded prediction is W_{t-1} - d_{t-1}, d the optimizer's own step: checked against
  # the step written out in numpy from the optimizer's slots after each update.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 4)).astype("float32")
  y = (x @ rng.normal(size=(4, 2))).astype("float32")
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
  model.compile(optimizer(), "mse")
  recorder = prediction_error.PredictionError(horizons=(1,))
  seen = []

  class Steps(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append(_numpy_step(self.model.optimizer, self.model.trainable_variables))

  model.fit(x, y, batch_size=32, epochs=8, shuffle=False, verbose=0,
            callbacks=[prediction_error.PredictionErrorCallback(recorder), Steps()])
  rows = recorder.series[("model", 1)]
  assert len(rows) == len(seen) - 1 == 7
  for (t, predicted, stale), (old_w, old_d), (new_w, _) in zip(rows, seen, seen[1:]):
    error = np.sqrt(np.mean(np.concatenate([((w - d) - n).ravel() ** 2
                                            for w, d, n in zip(old_w, old_d, new_w)])))
    # float32 weights: their round-off (~1e-7) bounds the agreement of the small RMSE
    np.testing.assert_allclose(predicted, error, rtol=1e-3, atol=1e-6)
    assert predicted < 0.5 * stale   # full batches: the optimizer's step points the right way
  with pytest.raises(ValueError, match="prediction error measures weight prediction: weight pr"):
    prediction_error.check(keras.optimizers.SGD(0.1))
