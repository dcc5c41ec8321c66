"""Learning-rate callbacks reach every stage: the same lr trajectory and weights as Keras fit."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
import tfpipe

LR, MOMENTUM = 0.05, 0.9
LOSS = "sparse_categorical_crossentropy"


class LrLog(keras.callbacks.Callback):
  """The rate `model.optimizer` reports at every batch end, and (pipelines) the stages' rates."""

  def __init__(self, pipe=None):
    super().__init__()
    self.pipe, self.rates, self.stage_rates, self.weights = pipe, [], [], []
    self.epoch_rates = []

  def on_train_batch_end(self, batch, logs=None):
    self.rates.append(float(self.model.optimizer.learning_rate))
    if self.pipe is not None:
      self.stage_rates.append([float(p.optimizer.learning_rate) for p in self.pipe.programs])

  def on_epoch_end(self, epoch, logs=None):
    self.weights.append(self.model.get_weights())
    self.epoch_rates.append(float(self.model.optimizer.learning_rate))


def _both(make_callbacks, epochs=4, optimizer=lambda: keras.optimizers.SGD(LR, momentum=MOMENTUM),
          precompiled=False, method="sequential"):
  """Plain Keras fit and a 2-stage pipeline with the same callbacks; their LrLogs and Histories."""
  x, y = helpers.as_arrays(helpers.batches(6))
  expected = helpers.mlp()
  expected.compile(optimizer(), LOSS)
  keras_log = LrLog()
  keras_history = expected.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                               callbacks=make_callbacks() + [keras_log])
  model = helpers.mlp()
  if precompiled:   # compiled earlier by the user, with an optimizer the pipeline does not use
    model.compile(keras.optimizers.Adam(0.3), "mse")
  before = getattr(model, "optimizer", None)
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method)
  pipe.compile(optimizer(), LOSS)
  pipe_log = LrLog(pipe)
  history = pipe.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=make_callbacks() + [pipe_log])
  assert getattr(model, "optimizer", None) is before   # the user's own is back after fit
  return (keras_log, keras_history.history), (pipe_log, history.history), (model, expected)


def _assert_same_trajectory(keras_side, pipe_side, models):
  (keras_log, keras_history), (pipe_log, history) = keras_side, pipe_side
  np.testing.assert_allclose(pipe_log.rates, keras_log.rates, rtol=1e-6)
  for stage_rates, rate in zip(pipe_log.stage_rates, pipe_log.rates):
    np.testing.assert_allclose(stage_rates, [rate, rate], rtol=1e-6)
  if "learning_rate" in keras_history:
    np.testing.assert_allclose(history["learning_rate"], keras_history["learning_rate"], rtol=1e-6)
  helpers.assert_weights_close(models[0].get_weights(), models[1].get_weights())


@pytest.mark.parametrize("precompiled", [False, True])
def test_learning_rate_scheduler_sets_every_stage(precompiled):
  k, p, models = _both(lambda: [keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)],
                       precompiled=precompiled)
  assert k[1]["learning_rate"] == pytest.approx([0.025, 0.0125, 0.00625, 0.003125])
  _assert_same_trajectory(k, p, models)


def test_reduce_lr_on_plateau_sets_every_stage():
  # min_delta=10: never an improvement, so the rate halves after every epoch.
  make = lambda: [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                    min_delta=10.0)]
  k, p, models = _both(make)
  assert k[1]["learning_rate"][-1] < k[1]["learning_rate"][0]   # it did reduce
  _assert_same_trajectory(k, p, models)


class Warmup(keras.callbacks.Callback):
  """A user's callback: sets the rate before every batch."""

  def on_train_batch_begin(self, batch, logs=None):
    self.model.optimizer.learning_rate = 0.01 * (batch + 1)


