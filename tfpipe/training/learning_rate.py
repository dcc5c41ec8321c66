"""What Keras callbacks see: one learning rate that drives every stage's optimizer.

K: stages. Each stage trains with its own optimizer (its own slots and step
counter), cloned from the one given to `Pipeline.compile`. Keras callbacks
(`LearningRateScheduler`, `ReduceLROnPlateau`, `TensorBoard`, a user's) read
and write `model.optimizer.learning_rate`. During `fit`, `evaluate` and
`predict`, `model.optimizer` is the compiled optimizer (the driver); after
every callback hook the pipeline pushes its learning rate to the K stage
optimizers, so a rate set in a hook is the one every stage uses from its
next update on, and reading it gives the rate in force. The pipeline drains
at epoch ends, so a rate set in an epoch hook (`LearningRateScheduler`,
`ReduceLROnPlateau`) governs exactly the next epoch's updates, as in Keras; a
rate set in a batch hook reaches each stage's next update, which for the up
to K batches already in flight may be later than in Keras.

A `keras.optimizers.schedules.LearningRateSchedule` keeps working: each stage
steps it by its own update count, and the driver's `iterations` follow the
last stage's, so reading the driver's rate gives the last stage's. Setting
the rate of a schedule raises Keras's own TypeError, as in `model.fit`.
"""

import keras
import numpy as np

from tfpipe import compat

__all__ = ["LearningRateLink", "driving", "is_schedule"]

_MISSING = object()


def is_schedule(optimizer):
  """True when the optimizer's rate is a LearningRateSchedule (not settable, as in Keras)."""
  return isinstance(compat.learning_rate_value(optimizer),
                    keras.optimizers.schedules.LearningRateSchedule)


class LearningRateLink:
  """Keeps the stage optimizers' learning rates equal to the driver's (a context manager).

  It watches the driver's rate variable (its `assign`, which Keras's setter
  calls), so a hook that leaves the rate alone costs no TensorFlow op: the
  caller's eager ops would contend with the stage threads (measured: 7% of
  a tiny model's throughput when the rate was read after every hook).
  """

  _WATCHED = ("assign", "assign_add", "assign_sub")

  def __init__(self, driver, stage_optimizers, updates):
    """`updates()`: the last stage's updates so far, counted by the executor (read without
    touching the stage's device, which may be remote)."""
    self.driver, self.stages, self.updates = driver, list(stage_optimizers), updates
    self._base = compat.update_count(self.stages[-1]) - updates()
    self._synced = None
    self._watched = None

  def __enter__(self):
    self._watch(compat.learning_rate_value(self.driver))
    return self

  def __exit__(self, *exc):
    self._unwatch()
    return False

  def _watch(self, rate):
    self._unwatch()
    self._watched, self._dirty = rate, True
    if isinstance(rate, keras.Variable):
      for name in self._WATCHED:
        method = getattr(rate, name)
        setattr(rate, name, self._tracked(method))

  def _tracked(self, method):
    def call(*args, **kwargs):
      self._dirty = True
      return method(*args, **kwargs)
    return call

  def _unwatch(self):
    if isinstance(self._watched, keras.Variable):
      for name in self._WATCHED:
        self._watched.__dict__.pop(name, None)
    self._watched = None

  def sync(self):
    """Before a callback hook: the last stage's step count to the driver (what TensorBoard
    and schedules read)."""
    count = self._base + self.updates()
    if count != self._synced:   # the tf.Variable under Keras's: 40 us, not 90 (once a batch)
      compat.set_update_count(self.driver, np.int64(count))
      self._synced = count

  def push(self):
    """After a callback hook: the driver's rate to every stage, if it was set."""
    rate = compat.learning_rate_value(self.driver)
    if rate is not self._watched:   # the setter installed a schedule (or a callable)
      for optimizer in self.stages:
        optimizer.learning_rate = rate
      self._watch(rate)
      self._dirty = False
      return
    if self._dirty and isinstance(rate, keras.Variable):
      value = float(rate.numpy())
      for optimizer in self.stages:
        optimizer.learning_rate = value
    self._dirty = False


class driving:  # pylint: disable=invalid-name
  """Context manager: callbacks see the pipeline's optimizer and metrics on the user's model.

  Inside, `model.optimizer` is `driver` and `model.metrics` also lists the
  compiled `metrics` (Keras's `CompileMetrics`, where `EarlyStopping` and
  `ModelCheckpoint` look up whether a metric should rise or fall); after,
  the model has what it had before (its own optimizer, or none).
  """

  def __init__(self, model, driver, metrics=()):
    self.model, self.driver = model, driver
    self.metrics = list(metrics)

  def __enter__(self):
    self._before = self.model.__dict__.get("optimizer", _MISSING)
    self.model.optimizer = self.driver
    compat.model_metrics(self.model).extend(self.metrics)
    return self.driver

  def __exit__(self, *exc):
    if self._before is _MISSING:
      del self.model.optimizer
    else:
      self.model.optimizer = self._before
    for m in self.metrics:
      compat.model_metrics(self.model).remove(m)
    return False
