"""Checkpoint and exact resume: stopped and resumed equals uninterrupted; a failed write is
never the latest."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.rules import optimizers
from tfpipe.training import checkpoint
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
    helpers.assert_close(a, b, rtol=1e-6)
  # The optimizer's step counter and slots came back too.
  for p, q in zip(second.programs, whole.programs):
    for a, b in zip(p.optimizer.variables, q.optimizer.variables):
      helpers.assert_close(a.numpy(), b.numpy(), rtol=1e-6)


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
    helpers.assert_close(a, b, rtol=1e-6)


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


class _Weights(keras.callbacks.Callback):
  """The stages' weights at every epoch end."""

  def __init__(self, pipe):
    super().__init__()
    self.pipe, self.epochs = pipe, []

  def on_epoch_end(self, epoch, logs=None):
    self.epochs.append([v.numpy() for p in self.pipe.programs for v in p.trainable])


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
  """A directory holding ckpt-1, ckpt-2, ckpt-3 of a sequential pipeline, and each epoch's
  weights."""
  directory = tmp_path_factory.mktemp("three")
  pipe = _pipeline("sequential", 0)
  weights = _Weights(pipe)
  pipe.fit(*_data(), batch_size=16, epochs=3, verbose=0,
           callbacks=[weights, checkpoint.BackupAndRestore(str(directory), max_to_keep=3)])
  return directory, weights.epochs


def _copy(three_checkpoints, tmp_path):
  import shutil
  source, weights = three_checkpoints
  shutil.copytree(source, tmp_path / "ckpt")
  return tmp_path / "ckpt", weights


def _restore(directory):
  pipe = _pipeline("sequential", 7)
  saver = checkpoint.BackupAndRestore(str(directory), max_to_keep=3)
  saver.attach(pipe)
  return pipe, saver, saver.restore()


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(max(1, len(f.read()) // 2))


def _damage(directory, how):
  state = directory / "checkpoint"
  if how == "state_text":
    state.write_text("this is not a checkpoint state\n{]")
  elif how == "state_binary":
    state.write_bytes(b"\xff\xfe\x00\x81garbage\x00")
  elif how == "state_deleted":
    state.unlink()
  elif how == "state_points_elsewhere":
    state.write_text('model_checkpoint_path: "ckpt-9"\nall_model_checkpoint_paths: "ckpt-9"\n')
  elif how == "data_truncated":
    _truncate(next(directory.glob("ckpt-3.data-*")))
  elif how == "index_truncated":
    _truncate(directory / "ckpt-3.index")


@pytest.mark.parametrize("how, problem, epoch", [
    ("state_text", "names no checkpoint", 3),
    ("state_binary", "cannot be read", 3),
    ("state_deleted", "is missing", 3),
    ("state_points_elsewhere", "which is not there", 3),
    ("data_truncated", "ckpt-3 is damaged", 2),
    ("index_truncated", "ckpt-3 is damaged", 2),
])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one_with_a_warning(
    three_checkpoints, tmp_path, how, problem, epoch):
  directory, weights = _copy(three_checkpoints, tmp_path)
  _damage(directory, how)
  with pytest.warns(UserWarning, match=problem) as caught:
    pipe, saver, done = _restore(directory)
  assert done == epoch
  assert f"resuming from {directory / f'ckpt-{epoch}'}" in str(caught[0].message)
  for a, b in zip([v.numpy() for p in pipe.programs for v in p.trainable], weights[epoch - 1]):
    np.testing.assert_array_equal(a, b)
  # The state is rewritten: the next saves count from there and keep the intact ones.
  saver.save(epoch + 1)
  assert saver.manager.latest_checkpoint == str(directory / f"ckpt-{epoch + 1}")
  assert [int(p.rsplit("-", 1)[1]) for p in saver.manager.checkpoints] == list(
      range(epoch - 1, epoch + 2))


def test_a_directory_whose_checkpoints_are_all_damaged_is_refused_not_restarted(
    three_checkpoints, tmp_path):
  directory, _ = _copy(three_checkpoints, tmp_path)
  for data in directory.glob("ckpt-*.data-*"):
    _truncate(data)
  with pytest.raises(checkpoint.CheckpointError, match=r"no checkpoint in .* can be restored: "
                     r".*ckpt-3: .*ckpt-2: .*ckpt-1: .*Move the directory away"):
    _restore(directory)
  assert len(list(directory.glob("ckpt-*.index"))) == 3   # nothing deleted


def test_temporary_directories_of_unfinished_saves_are_removed(three_checkpoints, tmp_path):
  directory, _ = _copy(three_checkpoints, tmp_path)
  (directory / "ckpt-4_temp").mkdir()
  (directory / "ckpt-4_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x" * 64)
  _, _, done = _restore(directory)
  assert done == 3 and not (directory / "ckpt-4_temp").exists()


class _Poison(keras.callbacks.Callback):
  """Makes stage 0's first weight NaN when epoch `epoch` begins (after any restore)."""

  def __init__(self, pipe, epoch):
    super().__init__()
    self.pipe, self.epoch = pipe, epoch

  def on_epoch_begin(self, epoch, logs=None):
    if epoch == self.epoch:
      weight = self.pipe.programs[0].trainable[0]
      weight.assign(np.full(weight.shape, np.nan, weight.dtype))


def test_an_epoch_with_a_non_finite_loss_is_not_saved(tmp_path):
  x, y = _data()
  pipe = _pipeline("sequential", 0)
  saver = checkpoint.BackupAndRestore(str(tmp_path))
  with pytest.warns(UserWarning, match=r"epoch 2 ended with loss nan: not saved .*ckpt-1"):
    pipe.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[_Poison(pipe, 1), saver])
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1")
