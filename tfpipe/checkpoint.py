"""Checkpoint and exact resume of a `Pipeline` (`tf.train.Checkpoint` / `CheckpointManager`).

A pipeline drains at the end of every epoch (no batch is in flight, no
weight stash or prediction is kept), so a checkpoint at an epoch boundary
holds everything training needs: every stage's weights and non-trainable
state, its optimizer's slots and step counter (and PipeMare's average
weight change), the learning rate in force (what callbacks set on
`model.optimizer`), and the number of epochs done (the data position);
gradient accumulators are empty then. On resume `fit` starts at that epoch
and replays the data order: a dataset shuffled with a seed and
`reshuffle_each_iteration` gets the same order as in an uninterrupted
run (one unread iterator per skipped epoch advances its shuffle; TensorFlow
combines the dataset's seed with the global one, so set the same global
seed, e.g. `keras.utils.set_random_seed`, as the trainer does), and a
persistent iterator (`steps_per_epoch`) is advanced past the batches
already trained. A run stopped and resumed therefore equals an
uninterrupted one, for every method.

TensorFlow writes a checkpoint's files first and records it as the latest
only once they are complete: a write that fails or is cut short leaves the
previous checkpoint as the one `restore` reads.
"""

import os
import shutil

import keras
import tensorflow as tf

from tfpipe import learning_rate

__all__ = ["BackupAndRestore"]


class BackupAndRestore(keras.callbacks.Callback):
  """Saves a `Pipeline` every `every_epochs` epochs and resumes `fit` from the latest save.

  Pass it in `Pipeline.fit(callbacks=[...])`, like Keras's own
  `keras.callbacks.BackupAndRestore` for `model.fit`: the first `fit`
  with an empty `directory` starts at epoch 0; a later one (a new process,
  a new Pipeline over the same model architecture) restores the latest
  checkpoint and continues from the epoch after it.
  """

  def __init__(self, directory, every_epochs=1, max_to_keep=2, delete_at_end=False):
    """`delete_at_end`: remove `directory` when a `fit` finishes (Keras's
    `delete_checkpoint`); an interrupted one leaves it for the next run."""
    super().__init__()
    self.delete_at_end = delete_at_end
    if not directory:
      raise ValueError("`directory` must name the checkpoint directory")
    if not isinstance(every_epochs, int) or isinstance(every_epochs, bool) or every_epochs < 1:
      raise ValueError(f"`every_epochs` must be a positive integer. Received: {every_epochs!r}")
    self.directory, self.every_epochs, self.max_to_keep = directory, every_epochs, max_to_keep
    self.pipeline = self.manager = None
    self.restored_epoch = None

  def attach(self, pipeline):
    """Binds the callback to the pipeline whose state it saves (called by `Pipeline.fit`)."""
    if self.pipeline is pipeline:
      return
    self.pipeline = pipeline
    with tf.device("/cpu:0"):
      self._epochs = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
      # The rate `model.optimizer` holds (a callback may have just set it, before the stages
      # take it at the end of the hook): restored into it, so a reduced rate stays reduced.
      self._rate = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="learning_rate")
    stages = {}
    for k, program in enumerate(pipeline.programs):
      # deltas: PipeMare's average weight change (empty for other methods).
      stages[f"stage{k}"] = tf.train.Checkpoint(
          weights=list(program.trainable), state=list(program.non_trainable),
          optimizer=list(program.optimizer.variables), deltas=list(program.deltas))
    self._checkpoint = tf.train.Checkpoint(epochs_done=self._epochs, learning_rate=self._rate,
                                           **stages)
    self.manager = tf.train.CheckpointManager(self._checkpoint, self.directory,
                                              max_to_keep=self.max_to_keep)

  def restore(self):
    """Restores the latest checkpoint, if any, into the pipeline; returns the epochs done."""
    latest = self.manager.latest_checkpoint
    if latest is None:
      self.restored_epoch = 0
      return 0
    self._checkpoint.restore(latest).assert_existing_objects_matched()
    self.restored_epoch = int(self._epochs.numpy())
    if float(self._rate.numpy()) >= 0 and not self._schedule():
      self.pipeline.optimizer.learning_rate = float(self._rate.numpy())
    return self.restored_epoch

  def save(self, epochs_done):
    """Writes a checkpoint after `epochs_done` epochs; returns its path."""
    self._epochs.assign(epochs_done)
    if not self._schedule():
      self._rate.assign(float(self.pipeline.optimizer.learning_rate))
    return self.manager.save(checkpoint_number=epochs_done)

  def _schedule(self):
    return learning_rate.is_schedule(self.pipeline.optimizer)

  def on_epoch_end(self, epoch, logs=None):
    if self.pipeline is not None and (epoch + 1) % self.every_epochs == 0:
      self.save(epoch + 1)

  def on_train_end(self, logs=None):
    if self.delete_at_end and os.path.isdir(self.directory):
      shutil.rmtree(self.directory)

  @classmethod
  def from_keras(cls, callback):
    """tfpipe's callback in place of a `keras.callbacks.BackupAndRestore` (same directory,
    a save at every epoch end, deleted after a finished fit if Keras's would be)."""
    if callback.save_freq != "epoch":
      raise ValueError(
          f"keras.callbacks.BackupAndRestore(save_freq={callback.save_freq!r}) saves within "
          "epochs; tfpipe saves at epoch ends, where the pipeline drains: use save_freq='epoch' "
          "(or tfpipe.checkpoint.BackupAndRestore(directory, every_epochs=N))")
    return cls(callback.backup_dir, every_epochs=1, delete_at_end=callback.delete_checkpoint)

  @property
  def latest(self):
    """Path of the latest complete checkpoint, or None."""
    return tf.train.latest_checkpoint(self.directory) if os.path.isdir(self.directory) else None
