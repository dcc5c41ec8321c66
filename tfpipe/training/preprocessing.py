"""A KerasHub task's attached preprocessor, applied to what `fit`, `evaluate` and `predict` get.

KerasHub's `task.fit(strings)` maps the task's `preprocess_samples` (its preprocessor:
tokenizer, packer, the labels and padding mask of a causal LM) over the batched data before
Keras sees it. A pipeline does the same: data in the form the task takes (a
`tf.data.Dataset` of strings, or strings in a list or array, with labels where the task
wants them) becomes a dataset of the model's inputs, in the order given (no shuffling, as
KerasHub's), batched by `batch_size` (32 by default, as Keras's).
"""

from typing import Any, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

__all__ = ["attached", "preprocessed", "validation"]

DEFAULT_BATCH_SIZE = 32


def attached(model: keras.Model) -> bool:
  """Whether `model` is a KerasHub task with a preprocessor attached."""
  return (callable(getattr(model, "preprocess_samples", None))
          and getattr(model, "preprocessor", None) is not None)


def _raw(value: Any) -> bool:
  """Whether `value` holds text (strings) a preprocessor turns into the model's inputs."""
  if isinstance(value, tf.data.Dataset):
    return any(spec.dtype == tf.string for spec in tf.nest.flatten(value.element_spec)
               if hasattr(spec, "dtype"))
  if isinstance(value, str):
    return True
  flat = tf.nest.flatten(value) if value is not None else []
  return any(isinstance(v, str) or (isinstance(v, (list, tuple)) and v and isinstance(v[0], str))
             or (isinstance(v, np.ndarray) and v.dtype.kind in "USO")
             or (isinstance(v, tf.Tensor) and v.dtype == tf.string) for v in flat)


def preprocessed(model: keras.Model, x: Any, y: Any = None, sample_weight: Any = None,
                 batch_size: Optional[int] = None) -> Tuple[Any, Any, Any, Optional[int]]:
  """(x, y, sample_weight, batch_size) as the pipeline takes them: where `model` has a
  preprocessor and `x` is text, a dataset of `model.preprocess_samples`'s batches (and None,
  None, None: the batches are made); else as given (inputs already made, e.g. token ids,
  pass as they are)."""
  if not attached(model) or x is None or not _raw(x):
    return x, y, sample_weight, batch_size
  if isinstance(x, tf.data.Dataset):
    if y is not None or sample_weight is not None:
      raise ValueError("`y` and `sample_weight` go inside a tf.data.Dataset, not beside it")
    data = x
  else:
    if isinstance(x, str):
      raise ValueError(f"text to preprocess comes as a list, an array or a tf.data.Dataset of "
                       f"strings, not one string. Received: {x[:40]!r}")
    arrays = lambda v: np.asarray(v) if isinstance(v, (list, tuple)) else v
    parts = (x, y, sample_weight) if sample_weight is not None else (x, y) if y is not None \
        else (x,)
    data = tf.data.Dataset.from_tensor_slices(keras.utils.pack_x_y_sample_weight(
        *[arrays(v) for v in parts])).batch(batch_size or DEFAULT_BATCH_SIZE)
  unpacked = lambda *element: model.preprocess_samples(*element)
  made = data.map(unpacked, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
  return made, None, None, None


def validation(model: keras.Model, data: Any, batch_size: Optional[int]) -> Any:
  """`fit`'s `validation_data` as the pipeline takes it: text (a dataset, or an (x, y,
  sample_weight) tuple) preprocessed as `preprocessed` does; anything else as given."""
  if data is None:
    return None
  x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
  made = preprocessed(model, x, y, sample_weight, batch_size)
  return data if made[0] is x else made[0]
