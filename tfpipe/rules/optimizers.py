"""SpecTrain: momentum SGD with the paper's smoothed gradient and weight prediction."""

from typing import Any, Union

import keras
from keras import ops

__all__ = ["SpecTrain", "predict_weights"]

Schedule = keras.optimizers.schedules.LearningRateSchedule


def predict_weights(weights, smoothed_gradient, learning_rate, s):
  """The SpecTrain paper's eq. 4: the weights expected `s` updates ahead.

  ```
  W_hat_{t+s} = W_t - s * eta * v_{t-1}
  ```
  Pure: works on numpy arrays and tensors alike.
  """
  return weights - s * learning_rate * smoothed_gradient


@keras.saving.register_keras_serializable(package="tfpipe")
class SpecTrain(keras.optimizers.Optimizer):
  """Momentum SGD with a smoothed gradient, and weight prediction for pipelines.

  Update rule for a variable `w` with gradient `g` (the SpecTrain paper, eq. 1-2):

  ```
  v = momentum * v + (1 - momentum) * g
  w = w - learning_rate * v
  ```

  Prediction `s` updates ahead (eq. 4), used by `tfpipe.Pipeline(method="spectrain")`:

  ```
  w_hat = w - s * learning_rate * v
  ```

  With `s = 0` the prediction is the weights themselves, and with a constant
  gradient the prediction is exact once `v` has converged. On one device the
  optimizer is an ordinary Keras optimizer usable in `model.fit`.

  Args:
    learning_rate: a float or a `keras.optimizers.schedules.LearningRateSchedule`.
    momentum: the decay factor gamma of the smoothed gradient, in [0, 1).
    name: the optimizer's name.
    **kwargs: the base `keras.optimizers.Optimizer` arguments.

  References:
    Chen, Yang, Cheng. Efficient and Robust Parallel DNN Training through Model
    Parallelism on Multi-GPU Platform (SpecTrain), 2018.
  """

  def __init__(self, learning_rate: Union[float, Schedule] = 0.01, momentum: float = 0.9,
               name: str = "spectrain", **kwargs: Any):
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool):
      raise ValueError(f"`momentum` must be a float in [0, 1). Received: momentum={momentum!r}")
    if not 0.0 <= momentum < 1.0:
      raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={momentum}")
    if isinstance(learning_rate, (int, float)) and not isinstance(learning_rate, bool):
      if learning_rate < 0:
        raise ValueError(
            f"`learning_rate` must be >= 0. Received: learning_rate={learning_rate}")
    super().__init__(learning_rate=learning_rate, name=name, **kwargs)
    self.momentum = float(momentum)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)
    self.smoothed_gradients = self.add_optimizer_variables(variables, "smoothed_gradient")

  def update_step(self, gradient, variable, learning_rate):
    learning_rate = ops.cast(learning_rate, variable.dtype)
    gradient = ops.cast(gradient, variable.dtype)
    v = self.smoothed_gradients[self._get_variable_index(variable)]
    self.assign(v, ops.add(ops.multiply(v, self.momentum),
                           ops.multiply(gradient, 1.0 - self.momentum)))
    self.assign_sub(variable, ops.multiply(v, learning_rate))

  def smoothed_gradient(self, variable):
    """The slot `v` of `variable` (zeros before the first update)."""
    return self.smoothed_gradients[self._get_variable_index(variable)]

  def predict(self, variable, s):
    """Returns `variable - s * learning_rate * v`: the weights `s` updates ahead."""
    return self.predict_all([variable], s)[0]

  def predict_all(self, variables, s):
    """`predict` for each of `variables`, reading the learning rate and forming
    s * learning_rate once per dtype (a pipeline stage predicts all its weights at once)."""
    steps = {}
    predicted = []
    for variable in variables:
      dtype = variable.dtype
      if dtype not in steps:
        steps[dtype] = ops.multiply(ops.cast(s, dtype), ops.cast(self.learning_rate, dtype))
      predicted.append(ops.subtract(ops.convert_to_tensor(variable),
                                    ops.multiply(steps[dtype], self.smoothed_gradient(variable))))
    return predicted

  def get_config(self):
    config = super().get_config()
    config.update({"momentum": self.momentum})
    return config
