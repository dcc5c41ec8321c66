"""Optimizer-dependent weight prediction (PipeOptim; XPipe for Adam): the weights `s` updates
ahead, extrapolated along the step the stage's own optimizer takes now.

s: version difference, lr: the learning rate, t: the optimizer's update count.

| optimizer | step d (one update) | prediction |
|---|---|---|
| `tfpipe.optimizers.SpecTrain` | lr * v (smoothed gradient) | W - s * d (SpecTrain eq. 4) |
| `keras.optimizers.SGD`, momentum > 0 | -m (Keras's momentum slot is the last step) | W - s * d |
| `keras.optimizers.Adam`, `AdamW` | lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps) | W - s * d |

A weight decay wd (AdamW, or any optimizer's `weight_decay`) adds lr * wd * W
to d. Before the first update (t = 0) Adam's step is zero: the prediction is W.
The reference (`tfpipe.rules.reference`) writes the same rules in numpy.

References:
  Guan et al. PipeOptim: Ensuring Effective 1F1B Schedule with Optimizer-Dependent
  Weight Prediction, 2023. Guan et al. XPipe: Efficient Pipeline Model Parallelism for
  Multi-GPU DNN Training, 2019.
"""

from typing import Any, List, Sequence

import keras
from keras import ops

from tfpipe import compat

__all__ = ["check", "predict_all", "adam_rate", "SUPPORTED"]

SUPPORTED = "tfpipe.optimizers.SpecTrain, keras.optimizers.SGD (momentum > 0), Adam, AdamW"


def check(optimizer: Any) -> None:
  """Raises a clear error when `optimizer` has no update direction to predict with."""
  name = type(optimizer).__name__
  if hasattr(optimizer, "predict_all"):
    return
  if isinstance(optimizer, keras.optimizers.SGD):
    if optimizer.momentum == 0:
      raise ValueError("weight prediction extrapolates the optimizer's step, and SGD without "
                       "momentum keeps none: give SGD a momentum > 0. Received: momentum=0")
    if optimizer.nesterov:
      raise ValueError("weight prediction is defined for plain momentum SGD, not Nesterov's. "
                       "Received: nesterov=True")
    return
  if isinstance(optimizer, keras.optimizers.Adam):   # AdamW is an Adam
    if optimizer.amsgrad:
      raise ValueError("weight prediction with Adam is defined without amsgrad. Received: "
                       "amsgrad=True")
    return
  raise ValueError(f"weight prediction needs an optimizer whose step it knows ({SUPPORTED}). "
                   f"Received: {name}")


def _decay(optimizer, variable, lr):
  if optimizer.weight_decay is None or not compat.uses_weight_decay(optimizer, variable):
    return None
  return ops.multiply(ops.multiply(lr, ops.cast(optimizer.weight_decay, variable.dtype)),
                      ops.convert_to_tensor(variable))


def adam_rate(optimizer, dtype, lr):
  """lr * sqrt(1 - b2^t) / (1 - b1^t), and 0 before the first update."""
  t = ops.cast(optimizer.iterations, dtype)
  safe = ops.maximum(t, 1.0)
  rate = lr * ops.sqrt(1 - ops.power(ops.cast(optimizer.beta_2, dtype), safe)) / (
      1 - ops.power(ops.cast(optimizer.beta_1, dtype), safe))
  return ops.where(t > 0, rate, ops.zeros_like(rate))


def predict_all(optimizer: Any, variables: Sequence[Any], s: Any) -> List[Any]:
  """The weights of `variables` predicted `s` updates ahead (tensors), by the table above."""
  if hasattr(optimizer, "predict_all"):
    return optimizer.predict_all(variables, s)
  steps = {}
  predicted = []
  for variable in variables:
    dtype = variable.dtype
    if dtype not in steps:
      lr = ops.cast(optimizer.learning_rate, dtype)
      rate = adam_rate(optimizer, dtype, lr) if isinstance(
          optimizer, keras.optimizers.Adam) else None
      steps[dtype] = (ops.cast(s, dtype), lr, rate)
    s_, lr, rate = steps[dtype]
    index = compat.variable_index(optimizer, variable)
    if rate is None:   # momentum SGD: the slot m is the last step, w += m
      step = ops.negative(optimizer.momentums[index])
    else:
      m, v = compat.adam_moments(optimizer, index)
      step = ops.divide(ops.multiply(m, rate), ops.add(ops.sqrt(v), optimizer.epsilon))
    decay = _decay(optimizer, variable, lr)
    if decay is not None:
      step = ops.add(step, decay)
    predicted.append(ops.subtract(ops.convert_to_tensor(variable), ops.multiply(s_, step)))
  return predicted
