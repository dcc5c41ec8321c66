"""Checkpoint and exact resume: stopped and resumed equals uninterrupted; a failed write is
never the latest."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import checkpoint, optimizers
from tests import helpers


class _StopAfter(keras.callbacks.Callback):
  def __init__(self, epochs):
    super().__init__()
    self.epochs = epochs

  def on_epoch_end(self, epoch, logs=None):
    if epoch + 1 == self.epochs:
      self.model.stop_training = True


def _data():
  rng = np.random.default_rng(1)
  return rng.normal(size=(96, 8)).astype("float32"), rng.integers(0, 3, 96)


def _pipeline(method, seed, **options):
  model = helpers.mlp(seed=seed)
  keras.utils.set_random_seed(0)  # TensorFlow combines the global seed with the data's seed
  pipe = tfpipe.Pipeline(model, num_stages=3, method=method, **options)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  return pipe


def _weights(pipe):
  return [v.numpy() for v in pipe.model.trainable_variables]


@pytest.mark.parametrize("method,options", [("sequential", {}), ("pipedream", {}),
                                            ("spectrain", {}), ("gpipe", {"micro_batches": 2}),
                                            ("pipemare", {"lr_rescheduling": 10})])
def test_stopped_and_resumed_equals_uninterrupted(tmp_path, method, options):
  x, y = _data()
  fit = dict(batch_size=16, epochs=4, shuffle=True, seed=3, verbose=0)
  whole = _pipeline(method, 0, **options)
  whole.fit(x, y, **fit)
  # Stop after 2 epochs; then a new pipeline over a differently initialised model resumes.
  first = _pipeline(method, 0, **options)
  saver = checkpoint.BackupAndRestore(str(tmp_path))
  first.fit(x, y, callbacks=[saver, _StopAfter(2)], **fit)
  assert saver.manager.latest_checkpoint.endswith("ckpt-2")
  second = _pipeline(method, 7, **options)
  resumer = checkpoint.BackupAndRestore(str(tmp_path))
  history = second.fit(x, y, callbacks=[resumer], **fit)
  assert resumer.restored_epoch == 2 and history.epoch == [2, 3]
  for a, b in zip(_weights(second), _weights(whole)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # The optimizer's step counter and slots came back too.
  for p, q in zip(second.programs, whole.programs):
    for a, b in zip(p.optimizer.variables, q.optimizer.variables):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)


def test_resume_with_steps_per_epoch_advances_the_iterator(tmp_path):
  x, y = _data()
  # A fresh dataset for every run, as a new process would build; one iterator runs through
  # all epochs (6 batches per pass, 4 steps per epoch: epochs straddle passes).
  ds = lambda: tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=5).batch(16).repeat()
  fit = dict(epochs=3, steps_per_epoch=4, verbose=0)
  whole = _pipeline("pipedream", 0)
  whole.fit(ds(), **fit)
  first = _pipeline("pipedream", 0)
  first.fit(ds(), callbacks=[checkpoint.BackupAndRestore(str(tmp_path)), _StopAfter(1)], **fit)
  second = _pipeline("pipedream", 7)
  second.fit(ds(), callbacks=[checkpoint.BackupAndRestore(str(tmp_path))], **fit)
  for a, b in zip(_weights(second), _weights(whole)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_failed_write_never_replaces_the_last_good_checkpoint(tmp_path, monkeypatch):
  x, y = _data()
  pipe = _pipeline("sequential", 0)
  saver = checkpoint.BackupAndRestore(str(tmp_path))
  pipe.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[saver])
  good = saver.manager.latest_checkpoint
  saved = [v.numpy() for v in pipe.programs[0].trainable]

  def broken_write(self, prefix, options=None):
    with open(prefix + ".index", "w") as f:   # a half-written file, then the writer dies
      f.write("partial")
    raise OSError("disk full")

  monkeypatch.setattr(tf.train.Checkpoint, "_write", broken_write)
  with pytest.raises(OSError, match="disk full"):
    pipe.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[saver])
  monkeypatch.undo()
  assert tf.train.latest_checkpoint(str(tmp_path)) == good
  fresh = _pipeline("sequential", 7)
  resumer = checkpoint.BackupAndRestore(str(tmp_path))
  resumer.attach(fresh)
  assert resumer.restore() == 1
  for a, b in zip(fresh.programs[0].trainable, saved):
    np.testing.assert_array_equal(a.numpy(), b)


def test_bad_arguments():
  with pytest.raises(ValueError, match="`every_epochs` must be a positive integer"):
    checkpoint.BackupAndRestore("d", every_epochs=0)
  with pytest.raises(ValueError, match="`initial_epoch` must be an integer >= 0"):
    _pipeline("sequential", 0).fit(*_data(), initial_epoch=-1, verbose=0)


def test_a_resumed_run_keeps_the_learning_rate_its_callbacks_set(tmp_path):
  x, y = _data()
  first = _pipeline("pipedream", seed=0)
  halve = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                            min_delta=10.0)
  first.fit(x, y, batch_size=16, epochs=2, verbose=0,
            callbacks=[halve, checkpoint.BackupAndRestore(str(tmp_path))])
  reduced = float(first.programs[0].optimizer.learning_rate)
  assert reduced < 0.05
  second = _pipeline("pipedream", seed=1)
  second.fit(x, y, batch_size=16, epochs=3, verbose=0,
             callbacks=[checkpoint.BackupAndRestore(str(tmp_path))])
  assert float(second.optimizer.learning_rate) == pytest.approx(reduced)
  assert [float(p.optimizer.learning_rate) for p in second.programs] == pytest.approx(
      [reduced] * 3)
