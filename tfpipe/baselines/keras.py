"""Baselines with the Pipeline's API: one device, and MirroredStrategy data parallelism."""

import time

import keras
import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe.stage import keras_step as compile_utils

__all__ = ["Single", "DataParallel"]


class KerasRunner:
  """Compile/fit/evaluate/predict of a Keras model, trained weights left in `model`."""

  def __init__(self, model):
    if not isinstance(model, keras.Model):
      raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    self.model = model
    self._trained = model

  def summary(self, print_fn=None):
    """Prints what trains the model (one line); the model's own layers: `model.summary()`."""
    (print_fn or print)(f"tfpipe.{type(self).__name__}: {self.describe()}")

  def compile(self, optimizer, loss, metrics=None):
    self.optimizer = compile_utils.resolve_optimizer(optimizer)
    self._trained.compile(optimizer=self.optimizer, loss=loss, metrics=metrics)

  def _sync_back(self):
    if self._trained is not self.model:
      self.model.set_weights(self._trained.get_weights())

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
          validation_data=None, shuffle=True, steps_per_epoch=None, seed=None, **keras_fit):
    """`keras.Model.fit` (its other arguments pass through); `seed` is the Pipeline's
    shuffle seed, which Keras takes from the global seed instead."""
    del seed
    self._check_batch(x, batch_size)
    history = _ThroughputHistory(_samples_per_epoch(x, batch_size, steps_per_epoch))
    history_cbs = list(callbacks or []) + [history]
    result = self._trained.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                               callbacks=history_cbs, validation_data=validation_data,
                               shuffle=shuffle, steps_per_epoch=steps_per_epoch, **keras_fit)
    self._sync_back()
    return result

  def evaluate(self, x=None, y=None, batch_size=None, verbose=0, sample_weight=None, steps=None,
               callbacks=None, return_dict=False):
    return self._trained.evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                  sample_weight=sample_weight, steps=steps, callbacks=callbacks,
                                  return_dict=return_dict)

  def predict(self, x, batch_size=None, verbose=0, steps=None, callbacks=None):
    return self._trained.predict(x, batch_size=batch_size, verbose=verbose, steps=steps,
                                 callbacks=callbacks)

  def _check_batch(self, x, batch_size):
    pass


def _samples_per_epoch(x, batch_size, steps):
  """Samples one epoch trains on; reads the data only when sizes are not static."""
  if isinstance(x, tf.data.Dataset):
    dim = tf.nest.flatten(x.element_spec)[0].shape[0]
    batches = steps if steps is not None else int(x.cardinality())
    if dim is not None and batches >= 0:
      return dim * batches
    return sum(int(tf.shape(tf.nest.flatten(b)[0])[0]) for b in x.take(steps or -1))
  n = len(x[0]) if isinstance(x, (tuple, list)) else len(x)
  return n if steps is None else min(n, steps * (batch_size or 32))


class _ThroughputHistory(keras.callbacks.Callback):
  """Adds `samples_per_second` to each epoch's logs, as the Pipeline reports it."""

  def __init__(self, samples_per_epoch):
    super().__init__()
    self.samples_per_epoch = samples_per_epoch

  def on_epoch_begin(self, epoch, logs=None):
    self._start = time.perf_counter()

  def on_epoch_end(self, epoch, logs=None):
    seconds = time.perf_counter() - self._start
    if logs is not None and seconds > 0:
      logs["samples_per_second"] = self.samples_per_epoch / seconds


class Single(KerasRunner):
  """Plain Keras training on one device: the reference every method is measured against."""

  def __init__(self, model, device=None):
    super().__init__(model)
    self.device = device or devices_lib.default_devices()[0]

  def describe(self):
    return f"one device ({self.device})"

  def fit(self, *args, **kwargs):
    with tf.device(self.device):
      return super().fit(*args, **kwargs)


class DataParallel(KerasRunner):
  """`tf.distribute.MirroredStrategy` over `devices`: the global batch split over R replicas."""

  def __init__(self, model, devices=None, num_replicas=None):
    super().__init__(model)
    self.devices = devices_lib.resolve_devices(devices, num_replicas)
    self.strategy = tf.distribute.MirroredStrategy(
        self.devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with self.strategy.scope():
      self._trained = keras.models.clone_model(model)
      self._trained.set_weights(model.get_weights())

  def describe(self):
    return f"MirroredStrategy over {len(self.devices)} devices {self.devices}"

  def compile(self, optimizer, loss, metrics=None):
    with self.strategy.scope():
      optimizer = compile_utils.resolve_optimizer(optimizer)
      self.optimizer = compile_utils.clone_optimizer(optimizer)
      self._trained.compile(optimizer=self.optimizer, loss=loss, metrics=metrics)

  def _check_batch(self, x, batch_size):
    replicas = len(self.devices)
    size = batch_size
    if isinstance(x, tf.data.Dataset):
      dim = tf.nest.flatten(x.element_spec)[0].shape[0]
      size = dim if dim is not None else None
    if size is not None and size % replicas:
      raise ValueError(
          f"the global batch must split evenly over the replicas: batch size {size} is not "
          f"divisible by {replicas} replicas")
