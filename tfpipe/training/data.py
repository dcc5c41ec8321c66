"""Inputs: what `fit`/`evaluate`/`predict` receive, as batched datasets and a batch count.

Keras's forms are accepted: arrays (one, a list in the model's input order,
or a dict by input name), `y`, `sample_weight`, `class_weight`; a batched
`tf.data.Dataset` of `x`, `(x, y)` or `(x, y, sample_weight)`; or a
`keras.utils.PyDataset`, a Python generator or iterator of such batches, which
Keras's own data adapter turns into a dataset (`adapted`). Stage 0 reads
elements `(inputs, y[, sample_weight])` whose inputs are a tuple in the
model's input order (one input: the tensor itself).
"""

import inspect
import math
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfpipe import compat

__all__ = ["as_dataset", "validation_split", "class_weights", "input_names", "feature_arrays",
           "adapted", "is_iterable_data", "flat_labels"]


def input_names(model):
  """The names of the model's inputs, in order (the keys of dict inputs)."""
  return [t.name for t in model.inputs]


def is_iterable_data(x):
  """Whether `x` is data Keras reads through an adapter of its own: a `keras.utils.PyDataset`,
  a Python generator or another iterator of batches."""
  return isinstance(x, keras.utils.PyDataset) or inspect.isgenerator(x) or (
      hasattr(x, "__next__") and not isinstance(x, (np.ndarray, tf.Tensor, tf.data.Dataset)))


class _EpochHooks(keras.callbacks.Callback):
  """Runs a Keras data adapter's hooks (a PyDataset's `on_epoch_begin` / `on_epoch_end`, its
  workers started and stopped) around each epoch of `fit`, as Keras's epoch iterator does."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self, adapter):
    super().__init__()
    self.adapter = adapter

  def on_epoch_begin(self, epoch, logs=None):
    self.adapter.on_epoch_begin()

  def on_epoch_end(self, epoch, logs=None):
    self.adapter.on_epoch_end()


class _TestHooks(_EpochHooks):
  """The same around each pass of validation or `evaluate`."""

  on_epoch_begin = on_epoch_end = keras.callbacks.Callback.on_epoch_begin

  def on_test_begin(self, logs=None):
    self.adapter.on_epoch_begin()

  def on_test_end(self, logs=None):
    self.adapter.on_epoch_end()


class _PredictHooks(_EpochHooks):
  """The same around `predict`."""

  on_epoch_begin = on_epoch_end = keras.callbacks.Callback.on_epoch_begin

  def on_predict_begin(self, logs=None):
    self.adapter.on_epoch_begin()

  def on_predict_end(self, logs=None):
    self.adapter.on_epoch_end()


_HOOKS = {"train": _EpochHooks, "test": _TestHooks, "predict": _PredictHooks}


class _OnePass(keras.callbacks.Callback):
  """A Python generator of unknown length feeds one epoch: after it, training stops with
  Keras's warning (Keras finds the generator exhausted at the next epoch and stops)."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self):
    super().__init__()
    self.epochs = 0

  def on_epoch_end(self, epoch, logs=None):
    self.epochs += 1
    if self.epochs == 1 and self.params.get("epochs", 1) > epoch + 1:
      warnings.warn("Your input ran out of data; interrupting training. Make sure that your "
                    "dataset or generator can generate at least `steps_per_epoch * epochs` "
                    "batches.", stacklevel=2)
      self.model.stop_training = True


def adapted(x, y=None, sample_weight=None, batch_size=None, steps=None, shuffle=False,
            class_weight=None, use="train"):
  """`x` as `as_dataset` takes it: a PyDataset, generator or iterator becomes the
  `tf.data.Dataset` Keras's own adapter makes of it (its batch count `len(x)`, as Keras takes
  it, or `steps`), with the class weights applied as Keras applies them. Returns (x,
  class_weight left to apply, callbacks that run the adapter's epoch hooks for `use`); other
  data comes back as it is, with no callbacks."""
  if not is_iterable_data(x):
    return x, class_weight, []
  what = type(x).__name__
  for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size)):
    if value is not None:
      raise ValueError(f"`{name}` must be None when `x` is a {what} (it yields the batches, "
                       f"as in Keras). Received: {name}={value!r}")
  try:
    adapter = compat.data_adapter(x, steps=steps, shuffle=shuffle, class_weight=class_weight)
    dataset = adapter.get_tf_dataset()
  except (ValueError, TypeError, StopIteration) as e:
    raise ValueError(f"cannot read batches from the {what}: {e}") from None
  num_batches = adapter.num_batches
  hooks = [_HOOKS[use](adapter)]
  if steps is None and num_batches is None:
    if isinstance(x, keras.utils.PyDataset):
      raise ValueError(
          f"the {what} has no length (num_batches is None: infinite): give `steps_per_epoch` "
          "(fit, and `validation_steps` for validation data) or `steps` (evaluate, predict)")
    # A generator of unknown length: the schedule is planned before the epoch, so its batches
    # are read first (held in memory); it feeds one pass, as in Keras, which stops there.
    batches = list(dataset)
    if not batches:
      raise ValueError(f"the {what} yielded no batches")
    spec = dataset.element_spec
    dataset = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    num_batches = len(batches)
    if use == "train":
      hooks.append(_OnePass())
  if num_batches is not None:
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
  return dataset, None, hooks