def test_a_rate_set_in_a_batch_hook_reaches_the_stages():
  # Every stage takes the rate at once (their next update uses it); with batches in flight
  # that update may belong to an earlier batch than in Keras, so weights are not compared.
  (keras_log, _), (pipe_log, _), _ = _both(lambda: [Warmup()], epochs=2, method="pipedream")
  assert keras_log.rates[:3] == pytest.approx([0.01, 0.02, 0.03])
  np.testing.assert_allclose(pipe_log.rates, keras_log.rates, rtol=1e-6)
  for stage_rates, rate in zip(pipe_log.stage_rates, pipe_log.rates):
    np.testing.assert_allclose(stage_rates, [rate, rate], rtol=1e-6)


@pytest.mark.parametrize("method", ["sequential", "pipedream"])
def test_learning_rate_zero_freezes_the_weights(method):
  # SpecTrain's rule w -= lr * v stops at lr 0 (Keras SGD's velocity would carry on).
  make = lambda: [keras.callbacks.LearningRateScheduler(lambda e: LR if e == 0 else 0.0)]
  _, (pipe_log, _), _ = _both(make, epochs=3, method=method,
                              optimizer=lambda: tfpipe.optimizers.SpecTrain(LR, MOMENTUM))
  assert all(r == [0.0, 0.0] for r in pipe_log.stage_rates[6:])
  initial = helpers.mlp().get_weights()
  assert not all(np.array_equal(a, b) for a, b in zip(pipe_log.weights[0], initial))  # trained
  for a, b in zip(pipe_log.weights[0], pipe_log.weights[2]):
    np.testing.assert_array_equal(a, b)


def test_a_schedule_steps_by_each_stage_update_count():
  schedule = lambda: keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=2, decay_rate=0.5)
  k, p, models = _both(lambda: [], optimizer=lambda: keras.optimizers.SGD(schedule(),
                                                                           momentum=MOMENTUM))
  # At epoch ends (the pipeline has drained) the rate read is Keras's. Within an epoch the
  # last stage may already have run the next batch, whose step the schedule then reads.
  np.testing.assert_allclose(p[0].epoch_rates, k[0].epoch_rates, rtol=1e-6)
  assert p[0].epoch_rates[-1] < p[0].epoch_rates[0]
  helpers.assert_weights_close(models[0].get_weights(), models[1].get_weights())


def _scalars(logdir, tag):
  values = []
  for path in sorted(glob.glob(f"{logdir}/train/events.out.tfevents*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.tag == tag:
          values.append(float(tf.make_ndarray(v.tensor)))
  return values


@pytest.mark.parametrize("precompiled", [False, True])
def test_tensorboard_logs_the_rate_in_force_compiled_or_not(tmp_path, precompiled):
  x, y = helpers.as_arrays(helpers.batches(4))
  model = helpers.mlp()
  if precompiled:
    model.compile(keras.optimizers.Adam(0.3), "mse")
  assert hasattr(model, "optimizer") == precompiled
  pipe = tfpipe.Pipeline(model, num_stages=2, method="pipedream")
  pipe.compile(keras.optimizers.SGD(LR), LOSS)
  pipe.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[
      keras.callbacks.LearningRateScheduler(lambda e: [0.05, 0.02, 0.01][e]),
      keras.callbacks.TensorBoard(str(tmp_path), write_graph=False)])
  assert _scalars(tmp_path, "epoch_learning_rate") == pytest.approx([0.05, 0.02, 0.01])
  assert [float(p.optimizer.learning_rate) for p in pipe.programs] == pytest.approx([0.01, 0.01])


class AssignRate(keras.callbacks.Callback):
  """Assigns the rate variable itself (not the optimizer's setter) at epoch 1."""

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == 1:
      self.model.optimizer.learning_rate.assign(0.0)


def test_assigning_the_rate_variable_reaches_the_stages_and_fit_leaves_no_trace():
  (keras_log, _), (pipe_log, _), models = _both(lambda: [AssignRate()], epochs=2)
  np.testing.assert_allclose(pipe_log.rates, keras_log.rates)
  assert pipe_log.stage_rates[-1] == [0.0, 0.0]
  helpers.assert_weights_close(models[0].get_weights(), models[1].get_weights())
  pipe = pipe_log.pipe
  assert not {"assign", "assign_add", "assign_sub"} & set(vars(pipe.optimizer._learning_rate))
