"""A Pipeline's data: `fit`/`evaluate`/`predict` arguments checked and made into datasets.

Everything here runs before any training work, so bad input is refused with
the argument's name and value (`tfpipe.training.data`, `tfpipe.training.input_checks`).
"""

import keras
import tensorflow as tf

from tfpipe.training import data, input_checks

__all__ = ["dataset", "last_batch", "validation", "check_fit_arguments", "batch_size_of"]


def dataset(pipe, x, y=None, batch_size=None, steps=None, shuffle=False, seed=None,
            labels=True, sample_weight=None, class_weight=None, micro_batches=1):
  """(dataset, batch count) for `x`, checked against `pipe`'s model (and, for arrays, that
  every batch splits into `micro_batches`)."""
  names = data.input_names(pipe.model)
  result, num_batches = data.as_dataset(
      x, y, batch_size, steps, shuffle, seed, labels=labels, sample_weight=sample_weight,
      class_weight=class_weight, names=names)
  if micro_batches > 1:
    last = last_batch(pipe, x, batch_size, steps)
    n, size = (len(data.feature_arrays(x, names)[0]), batch_size or 32) if last else (0, 0)
    if 0 < last < micro_batches:
      raise ValueError(
          f"the last batch of {last} samples ({n} in batches of {size}) cannot be "
          f"split into micro_batches={micro_batches}: use a batch size that leaves no smaller "
          f"last batch, or fewer micro-batches{pipe.options.micro_batch_hint()}")
  input_checks.check_inputs(result, pipe.model, names, labelled=labels)
  if labels and len(pipe.model.outputs) > 1:   # several outputs: their labels as one tuple
    if class_weight is not None:
      raise ValueError("`class_weight` is only supported for models with a single output, "
                       "as in Keras: give per-output sample weights in the labels' losses")
    result = data.flat_labels(result, list(pipe.model.output_names))
  elif labels:
    input_checks.check_labels(y, pipe.model, pipe.step.user_loss, result.element_spec[1])
  if labels:
    pipe.step.build(result.element_spec[1])
  return result, num_batches


def last_batch(pipe, x, batch_size=None, steps=None):
  """The size of the smaller last batch arrays `x` make in batches of `batch_size` (Keras's
  default 32) where the fit reaches it; 0 where there is none, or for a dataset."""
  if isinstance(x, tf.data.Dataset):
    return 0
  n, size = len(data.feature_arrays(x, data.input_names(pipe.model))[0]), batch_size or 32
  reached = steps is None or steps >= -(-n // size)
  return n % size if reached else 0


def validation(pipe, validation_data, batch_size, validation_batch_size, validation_steps):
  """((the validation dataset, its batch count), callbacks that run a Keras data adapter's
  hooks around each validation), checked before training starts."""
  if isinstance(validation_data, (tuple, list)):
    val_x, val_y, val_w = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
  else:
    val_x, val_y, val_w = validation_data, None, None
  val_x, _, hooks = data.adapted(val_x, val_y, val_w, validation_batch_size, validation_steps,
                                 use="test")
  if isinstance(val_x, tf.data.Dataset):
    if validation_batch_size is not None:
      raise ValueError("`validation_batch_size` must be None when `validation_data` is a "
                       f"tf.data.Dataset (batch the dataset). Received: {validation_batch_size}")
    size = None
  else:
    size = validation_batch_size or batch_size
  return dataset(pipe, val_x, val_y, size, validation_steps, sample_weight=val_w), hooks


def check_fit_arguments(pipe, epochs, initial_epoch, validation_freq, batch_size):
  """Refuses `fit` arguments that cannot run on `pipe`, naming them."""
  changed = [name for p in pipe.programs for name in p.trainable_changed()]
  if changed:
    raise ValueError(
        f"layer {changed[0]!r} changed `trainable` since `compile`"
        + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        + ": call `compile` again so the stages train the new set of weights (Keras, too, "
        "takes a change of `trainable` at compile)")
  if not isinstance(epochs, int) or epochs < 1:
    raise ValueError(f"`epochs` must be a positive integer. Received: epochs={epochs!r}")
  if not isinstance(initial_epoch, int) or not 0 <= initial_epoch:
    raise ValueError(f"`initial_epoch` must be an integer >= 0. Received: {initial_epoch!r}")
  if not (isinstance(validation_freq, int) and validation_freq >= 1) and not isinstance(
      validation_freq, list):
    raise ValueError("`validation_freq` must be a positive integer or a list of epochs "
                     f"(1-based). Received: validation_freq={validation_freq!r}")
  micro_batches = pipe.options.micro_batches
  if isinstance(batch_size, int) and batch_size < micro_batches:
    raise ValueError(
        f"`batch_size` must be at least micro_batches={micro_batches}. Received: "
        f"batch_size={batch_size}{pipe.options.micro_batch_hint()}")
  most = max(list(pipe.stage_replicas.values()) + [pipe.data_parallel])
  if isinstance(batch_size, int) and batch_size // micro_batches < most:
    raise ValueError(
        f"a replicated stage splits each (micro-)batch over {most} devices: `batch_size` must "
        f"be at least {most * micro_batches}. Received: batch_size={batch_size}"
        f"{pipe.options.micro_batch_hint()}")


def input_shapes(dataset):
  """The shapes of `dataset`'s inputs (its x, flattened), batch axis first; None where the
  elements are not (x, ...) tuples of tensors."""
  spec = dataset.element_spec
  x = spec[0] if isinstance(spec, tuple) else spec
  shapes = [getattr(s, "shape", None) for s in tf.nest.flatten(x)]
  if any(shape is None or shape.rank is None for shape in shapes):
    return None
  return [tuple(shape) for shape in shapes]


def batch_size_of(dataset):
  """The static batch size of `dataset`'s first input, or None where it is not known."""
  first = tf.nest.flatten(dataset.element_spec)[0]
  shape = getattr(first, "shape", None)
  if shape is None or shape.rank in (None, 0):
    return None
  return shape[0]