def feature_arrays(x, names):
  """x as a tuple of arrays in the model's input order."""
  if isinstance(x, dict):
    unknown = sorted(set(x) - set(names))
    missing = [n for n in names if n not in x]
    if unknown or missing:
      raise ValueError(f"dict inputs are keyed by the model's input names {names}. Received "
                       f"keys {sorted(x)}" + (f" (unknown: {unknown})" if unknown else "") +
                       (f" (missing: {missing})" if missing else ""))
    return tuple(np.asarray(x[n]) for n in names)
  if isinstance(x, (list, tuple)):
    if len(x) != len(names):
      raise ValueError(f"the model has {len(names)} inputs {names}; `x` is a list of {len(x)} "
                       "arrays")
    return tuple(np.asarray(a) for a in x)
  return (np.asarray(x),)


def _by_name(names):
  """Maps dict inputs of a dataset element to the model's input order."""
  def order(*element):
    x, rest = element[0], element[1:]
    if isinstance(x, dict):
      missing = [n for n in names if n not in x]
      if missing:
        raise ValueError(f"the dataset's dict inputs lack the model's inputs {missing} "
                         f"(keys: {sorted(x)})")
      x = tuple(x[n] for n in names)
    return (x,) + rest if rest else x
  return order


def validation_split(x, y, sample_weight, split):
  """Keras's `validation_split`: the last `split` of the arrays (before shuffling) validate."""
  if not isinstance(split, (int, float)) or isinstance(split, bool) or not 0 <= split < 1:
    raise ValueError(f"`validation_split` must be a float in [0, 1). Received: {split!r}")
  if isinstance(x, tf.data.Dataset):
    raise ValueError("`validation_split` splits arrays; with a tf.data.Dataset give "
                     "`validation_data`")
  arrays = x if isinstance(x, (list, tuple)) else list(x.values()) if isinstance(x, dict) else [x]
  n = len(arrays[0])
  at = int(math.floor(n * (1.0 - split)))
  if at == 0 or at == n:
    raise ValueError(f"validation_split={split} of {n} samples leaves "
                     f"{'no training' if at == 0 else 'no validation'} samples")
  cut = lambda a, s: None if a is None else (
      {k: np.asarray(v)[s] for k, v in a.items()} if isinstance(a, dict) else
      [np.asarray(v)[s] for v in a] if isinstance(a, (list, tuple)) else np.asarray(a)[s])
  train = (cut(x, slice(0, at)), cut(y, slice(0, at)), cut(sample_weight, slice(0, at)))
  val = (cut(x, slice(at, None)), cut(y, slice(at, None)), cut(sample_weight, slice(at, None)))
  return train, val


def _class_index(y):
  """Class indices of labels: sparse (n,) or (n, 1), or one-hot (n, C)."""
  if len(y.shape) > 1 and y.shape[-1] != 1:
    return np.argmax(y, axis=-1)
  return np.round(np.reshape(y, (-1,))).astype("int64")


def class_weights(y, class_weight):
  """Keras's `class_weight` as per-sample weights (classes not named weigh 1)."""
  if not isinstance(class_weight, dict):
    raise ValueError(f"`class_weight` must be a dict {{class index: weight}}. Received: "
                     f"{class_weight!r}")
  y = np.asarray(y)
  if y.ndim > 2:
    raise ValueError(f"`class_weight` needs labels of rank 1 or 2. Received labels of shape "
                     f"{y.shape}")
  return np.array([class_weight.get(int(c), 1.0) for c in _class_index(y)], "float32")


def _class_weight_map(class_weight):
  """A dataset map adding class weights as sample weights."""
  size = max(int(c) for c in class_weight) + 1
  table = np.ones(size, "float32")
  for c, w in class_weight.items():
    table[int(c)] = w
  table = tf.constant(table)

  def add(x, y, *rest):
    if rest:
      raise ValueError("`class_weight` cannot be combined with a dataset that yields "
                       "sample weights")
    index = (tf.argmax(y, -1) if y.shape.rank > 1 and y.shape[-1] != 1
             else tf.reshape(tf.cast(tf.round(tf.cast(y, tf.float32)), tf.int64), [-1]))
    weights = tf.gather(table, tf.clip_by_value(index, 0, size - 1))
    return x, y, tf.where(index < size, weights, tf.ones_like(weights))
  return add


