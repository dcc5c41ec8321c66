"""What `compile` receives: optimizer, loss and metric arguments resolved to objects."""

import keras

__all__ = ["resolve_optimizer", "clone_optimizer", "resolve_loss", "resolve_metrics", "loss_name"]


def resolve_optimizer(optimizer):
  if optimizer is None:
    raise ValueError("`optimizer` is required")
  try:
    return keras.optimizers.get(optimizer)
  except ValueError as e:
    raise ValueError(f"unknown optimizer {optimizer!r}: {e}") from None


def clone_optimizer(optimizer):
  """A fresh instance from the same config: its own step counter and slots."""
  return optimizer.__class__.from_config(optimizer.get_config())


def loss_name(loss):
  """A loss object's or function's name (a function loss is named after its function)."""
  return getattr(loss, "name", None) or getattr(loss, "__name__", None) or str(loss)


def resolve_loss(loss):
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


class _FunctionLoss(keras.losses.Loss):
  """A per-sample loss function averaged over the batch, as `model.compile` does."""

  def __init__(self, fn):
    super().__init__(name=loss_name(fn), reduction="sum_over_batch_size")
    self.fn = fn

  def call(self, y_true, y_pred):
    return self.fn(y_true, y_pred)


_ACCURACY = {
    "sparse_categorical_crossentropy": keras.metrics.SparseCategoricalAccuracy,
    "categorical_crossentropy": keras.metrics.CategoricalAccuracy,
    "binary_crossentropy": keras.metrics.BinaryAccuracy,
}


def resolve_metrics(metrics, loss):
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
