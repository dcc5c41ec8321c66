"""A checkpoint resumes under another layout: another K, another method, data parallelism, or
the plain Keras model; the synchronous methods' resumed runs equal the uninterrupted one."""

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.training import checkpoint, layout_state
from tests import helpers

V, T, N, BATCH = 40, 6, 48, 8
FIT = dict(batch_size=BATCH, epochs=4, shuffle=False, verbose=0)


class _StopAfter(keras.callbacks.Callback):
  def __init__(self, epochs):
    super().__init__()
    self.epochs = epochs

  def on_epoch_end(self, epoch, logs=None):
    if epoch + 1 == self.epochs:
      self.model.stop_training = True


def _lm(seed):
  """A per-token language model: embedding rows, two blocks and a head over the vocabulary."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((T,), dtype="int32")
  h = keras.layers.Embedding(V, 16, name="embed")(tokens)
  h = keras.layers.Dense(16, activation="relu", name="block0")(h)
  h = keras.layers.Dense(16, activation="relu", name="block1")(h)
  return keras.Model(tokens, keras.layers.Dense(V, name="head")(h), name="lm")


def _data():
  rng = np.random.default_rng(3)
  x = rng.integers(0, V, (N, T)).astype("int32")
  return x, np.roll(x, -1, axis=1)


def _compile(target):
  target.compile(keras.optimizers.Adam(0.01),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _pipeline(seed, num_stages, method, **options):
  pipe = tfpipe.Pipeline(_lm(seed), num_stages=num_stages, method=method, **options)
  _compile(pipe)
  return pipe


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """1f1b at K=2 stopped after 2 of 4 epochs (its checkpoint), and the uninterrupted run's
  weights (plain Keras, which every synchronous schedule equals)."""
  directory = str(tmp_path_factory.mktemp("ckpt"))
  x, y = _data()
  first = _pipeline(0, 2, "1f1b", micro_batches=2)
  first.fit(x, y, callbacks=[checkpoint.BackupAndRestore(directory), _StopAfter(2)], **FIT)
  whole = _lm(0)
  _compile(whole)
  whole.fit(x, y, **FIT)
  return directory, [v.numpy() for v in first.model.weights], [v.numpy() for v in whole.weights]


def _copied(written, tmp_path):
  """The written checkpoint in a directory of the test's own (a resumed fit saves there)."""
  directory, weights, expected = written
  shutil.copytree(directory, tmp_path / "ckpt")
  return str(tmp_path / "ckpt"), weights, expected


@pytest.mark.parametrize("num_stages,method,options", [
    (3, "gpipe", {"micro_batches": 2}),
    (2, "zb", {"micro_batches": 4}),
    (2, "1f1b", {"micro_batches": 2, "data_parallel": 2}),
    (1, "sequential", {}),
])
def test_a_checkpoint_resumes_under_another_layout_equal_to_the_uninterrupted_run(
    written, tmp_path, num_stages, method, options):
  directory, _, expected = _copied(written, tmp_path)
  resumed = _pipeline(7, num_stages, method, **options)
  saver = checkpoint.BackupAndRestore(directory)
  history = resumed.fit(*_data(), callbacks=[saver], **FIT)
  assert saver.restored_epoch == 2 and history.epoch == [2, 3]
  for a, b in zip(resumed.model.weights, expected):
    helpers.assert_close(a.numpy(), b, rtol=1e-5)


def test_plain_keras_resumes_a_pipelines_checkpoint_equal_to_the_uninterrupted_run(written):
  directory, _, expected = written
  model = _lm(7)
  _compile(model)
  done = checkpoint.restore_keras(model, directory)
  assert done == 2 and int(model.optimizer.iterations.numpy()) == 2 * N // BATCH
  model.fit(*_data(), initial_epoch=done, **FIT)
  for a, b in zip(model.weights, expected):
    helpers.assert_close(a.numpy(), b, rtol=1e-5)


