"""What `compile` receives: optimizer, loss and metric arguments resolved to objects.

`KerasStep` holds what `keras.Model.compile` builds for the train step (its
own `CompileLoss` and `CompileMetrics`, through `tfpipe.compat`), so a
pipeline's loss, metric names, weighting and reduction are Keras's.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfpipe import compat

__all__ = ["resolve_optimizer", "clone_optimizer", "resolve_loss", "resolve_metrics", "loss_name",
           "KerasStep",
           "example_shape", "example_shapes"]


def resolve_optimizer(optimizer: Any) -> Any:
  if optimizer is None:
    raise ValueError("`optimizer` is required")
  try:
    return keras.optimizers.get(optimizer)
  except ValueError as e:
    raise ValueError(f"unknown optimizer {optimizer!r}: {e}") from None


def clone_optimizer(optimizer: Any, **overrides: Any) -> Any:
  """A fresh instance from the same config (with `overrides`): its own step counter and
  slots."""
  config = optimizer.get_config()
  config.update(overrides)
  return optimizer.__class__.from_config(config)




class KerasStep:
  """The loss, metrics and loss tracker of Keras's train step (one output or several).

  Built from `keras.Model.compile`'s arguments with Keras's own containers:
  `loss` is a `CompileLoss` (loss_weights, reduction, a dict keyed by output
  name), `metrics` a `CompileMetrics` (`metrics` unweighted, `weighted_metrics`
  weighted by sample and class weights, "accuracy" resolved from the labels'
  and outputs' shapes, names as Keras logs them). `build` makes their variables
  on `device` from the labels' spec before any step is traced.
  """

  def __init__(self, model: Any, loss: Any, metrics: Any, weighted_metrics: Any,
               loss_weights: Any, device: str) -> None:
    if loss is None:
      raise ValueError("`loss` is required")
    self.model, self.device = model, device
    output_names = list(getattr(model, "output_names", None) or [])
    with tf.device(device):
      self.loss = compat.CompileLoss(loss, loss_weights, output_names=output_names or None)
      self.metrics = (compat.CompileMetrics(metrics, weighted_metrics,
                                                  output_names=output_names or None)
                      if metrics is not None or weighted_metrics is not None else None)
      self.loss_tracker = keras.metrics.Mean(name="loss")
    self.user_loss = loss

  def build(self, label_spec: Any) -> None:
    """Builds the loss and metrics for labels of `label_spec` (a TensorSpec), eagerly."""
    if label_spec is None or (self.loss.built and (self.metrics is None or self.metrics.built)):
      return
    specs = list(label_spec) if isinstance(label_spec, (tuple, list)) else [label_spec]
    y_true, y_pred = [], []
    for spec, out in zip(specs, self.model.outputs):
      true_shape, pred_shape = example_shapes(spec.shape, out.shape)
      y_true.append(tf.zeros(true_shape, spec.dtype))
      y_pred.append(tf.zeros(pred_shape, out.dtype))
    y_true, y_pred = self.structured(y_true), self.structured(y_pred)
    with tf.device(self.device):
      if not self.loss.built:
        self.loss.build(y_true, y_pred)
      if self.metrics is not None and not self.metrics.built:
        self.metrics.build(y_true, y_pred)
        self.metrics.reset_state()

  def structured(self, values: Sequence[Any]) -> Any:
    """One tensor per model output (in its output order) in the structure Keras's loss and
    metrics take: the tensor itself for one output, else the model's output structure (a
    list, or a dict by output name)."""
    values = list(values)
    if len(self.model.outputs) == 1:
      return values[0]
    return keras.tree.pack_sequence_as(self.model.output, values)

  def reset(self) -> None:
    self.loss_tracker.reset_state()
    for metric in self.loss.metrics:   # each output's loss, for several outputs
      metric.reset_state()
    if self.metrics is not None:
      self.metrics.reset_state()


def example_shape(shape: Sequence[Optional[int]], batch: int = 1, unknown: int = 2) -> List[int]:
  """A concrete shape for a probe of a tensor of `shape` (its first axis the batch): `batch`
  samples, and `unknown` for every other axis that is None (a sequence of any length)."""
  return [batch] + [unknown if d is None else d for d in list(shape)[1:]]


def example_shapes(true_shape: Sequence[Optional[int]], pred_shape: Sequence[Optional[int]],
                   batch: int = 1, unknown: int = 2) -> Tuple[List[int], List[int]]:
  """Concrete shapes for labels and outputs of `true_shape` and `pred_shape` whose axes agree
  where both are unknown or one is known (a per-token head's (None, None, V) beside labels of
  (None, 16) takes 16), as a real batch's would: what Keras's loss and metrics are built from
  (their choices read the ranks and the last axis, never a length)."""
  true_shape, pred_shape = list(true_shape), list(pred_shape)
  known = [next((d for d in (t, p) if d is not None), None)
           for t, p in zip(true_shape[1:], pred_shape[1:])]
  def fill(shape: Sequence[Optional[int]]) -> List[int]:
    dims = list(shape[1:])
    dims[:len(known)] = [d if d is not None else k for d, k in zip(dims, known)]
    return example_shape([None] + dims, batch, unknown)
  return fill(true_shape), fill(pred_shape)


def loss_name(loss: Any) -> str:
  """A loss object's or function's name (a function loss is named after its function)."""
  return getattr(loss, "name", None) or getattr(loss, "__name__", None) or str(loss)


def resolve_loss(loss: Any) -> Any:
  if loss is None:
    raise ValueError("`loss` is required")
  if isinstance(loss, keras.losses.Loss):
    return loss
  try:
    fn = keras.losses.get(loss)
  except ValueError as e:
    raise ValueError(f"unknown loss {loss!r}: {e}") from None
  if isinstance(fn, keras.losses.Loss):
    return fn
  return _FunctionLoss(fn)


class _FunctionLoss(keras.losses.Loss):  # type: ignore[misc]  # Keras is untyped
  """A per-sample loss function averaged over the batch, as `model.compile` does."""

  def __init__(self, fn: Callable[..., Any]) -> None:
    super().__init__(name=loss_name(fn), reduction="sum_over_batch_size")
    self.fn = fn

  def call(self, y_true: Any, y_pred: Any) -> Any:
    return self.fn(y_true, y_pred)


_ACCURACY = {
    "sparse_categorical_crossentropy": keras.metrics.SparseCategoricalAccuracy,
    "categorical_crossentropy": keras.metrics.CategoricalAccuracy,
    "binary_crossentropy": keras.metrics.BinaryAccuracy,
}


def resolve_metrics(metrics: Optional[Sequence[Any]], loss: Any) -> List[Any]:
  """Metric objects; "accuracy" picks the accuracy that matches the loss, as Keras does."""
  out = []
  for m in metrics or []:
    if isinstance(m, keras.metrics.Metric):
      out.append(m)
    elif m in ("accuracy", "acc"):
      name = loss_name(loss).lower()
      cls = next((c for key, c in _ACCURACY.items() if key in name), keras.metrics.Accuracy)
      out.append(cls(name="accuracy"))
    else:
      try:
        fn = keras.metrics.get(m)
      except ValueError as e:
        raise ValueError(f"unknown metric {m!r}: {e}") from None
      out.append(fn if isinstance(fn, keras.metrics.Metric)
                 else keras.metrics.MeanMetricWrapper(fn, name=str(m)))
  return out
