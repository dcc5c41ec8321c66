"""Datasets: tfds (cifar10, mnist, imdb_reviews), scikit-learn's digits, synthetic images or
vectors, synthetic text (token ids), and generated tasks hard enough to separate the pipeline
methods (`bench/staleness.py`): classes, teacher and regions (vectors), shapes (images),
counting (token sequences)."""

import collections
import os

import numpy as np
import tensorflow as tf

from tfpipe.plan import names
from trainers import text

__all__ = ["DATASETS", "DataUnavailableError", "Data", "load"]

DATASETS = ("digits", "synthetic", "synthetic_text", "classes", "teacher", "regions", "shapes",
            "counting", "cifar10", "mnist", "imdb_reviews") + text.TEXT_DATASETS
TASK_SIZES = (8000, 2000)   # the generated tasks: training and validation examples
COUNTING_VOCAB, COUNTING_LENGTH, COUNTING_KEYS = 16, 20, 10
SYNTHETIC_VOCAB = 1000

Data = collections.namedtuple(
    "Data", ["train", "validation", "input_shape", "num_classes", "train_size", "vocab_size"],
    defaults=(None,))


class DataUnavailableError(RuntimeError):
  """The dataset is not on this machine and cannot be downloaded here."""


def _from_arrays(x_train, y_train, x_val, y_val, batch_size, seed, num_classes, vocab_size=None):
  train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
           .shuffle(len(x_train), seed=seed, reshuffle_each_iteration=True)
           .batch(batch_size, drop_remainder=True).prefetch(4))
  val = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size).prefetch(4)
  return Data(train, val, tuple(x_train.shape[1:]), num_classes, len(x_train), vocab_size)


def _digits(config):
  from sklearn.datasets import load_digits
  digits = load_digits()
  x = (digits.data / 16.0).astype("float32")
  y = digits.target.astype("int64")
  order = np.random.default_rng(config.seed).permutation(len(x))
  x, y = x[order], y[order]
  split = int(0.8 * len(x))
  return _from_arrays(x[:split], y[:split], x[split:], y[split:], config.batch_size, config.seed, 10)