def as_dataset(x, y=None, batch_size=None, steps=None, shuffle=False, seed=None, labels=True,
               sample_weight=None, class_weight=None, names=None):
  """Returns (dataset, num_batches) for a batched tf.data.Dataset or arrays.

  A dataset must already be batched; its cardinality gives the batch count
  unless `steps` is given. Arrays are batched with `batch_size` (default 32).
  `names`: the model's input names (dict inputs), see `input_names`.
  """
  if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
    raise ValueError(f"`steps` must be a positive integer. Received: {steps!r}")
  names = names or ["input"]
  if is_iterable_data(x):
    raise ValueError(f"a {type(x).__name__} goes through `adapted` first")
  if class_weight is not None and sample_weight is not None:
    raise ValueError("`sample_weight` and `class_weight` cannot both be given (as in Keras): "
                     "fold the class weights into the sample weights")
  if isinstance(x, tf.data.Dataset):
    dataset = _given_dataset(x, y, batch_size, labels, sample_weight, class_weight, names)
  else:
    dataset = _array_dataset(x, y, batch_size, shuffle, seed, labels, sample_weight,
                             class_weight, names)
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


def _given_dataset(x, y, batch_size, labels, sample_weight, class_weight, names):
  """`as_dataset` for a batched tf.data.Dataset `x`: named inputs put in order, class weights
  mapped in."""
  if y is not None:
    raise ValueError("`y` must be None when `x` is a tf.data.Dataset (it yields (x, y) pairs)")
  if sample_weight is not None:
    raise ValueError("`sample_weight` must be None when `x` is a tf.data.Dataset (it yields "
                     "(x, y, sample_weight))")
  if batch_size is not None:
    raise ValueError(
        f"`batch_size` must be None for a tf.data.Dataset (batch the dataset). "
        f"Received: batch_size={batch_size}")
  dataset = x
  first = dataset.element_spec[0] if isinstance(dataset.element_spec, tuple) else (
      dataset.element_spec)
  if isinstance(first, dict):
    dataset = dataset.map(_by_name(names))
  if class_weight is not None:
    if not labels:
      raise ValueError("`class_weight` needs labels")
    dataset = dataset.map(_class_weight_map(class_weight))
  return dataset


def _array_dataset(x, y, batch_size, shuffle, seed, labels, sample_weight, class_weight,
                   names):
  """`as_dataset` for arrays: checked, then batched (`batch_size`, default 32)."""
  if x is None:
    raise ValueError("no input data: `x` is None")
  if labels and y is None:
    raise ValueError("`y` is needed with array inputs when training or evaluating")
  batch_size = 32 if batch_size is None else batch_size
  if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
    raise ValueError(f"`batch_size` must be a positive integer. Received: batch_size={batch_size!r}")
  features = feature_arrays(x, names)
  n = len(features[0])
  if n == 0:
    raise ValueError("`x` is empty (0 samples): nothing to train or evaluate on")
  if any(len(a) != n for a in features):
    raise ValueError(f"every input array needs the same number of samples. Received: "
                     f"{[len(a) for a in features]}")
  if labels:
    if isinstance(y, (list, tuple, dict)):   # several outputs' labels (tf.data: a tuple)
      y = keras.tree.map_structure(np.asarray, y)
      y = tuple(y) if isinstance(y, (list, tuple)) else y
    lengths = {len(a) for a in keras.tree.flatten(y)}
    if lengths != {n}:
      raise ValueError(f"`x` and `y` must have the same length. Received: {n} and "
                       f"{sorted(lengths) if len(lengths) > 1 else lengths.pop()}")
  if class_weight is not None:
    sample_weight = class_weights(y, class_weight)
  if sample_weight is not None:
    sample_weight = np.asarray(sample_weight)
    if len(sample_weight) != n:
      raise ValueError(f"`sample_weight` needs one weight per sample ({n}). Received: "
                       f"{len(sample_weight)}")
  features = features[0] if len(features) == 1 else features   # one input stays bare
  data = (features,) + ((y if isinstance(y, (list, tuple, dict)) else np.asarray(y),)
                        if labels else ()) + (
      (sample_weight,) if sample_weight is not None and labels else ())
  dataset = tf.data.Dataset.from_tensor_slices(data if labels else features)
  if shuffle:
    dataset = dataset.shuffle(n, seed=seed, reshuffle_each_iteration=True)
  dataset = dataset.batch(batch_size).prefetch(2)
  return dataset


def flat_labels(dataset, output_names):
  """A dataset of (x, y[, sample_weight]) elements whose `y` holds the labels of several outputs
  (a list in the model's output order, or a dict by output name) with `y` as a tuple in the
  model's output order: what the stages carry and split (`StageProgram` gives the loss and
  metrics Keras's structure back)."""
  def flat(x, y, *rest):
    if isinstance(y, dict):
      missing = [name for name in output_names if name not in y]
      if missing:
        raise ValueError(f"the labels lack the model's outputs {missing} (keys: {sorted(y)})")
      y = tuple(y[name] for name in output_names)
    else:
      y = tuple(keras.tree.flatten(y))
      if len(y) != len(output_names):
        raise ValueError(f"the model has {len(output_names)} outputs {output_names}; the "
                         f"labels hold {len(y)}")
    return (x, y) + rest
  return dataset.map(flat)
