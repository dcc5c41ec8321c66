"""Throughput over a window of steps, with Keras fit and with a Pipeline."""

import time

import keras
import pytest

import tfpipe
from tfpipe.instruments.throughput import ThroughputMeter
from tfpipe.rules import optimizers
from tests import helpers


def test_window_throughput_in_keras_fit_and_in_a_pipeline():
  x, y = helpers.as_arrays(helpers.batches(10))
  model = helpers.mlp()
  model.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  meter = ThroughputMeter(16, window=(2, 8))
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[meter])
  assert len(meter.ends) == 20 and meter.samples_per_second() > 0
  assert meter.samples_per_second((3, 19)) == pytest.approx(
      16 * 16 / (meter.ends[19] - meter.ends[3]))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="pipedream")
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  meter = ThroughputMeter(16, window=(2, 8))
  pipe.fit(x, y, batch_size=16, verbose=0, callbacks=[meter])
  assert len(meter.ends) == 10 and meter.samples_per_second() > 0
  with pytest.raises(ValueError, match="window 2..12 needs 13 steps; the run had 10"):
    meter.samples_per_second((2, 12))
  with pytest.raises(ValueError, match="0 <= first < last"):
    ThroughputMeter(16, window=(5, 5))


class _SlowEpochEnd(keras.callbacks.Callback):
  def on_epoch_end(self, epoch, logs=None):
    time.sleep(0.5)


@pytest.mark.parametrize("pipelined", [False, True])
def test_time_between_epochs_is_left_out(pipelined):
  x, y = helpers.as_arrays(helpers.batches(4))
  model = helpers.mlp()
  if pipelined:
    model = tfpipe.Pipeline(model, num_stages=2, method="pipedream")
  model.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  meter = ThroughputMeter(16, window=(0, 7))
  model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[_SlowEpochEnd(), meter])
  assert meter.ends[4] - meter.ends[3] < 0.4   # the half-second pause is not training time