def test_an_asynchronous_method_resumes_with_the_weights_slots_and_step_written(written,
                                                                                tmp_path):
  directory, weights, _ = _copied(written, tmp_path)
  resumed = _pipeline(7, 4, "spectrain")
  saver = checkpoint.BackupAndRestore(directory)
  history = resumed.fit(*_data(), callbacks=[saver], **dict(FIT, epochs=2))
  assert saver.restored_epoch == 2 and history.epoch == []
  for a, b in zip(resumed.model.weights, weights):
    np.testing.assert_array_equal(a.numpy(), b)
  for program in resumed.programs:
    assert int(program.optimizer.iterations.numpy()) == 2 * N // BATCH


def test_a_checkpoint_of_another_model_is_refused_by_name(written):
  directory, _, _ = written
  other = helpers.mlp()
  _compile(other)
  with pytest.raises(checkpoint.CheckpointError, match="does not match model 'mlp'"):
    checkpoint.restore_keras(other, directory)
  uncompiled = _lm(0)
  with pytest.raises(ValueError, match="compile model 'lm' with its optimizer"):
    checkpoint.restore_keras(uncompiled, directory)


def test_slots_of_like_named_weights_go_to_their_own_weight():
  # Two stage copies named alike (as two layers' "kernel"): each slot is found by the
  # gradient it saw, not by its name alone.
  a = keras.Variable(np.zeros((3, 2), "float32"), name="s0_kernel")
  b = keras.Variable(np.zeros((3, 2), "float32"), name="s0_kernel")
  bias = keras.Variable(np.zeros((2,), "float32"), name="s0_kernel_bias")
  optimizer = keras.optimizers.Adam(0.1)
  optimizer.build([a, b, bias])
  optimizer.apply([tf.zeros((3, 2)), tf.ones((3, 2)), tf.fill((2,), 2.0)], [a, b, bias])
  slots, own = layout_state.slot_keys(optimizer, [("a", a), ("b", b), ("bias", bias)])
  assert sorted(slots) == ["a/momentum", "a/velocity", "b/momentum", "b/velocity",
                           "bias/momentum", "bias/velocity"]
  assert not np.any(slots["a/momentum"].numpy()) and np.all(slots["b/momentum"].numpy() > 0)
  np.testing.assert_allclose(slots["bias/velocity"].numpy(), 0.001 * 4.0, rtol=1e-6)
  assert sorted(own) == ["iteration", "learning_rate"]


def test_a_layer_each_stage_reads_apart_trains_and_checkpoints_as_keras(tmp_path):
  # Its call on stage 0 reads the embedding (rows for Adam, as Keras sees them), its call on
  # stage 1 the kernel: each stage steps what it reads, and the model and the checkpoint
  # take the reader's copy and slots, never the copy the other stage holds unread.
  x, y = _data()
  pipe = tfpipe.Pipeline(helpers.two_way_lm(0, V, T), num_stages=2, method="1f1b", micro_batches=2)
  assert pipe.partition.shared == () and pipe.partition.unread == ((1,), (0,))
  _compile(pipe)
  directory = str(tmp_path / "ckpt")
  pipe.fit(x, y, callbacks=[checkpoint.BackupAndRestore(directory), _StopAfter(2)], **FIT)
  whole = helpers.two_way_lm(0, V, T)
  _compile(whole)
  whole.fit(x, y, **dict(FIT, epochs=2))
  for a, b in zip(pipe.model.weights, whole.weights):
    helpers.assert_close(a.numpy(), b.numpy(), rtol=1e-5)
  whole.fit(x, y, initial_epoch=2, **FIT)
  resumed = helpers.two_way_lm(7, V, T)
  _compile(resumed)
  assert checkpoint.restore_keras(resumed, directory) == 2
  resumed.fit(x, y, initial_epoch=2, **FIT)
  for a, b in zip(resumed.weights, whole.weights):
    helpers.assert_close(a.numpy(), b.numpy(), rtol=1e-5)
