"""Instruments: what a run shows about itself, read from an executor's records or a stage.

  trace:            Chrome trace of chosen steps, and their TensorBoard profile;
  breakdown:        per stage, compute / transfer / idle shares of wall time;
  throughput:       samples/s between two steps (a Keras callback);
  prediction_error: SpecTrain's prediction error against the weights reached later;
  memory:           per stage, bytes of weights, kept versions, activations and slots;
  traffic:          bytes each host sent and received over its link per step (a Keras callback);
  transfers:        each host's time computing and waiting on transfers, from its TF server's trace.
"""

from tfpipe.instruments import (breakdown, memory, prediction_error, throughput, trace, traffic,
                                transfers)

__all__ = ["breakdown", "memory", "prediction_error", "throughput", "trace", "traffic",
           "transfers"]