def _synthetic(config):
  """Random inputs labelled by a fixed random linear map: learnable, for throughput."""
  rng = np.random.default_rng(config.seed)
  shape, classes = tuple(config.synthetic_shape), 10
  n_val = max(config.batch_size, config.synthetic_samples // 8)
  x = rng.standard_normal((config.synthetic_samples + n_val,) + shape).astype("float32")
  projection = rng.standard_normal((int(np.prod(shape)), classes)).astype("float32")
  y = np.argmax(x.reshape(len(x), -1) @ projection, axis=1).astype("int64")
  n = config.synthetic_samples
  return _from_arrays(x[:n], y[:n], x[n:], y[n:], config.batch_size, config.seed, classes)


def _split_task(x, y, config, classes):
  """The fixed examples of a generated task; --seed only reorders the training split."""
  n, n_val = TASK_SIZES
  x = ((x - x[:n].mean(0)) / (x[:n].std(0) + 1e-8)).astype("float32")
  return _from_arrays(x[:n], y[:n].astype("int64"), x[n:n + n_val], y[n:n + n_val].astype("int64"),
                      config.batch_size, config.seed, classes)


def _classes(config):
  """scikit-learn's make_classification: 20 classes of 2 Gaussian clusters each in 40
  dimensions (30 informative), 2% labels flipped. The task itself is fixed (its own seed)."""
  from sklearn.datasets import make_classification
  x, y = make_classification(n_samples=sum(TASK_SIZES), n_features=40, n_informative=30,
                             n_redundant=5, n_classes=20, n_clusters_per_class=2, class_sep=1.5,
                             flip_y=0.02, random_state=1234)
  return _split_task(x, y, config, 20)


def _teacher(config):
  """Inputs N(0, I) in 12 dimensions labelled by a fixed random teacher network (3 tanh layers
  of 64, 10 logits, argmax): a smooth but deep decision function."""
  rng = np.random.default_rng(1234)
  x = rng.standard_normal((sum(TASK_SIZES), 12))
  h = x
  for width in (64, 64, 64):
    h = np.tanh(h @ rng.standard_normal((h.shape[1], width)) * (1.5 / np.sqrt(h.shape[1])))
  y = np.argmax(h @ rng.standard_normal((h.shape[1], 10)), axis=1)
  return _split_task(x, y, config, 10)


def _regions(config):
  """20 dimensions, 10 classes, each the union of the Voronoi cells of 4 random centres
  (40 in all): a piecewise-linear decision function with many regions, 3% labels flipped."""
  rng = np.random.default_rng(1234)
  centres = rng.standard_normal((40, 20))
  x = rng.standard_normal((sum(TASK_SIZES), 20))
  nearest = np.argmin(((x[:, None, :] - centres[None]) ** 2).sum(-1), axis=1)
  y = nearest % 10
  flip = rng.random(len(y)) < 0.03
  y[flip] = rng.integers(0, 10, flip.sum())
  return _split_task(x, y, config, 10)


def _shapes(config):
  """16 x 16 one-channel images, 10 classes: each class a fixed smooth random template,
  drawn at a random shift (up to 4 pixels, wrapping), random contrast, and noise."""
  rng = np.random.default_rng(1234)
  n = sum(TASK_SIZES)
  freq = np.fft.fftfreq(16)
  low = (np.abs(freq)[:, None] < 0.2) & (np.abs(freq)[None, :] < 0.2)
  templates = np.real(np.fft.ifft2(np.fft.fft2(rng.standard_normal((10, 16, 16))) * low))
  templates /= templates.std(axis=(1, 2), keepdims=True)
  y = rng.integers(0, 10, n)
  shifts = rng.integers(-4, 5, (n, 2))
  x = np.stack([np.roll(templates[c], tuple(d), axis=(0, 1)) for c, d in zip(y, shifts)])
  x = x * rng.uniform(0.5, 1.5, (n, 1, 1)) + 1.2 * rng.standard_normal(x.shape)
  n_train, n_val = TASK_SIZES
  x = ((x - x[:n_train].mean()) / x[:n_train].std()).astype("float32")[..., None]
  return _from_arrays(x[:n_train], y[:n_train].astype("int64"), x[n_train:], y[n_train:].astype(
      "int64"), config.batch_size, config.seed, 10)


def _counting(config):
  """Sequences of 20 tokens of a 16-token vocabulary; the label is which of the 10 key tokens
  (ids 0-9) occurs most often (ties: the lowest id). Needs counting over the whole
  sequence: an attention or recurrent model's task."""
  rng = np.random.default_rng(1234)
  n = sum(TASK_SIZES)
  x = rng.integers(0, COUNTING_VOCAB, (n, COUNTING_LENGTH))
  counts = np.stack([(x == t).sum(1) for t in range(COUNTING_KEYS)], axis=1)
  y = np.argmax(counts, axis=1)
  n_train, n_val = TASK_SIZES
  return _from_arrays(x[:n_train].astype("int32"), y[:n_train].astype("int64"),
                      x[n_train:].astype("int32"), y[n_train:].astype("int64"),
                      config.batch_size, config.seed, COUNTING_KEYS, COUNTING_VOCAB)


def _synthetic_text(config):
  """Random token ids; the label says whether low ids (< V/2) are the majority: learnable by
  counting, for sequence models offline."""
  rng = np.random.default_rng(config.seed)
  n, n_val = config.synthetic_samples, max(config.batch_size, config.synthetic_samples // 8)
  x = rng.integers(0, SYNTHETIC_VOCAB, (n + n_val, config.sequence_length)).astype("int32")
  y = (np.mean(x < SYNTHETIC_VOCAB // 2, axis=1) > 0.5).astype("int64")
  return _from_arrays(x[:n], y[:n], x[n:], y[n:], config.batch_size, config.seed, 2,
                      SYNTHETIC_VOCAB)


def _tfds(config, name):
  import tensorflow_datasets as tfds
  data_dir = config.data_dir or os.environ.get("TFDS_DATA_DIR")
  try:
    splits, info = tfds.load(name, split=["train", "test"], data_dir=data_dir, download=False,
                             as_supervised=True, with_info=True)
  except Exception as e:  # tfds raises assertion or not-found errors of several kinds
    del e   # tfds's own message names its internals, not what to do
    raise DataUnavailableError(_unavailable(name, data_dir)) from None
  train, val = splits
  classes = info.features["label"].num_classes
  if name == "imdb_reviews":
    vectorize = tf.keras.layers.TextVectorization(
        max_tokens=20000, output_sequence_length=config.sequence_length)
    vectorize.adapt(train.map(lambda text, label: text).batch(1024))
    to_ids = lambda text, label: (vectorize(text), label)
    sized = lambda ds, split: ds.batch(1024).map(to_ids).unbatch().apply(
        tf.data.experimental.assert_cardinality(info.splits[split].num_examples))
    train, val = sized(train, "train"), sized(val, "test")
    shape = (config.sequence_length,)
  else:
    scale = lambda image, label: (tf.cast(image, tf.float32) / 255.0, label)
    train, val = train.map(scale), val.map(scale)
    shape = tuple(info.features["image"].shape)
  size = info.splits["train"].num_examples
  train = (train.shuffle(10000, seed=config.seed, reshuffle_each_iteration=True)
           .batch(config.batch_size, drop_remainder=True).prefetch(4))
  vocab = vectorize.vocabulary_size() if name == "imdb_reviews" else None
  return Data(train, val.batch(config.batch_size).prefetch(4), shape, classes, size, vocab)


def _grammar_text(config):
  """Sentences of a small English grammar, made here (`text.grammar`): 90% to train on."""
  corpus = text.grammar()
  split = int(0.9 * len(corpus))
  return _text(corpus[:split], corpus[split:], config)


def _tiny_shakespeare(config):
  """TensorFlow Datasets' tiny_shakespeare (one text per split)."""
  import tensorflow_datasets as tfds
  data_dir = config.data_dir or os.environ.get("TFDS_DATA_DIR")
  try:
    splits = tfds.load("tiny_shakespeare", split=["train", "validation"], data_dir=data_dir,
                       download=False)
  except Exception as e:  # tfds raises assertion or not-found errors of several kinds
    del e
    raise DataUnavailableError(_unavailable("tiny_shakespeare", data_dir)) from None
  train, val = [next(iter(s))["text"].numpy().decode("utf-8") for s in splits]
  return _text(train, val, config)


def _text(train_text, validation_text, config):
  train, val, vocab, size = text.from_text(train_text, validation_text, config.sequence_length,
                                          config.batch_size, config.seed)
  return Data(train, val, (config.sequence_length,), vocab, size, vocab)


def _unavailable(name, data_dir):
  where = data_dir or "the default tfds directory (~/tensorflow_datasets)"
  return (f"dataset {name!r} is not in {where} and cannot be downloaded here: run "
          f"tfds.load('{name}', data_dir='DIR') on a machine with internet access, copy DIR "
          "here and pass --data_dir=DIR (or set TFDS_DATA_DIR=DIR)")


def load(config):
  """The training and validation data of `config.dataset`, batched by `config.batch_size`."""
  name = names.lookup("dataset", config.dataset, DATASETS)
  offline = {"digits": _digits, "synthetic": _synthetic, "synthetic_text": _synthetic_text,
             "classes": _classes, "teacher": _teacher, "regions": _regions, "shapes": _shapes,
             "counting": _counting, "grammar_text": _grammar_text,
             "tiny_shakespeare": _tiny_shakespeare}
  return offline[name](config) if name in offline else _tfds(config, name)
