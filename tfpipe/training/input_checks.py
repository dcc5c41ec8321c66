"""Input checks: bad data is refused before any work, in one line that names the problem.

What is checked, from the dataset's element spec (no element is read, so a
seeded shuffle keeps its order) or from the arrays: that a dataset is
batched, that every input has the shape the model expects, and, for arrays
and a loss that can tell, that the labels are classes the model has.
A dataset's labels are checked by the loss at each batch, as in Keras.
"""

import numpy as np
import tensorflow as tf

from tfpipe.stage import keras_step as compile_utils

__all__ = ["check_inputs", "check_labels"]

_STRING_LABELS = ("labels are strings; the loss takes numbers: map them to class indices first "
                  "(e.g. keras.layers.StringLookup, or numpy.unique(y, return_inverse=True))")


def _shape(t):
  return tuple(t.shape)


def _describe(shape):
  return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def check_inputs(dataset, model, names, labelled=True):
  """Refuses a dataset whose inputs are unbatched or do not fit the model's inputs.

  `dataset` as `tfpipe.training.data.as_dataset` gives it: elements (inputs, y[,
  sample_weight]) when `labelled`, else the inputs alone.
  """
  spec = dataset.element_spec
  if labelled and not (isinstance(spec, tuple) and len(spec) in (2, 3)):
    raise ValueError(f"training and evaluation data yield (x, y) or (x, y, sample_weight) "
                     f"pairs. Received elements {spec}")
  inputs = spec[0] if labelled else spec
  if isinstance(inputs, dict):
    inputs = tuple(inputs[n] for n in names if n in inputs)
  inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
  if len(inputs) != len(model.inputs):
    raise ValueError(f"the model has {len(model.inputs)} inputs {names}; the data gives "
                     f"{len(inputs)}")
  for name, got, want in zip(names, inputs, model.inputs):
    if got.dtype == tf.string and want.dtype != "string":
      raise ValueError(f"input {name!r} is strings; the model takes {want.dtype} tensors: "
                       "turn the text into numbers first (e.g. a keras.layers.StringLookup or "
                       "TextVectorization in the data pipeline)")
    got, want = _shape(got), _shape(want)
    if len(got) == len(want) - 1 and _fits(got, want[1:]):
      raise ValueError(
          f"the dataset yields unbatched elements (input {name!r} has shape {_describe(got)}, "
          f"the model takes batches {_describe(want)}): batch it, e.g. dataset.batch(32)")
    if len(got) != len(want) or not _fits(got[1:], want[1:]):
      raise ValueError(f"input {name!r} has shape {_describe(got)}; the model expects "
                       f"{_describe(want)}")


def _fits(got, want):
  return len(got) == len(want) and all(w is None or g is None or g == w
                                       for g, w in zip(got, want))


def check_labels(y, model, loss, spec=None):
  """Refuses labels the loss cannot take: strings; for a sparse categorical loss, labels of the
  outputs' rank whose last axis is wider than 1 (one-hot); for arrays, sparse class indices
  outside [0, C), one-hot labels of another width than the model's C outputs, binary labels
  outside [0, 1]. `spec`: the labels' TensorSpec (datasets: dtype and shape only)."""
  name = compile_utils.loss_name(loss).lower()
  classes = model.outputs[0].shape[-1]
  if spec is not None and isinstance(spec, tf.TensorSpec):
    if spec.dtype == tf.string:
      raise ValueError(_STRING_LABELS)
    rank = len(model.outputs[0].shape)
    if ("sparse_categorical" in name and spec.shape.rank == rank and spec.shape[-1] is not None
        and spec.shape[-1] > 1):
      raise ValueError(
          f"labels of shape {_describe(spec.shape)} look one-hot, and {name} takes class "
          "indices: use categorical_crossentropy, or give the class indices (y.argmax(-1))")
  if y is None or isinstance(y, tf.data.Dataset):
    return
  y = np.asarray(y)
  if y.dtype.kind in "USO":
    raise ValueError(_STRING_LABELS)
  if "sparse_categorical" in name and classes:
    if y.size == 0:
      return
    lo, hi = y.min(), y.max()
    if lo < 0 or hi >= classes or (y.dtype.kind == "f" and not np.all(np.round(y) == y)):
      raise ValueError(
          f"labels must be class indices in [0, {classes}) for {name} with the model's "
          f"{classes} outputs. Received: labels from {lo} to {hi}")
  elif "categorical" in name and classes and y.ndim >= 2 and y.shape[-1] != classes:
    raise ValueError(f"one-hot labels of width {y.shape[-1]} do not fit the model's {classes} "
                     f"outputs ({name})")
  elif "binary" in name and y.size and (y.min() < 0 or y.max() > 1):
    raise ValueError(f"labels must be in [0, 1] for {name}. Received: labels from "
                     f"{y.min()} to {y.max()}")
