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

A checkpoint names its values after the user's model (`layout_state`): each
weight by its variable's path, each optimizer slot by its weight's path and
the slot's name. So it resumes under another number of stages, another
method, data parallelism or none, and in the plain Keras model compiled with
the same optimizer (`restore_keras`): for the synchronous methods the
resumed run equals the uninterrupted one.

TensorFlow writes a checkpoint's files first and records it as the latest
only once they are complete: a write that fails or is cut short leaves the
previous checkpoint as the one `restore` reads, and its temporary directory
(`ckpt-N_temp`) is removed. Progress is never thrown away silently: a
damaged state file (`checkpoint`) or latest checkpoint falls back to the
newest intact checkpoint with a warning naming both; a directory whose
checkpoints are all damaged is refused (`CheckpointError`), never restarted
from scratch; an epoch whose loss is not finite is not saved.
"""

import math
import os
import re
import shutil
import warnings

import keras
import tensorflow as tf

from tfpipe.training import layout_state, learning_rate

__all__ = ["BackupAndRestore", "CheckpointError", "intact_checkpoints", "restore_keras"]

_STATE = "checkpoint"   # TensorFlow's state file: the latest checkpoint and the ones kept


class CheckpointError(ValueError):
  """A checkpoint directory holds checkpoints, none of which can be restored."""


def intact_checkpoints(directory, prefix="ckpt"):
  """Paths of the checkpoints in `directory` whose index and data files are all there, newest
  (highest number) first. Their content is checked only by restoring them."""
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = re.fullmatch(re.escape(prefix) + r"-(\d+)\.index", name)
    if not match:
      continue
    path = os.path.join(directory, name[:-len(".index")])
    shards = [n for n in os.listdir(directory)
              if n.startswith(os.path.basename(path) + ".data-")]
    total = re.search(r"-of-(\d+)$", shards[0]) if shards else None
    if total and len(shards) == int(total.group(1)):
      found.append((int(match.group(1)), path))
  return [path for _, path in sorted(found, reverse=True)]


def _read_state(directory):
  """(latest path the state file names, or None; what is wrong with the state file, or None)."""
  path = os.path.join(directory, _STATE)
  if not os.path.exists(path):
    return None, f"{path} is missing"
  try:
    state = tf.train.get_checkpoint_state(directory)
  except (ValueError, tf.errors.OpError) as e:   # binary garbage: a decode error
    return None, f"{path} cannot be read ({type(e).__name__})"
  if state is None or not state.model_checkpoint_path:
    return None, f"{path} names no checkpoint (damaged)"
  latest = state.model_checkpoint_path
  if not os.path.isabs(latest):
    latest = os.path.join(directory, latest)
  if not os.path.exists(latest + ".index"):
    return None, f"{path} names {latest}, which is not there"
  return latest, None


class BackupAndRestore(keras.callbacks.Callback):
  """Saves a `Pipeline` every `every_epochs` epochs and resumes `fit` from the latest save.

  Pass it in `Pipeline.fit(callbacks=[...])`, like Keras's own
  `keras.callbacks.BackupAndRestore` for `model.fit`: the first `fit`
  with an empty `directory` starts at epoch 0; a later one (a new process,
  a new Pipeline over the same model architecture) restores the latest
  checkpoint and continues from the epoch after it.
  """
  reads_weights = False   # it saves the stages' own variables, not the Keras model's

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
    self._programs = []
    self.restored_epoch = self.restored_path = self.restored_rate = None

  def attach(self, pipeline):
    """Binds the callback to the pipeline whose state it saves (called by `Pipeline.fit`)."""
    if self.pipeline is pipeline and self._programs == [id(p) for p in pipeline.programs]:
      return
    # A pipeline compiled again (after a restart: new stage variables) is bound again.
    self.pipeline, self._programs = pipeline, [id(p) for p in pipeline.programs]
    with tf.device("/cpu:0"):
      self._epochs = tf.Variable(0, dtype=tf.int64, trainable=False, name="epochs_done")
      # The rate `model.optimizer` holds (a callback may have just set it, before the stages
      # take it at the end of the hook): restored into it, so a reduced rate stays reduced.
      self._rate = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="learning_rate")
    # Keyed by the model, not the layout (`layout_state`): another K, another method or the
    # Keras model itself restores it.
    self._state = layout_state.StageState(pipeline.model, pipeline.programs)
    self._checkpoint = tf.train.Checkpoint(**self._required(), method=self._state.method)
    self._remove_temporaries()
    self._state_problem = None
    intact = intact_checkpoints(self.directory)
    if intact:
      latest, self._state_problem = _read_state(self.directory)
      if self._state_problem:   # rewritten from the files, so the manager keeps counting them
        self._write_state(intact)
    self.manager = tf.train.CheckpointManager(self._checkpoint, self.directory,
                                              max_to_keep=self.max_to_keep)

  def _write_state(self, paths):
    """The state file (TensorFlow's `CheckpointState` text format) naming `paths` (newest
    first) as the checkpoints kept, each with its files' time, so the manager counts them
    against `max_to_keep` again; written whole or not at all."""
    kept = list(reversed(paths[:max(self.max_to_keep or len(paths), 1)]))
    lines = [f'model_checkpoint_path: "{os.path.basename(kept[-1])}"']
    lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in kept]
    lines += [f"all_model_checkpoint_timestamps: {os.path.getmtime(p + '.index')!r}"
              for p in kept]
    partial = os.path.join(self.directory, _STATE + ".tfpipe-tmp")
    with open(partial, "w") as f:
      f.write("\n".join(lines) + "\n")
    os.replace(partial, os.path.join(self.directory, _STATE))

  def _remove_temporaries(self):
    """Removes the temporary directories of saves that did not finish (`ckpt-N_temp`)."""
    if os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        path = os.path.join(self.directory, name)
        if name.endswith("_temp") and os.path.isdir(path):
          shutil.rmtree(path, ignore_errors=True)

  def restore(self):
    """Restores the newest intact checkpoint, if any, into the pipeline; returns the epochs
    done. Falls back past damaged ones with a warning naming them; refuses
    (`CheckpointError`) when none of the directory's checkpoints can be restored."""
    intact = intact_checkpoints(self.directory)
    if not intact:
      self.restored_epoch = 0
      return 0
    latest = self.manager.latest_checkpoint
    order = ([latest] if latest in intact else []) + [p for p in intact if p != latest]
    damaged = []
    for path in order:
      try:
        _restore(path, self._required(), self._state.method)
        break
      except Exception as e:  # pylint: disable=broad-except  (a damaged file fails in many ways)
        damaged.append((path, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    else:
      raise CheckpointError(
          f"no checkpoint in {self.directory} can be restored: " + "; ".join(
              f"{p}: {why}" for p, why in damaged) + ". Move the directory away (or pass "
          "another one) to start from scratch")
    problems = ([self._state_problem] if self._state_problem else []) + [
        f"{p} is damaged ({why})" for p, why in damaged]
    if problems:
      warnings.warn(f"{'; '.join(problems)}: resuming from {path}, the newest intact "
                    "checkpoint", UserWarning, stacklevel=2)
      self._write_state(intact[intact.index(path):])
      self.manager = tf.train.CheckpointManager(self._checkpoint, self.directory,
                                                max_to_keep=self.max_to_keep)
    self._state.fill_copies()   # other stages' copies of a tied weight
    for program in self.pipeline.programs:   # replicas' own copies follow the restored weights
      program.sync_replicas()
    self.restored_path = path
    self.restored_epoch = int(self._epochs.numpy())
    self.restored_rate = float(self._rate.numpy()) if float(self._rate.numpy()) >= 0 else None
    if self.restored_rate is not None and not self._schedule():
      self.pipeline.optimizer.learning_rate = self.restored_rate
    return self.restored_epoch

  def _required(self):
    """What every layout has: the data position, the rate, weights, slots and counters."""
    return dict(epochs_done=self._epochs, learning_rate=self._rate,
                weights=self._state.weights, slots=self._state.slots,
                optimizer=self._state.optimizer)

  def save(self, epochs_done):
    """Writes a checkpoint after `epochs_done` epochs; returns its path. A save that fails
    leaves no temporary directory behind."""
    self._epochs.assign(epochs_done)
    if not self._schedule():
      self._rate.assign(float(self.pipeline.optimizer.learning_rate))
    try:
      return self.manager.save(checkpoint_number=epochs_done)
    except BaseException:
      self._remove_temporaries()
      raise

  def _schedule(self):
    return learning_rate.is_schedule(self.pipeline.optimizer)

  def on_epoch_end(self, epoch, logs=None):
    if self.pipeline is None or (epoch + 1) % self.every_epochs:
      return
    loss = (logs or {}).get("loss")
    if loss is not None and not math.isfinite(float(loss)):
      warnings.warn(f"epoch {epoch + 1} ended with loss {loss}: not saved (the last "
                    f"checkpoint, {self.manager.latest_checkpoint}, is kept)", UserWarning,
                    stacklevel=2)
      return
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


def _restore(path, required, method):
  """Restores `required` (each must be in the checkpoint: a weight or slot it lacks is another
  model or optimizer) and what of `method` the checkpoint holds (state only some methods
  keep, such as PipeMare's average weight change, starts from zero under another method)."""
  tf.train.Checkpoint(**required).restore(path).assert_existing_objects_matched()
  if method:
    tf.train.Checkpoint(method=method).restore(path).expect_partial()


def restore_keras(model, directory):
  """Restores the newest intact checkpoint a pipeline wrote in `directory` into the plain
  Keras `model`, compiled with the optimizer the pipeline was: its weights, the optimizer's
  slots and step. Returns the epochs done (pass them to `model.fit(initial_epoch=...)`)."""
  intact = intact_checkpoints(directory)
  if not intact:
    raise CheckpointError(f"no checkpoint in {directory!r}")
  weights, slots, own = layout_state.keras_state(model)
  with tf.device("/cpu:0"):
    epochs = tf.Variable(0, dtype=tf.int64, trainable=False)
    rate = tf.Variable(-1.0, dtype=tf.float64, trainable=False)
  try:
    _restore(intact[0], dict(epochs_done=epochs, learning_rate=rate, weights=weights,
                             slots=slots, optimizer=own), {})
  except AssertionError as e:
    raise CheckpointError(
        f"{intact[0]} does not match model {model.name!r} compiled with "
        f"{type(model.optimizer).__name__}: {str(e).splitlines()[0][:300]}") from None
  if float(rate.numpy()) >= 0 and not learning_rate.is_schedule(model.optimizer):
    model.optimizer.learning_rate = float(rate.numpy())
  return int(epochs.numpy())
