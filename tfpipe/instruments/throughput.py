"""Throughput over a window of iterations (SpecTrain paper: the 50th to the 250th).

A Keras callback: it works with `model.fit` (the `single` and `dataparallel`
baselines) and with `tfpipe.Pipeline.fit`, which reports every finished
mini-batch in order. Steps are counted over the whole `fit`, from 0; the
time between an epoch's last step and the next epoch's start (validation,
epoch-end callbacks) is left out, the next epoch's pipeline fill is not.
"""

import time

import keras

__all__ = ["ThroughputMeter"]


class ThroughputMeter(keras.callbacks.Callback):
  """Times the end of every training step; `samples_per_second(window)` over steps a..b."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self, batch_size, window=(50, 250)):
    super().__init__()
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"`batch_size` must be a positive integer. Received: {batch_size!r}")
    self.batch_size, self.window = batch_size, self._check(window)
    self.ends = []        # per step: its end on the training clock (pauses left out)
    self._paused = 0.0
    self._last = None

  @staticmethod
  def _check(window):
    a, b = window
    if not 0 <= a < b:
      raise ValueError(f"a throughput window needs 0 <= first < last. Received: {window!r}")
    return a, b

  def on_train_begin(self, logs=None):
    self.ends, self._paused, self._last = [], 0.0, None

  def on_epoch_begin(self, epoch, logs=None):
    if self._last is not None:
      self._paused += time.perf_counter() - self._last

  def on_train_batch_end(self, batch, logs=None):
    self._last = time.perf_counter()
    self.ends.append(self._last - self._paused)

  def samples_per_second(self, window=None):
    """Samples per second between the end of step a and the end of step b."""
    a, b = self._check(window or self.window)
    if b >= len(self.ends):
      raise ValueError(
          f"the throughput window {a}..{b} needs {b + 1} steps; the run had {len(self.ends)}. "
          "Train longer or choose a smaller window")
    return (b - a) * self.batch_size / (self.ends[b] - self.ends[a])
