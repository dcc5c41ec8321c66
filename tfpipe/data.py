"""Inputs: turn what `fit`/`evaluate`/`predict` receive into batches and a batch count."""

import numpy as np
import tensorflow as tf

__all__ = ["as_dataset"]


def as_dataset(x, y=None, batch_size=None, steps=None, shuffle=False, seed=None, labels=True):
  """Returns (dataset, num_batches) for a batched tf.data.Dataset or numpy arrays.

  A dataset must already be batched; its cardinality gives the batch count
  unless `steps` is given. Arrays are batched with `batch_size` (default 32).
  """
  if steps is not None and (not isinstance(steps, int) or steps < 1):
    raise ValueError(f"`steps` must be a positive integer. Received: {steps!r}")
  if isinstance(x, tf.data.Dataset):
    if y is not None:
      raise ValueError("`y` must be None when `x` is a tf.data.Dataset (it yields (x, y) pairs)")
    if batch_size is not None:
      raise ValueError(
          f"`batch_size` must be None for a tf.data.Dataset (batch the dataset). "
          f"Received: batch_size={batch_size}")
    dataset = x
  else:
    if x is None:
      raise ValueError("no input data: `x` is None")
    if labels and y is None:
      raise ValueError("`y` is needed with array inputs when training or evaluating")
    batch_size = 32 if batch_size is None else batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
    n = len(x[0]) if isinstance(x, (tuple, list)) else len(x)
    if labels and len(y) != n:
      raise ValueError(f"`x` and `y` must have the same length. Received: {n} and {len(y)}")
    features = tuple(np.asarray(a) for a in x) if isinstance(x, (tuple, list)) else np.asarray(x)
    data = (features, np.asarray(y)) if labels else features
    dataset = tf.data.Dataset.from_tensor_slices(data)
    if shuffle:
      dataset = dataset.shuffle(n, seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size).prefetch(2)
  if steps is not None:
    return dataset, steps
  cardinality = int(dataset.cardinality())
  if cardinality < 0:
    raise ValueError(
        "the dataset's size is unknown or infinite; give `steps_per_epoch` (fit) or `steps` "
        "(evaluate, predict)")
  if cardinality == 0:
    raise ValueError("the dataset is empty")
  return dataset, cardinality
