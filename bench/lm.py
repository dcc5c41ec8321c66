"""A causal language model through a pipeline beside Keras `fit`: tokens/s and final loss.

A KerasHub Llama built from config (`--layers` decoder layers, random weights, no download)
with a per-token head over the vocabulary, trained on synthetic token sequences with AdamW
and `global_clipnorm` (what LLM runs set), in each of `--precisions`: Keras `fit` on one
device, then `--methods` at K = `--stages` with M = `--micro_batches`, in one process on
`--stages` logical CPUs (one intra-op thread each). Each trainer runs a first epoch (tracing),
then `--epochs` measured ones; the table gives tokens/s of the measured epochs, its ratio to
Keras's and the final loss. A configuration tfpipe refuses prints its one-line reason.

  python bench/lm.py [--layers=8 --hidden=64 --sequence=32 --batch_size=16 --batches=16]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402

import tfpipe  # noqa: E402

flags.DEFINE_integer("layers", 8, "decoder layers")
flags.DEFINE_integer("hidden", 64, "hidden width")
flags.DEFINE_integer("vocabulary", 512, "vocabulary size")
flags.DEFINE_integer("sequence", 32, "tokens per sequence")
common.define(batch_size=16, batches=16, micro_batches=4)
flags.DEFINE_integer("epochs", 2, "measured epochs after the first")
flags.DEFINE_integer("stages", 4, "K")
flags.DEFINE_list("methods", ["1f1b", "zb"], "pipeline methods")
flags.DEFINE_list("precisions", ["float32", "mixed_bfloat16", "mixed_float16"],
                  "Keras dtype policies")
flags.DEFINE_float("clipnorm", 1.0, "global_clipnorm")
FLAGS = flags.FLAGS


def _model(keras, keras_hub):
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=FLAGS.hidden, intermediate_dim=2 * FLAGS.hidden,
      max_sequence_length=FLAGS.sequence)
  head = keras.layers.Dense(FLAGS.vocabulary, name="lm_head", dtype="float32")(backbone.output)
  return keras.Model(backbone.inputs, head, name="llama_lm")


def _data():
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.batches
  # A learnable stream: each token is the previous one plus a small step, modulo the vocabulary.
  start = rng.integers(0, FLAGS.vocabulary, (n, 1))
  steps = rng.integers(1, 4, (n, FLAGS.sequence + 1))
  tokens = ((start + np.cumsum(steps, axis=1)) % FLAGS.vocabulary).astype("int32")
  return ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, FLAGS.sequence), "int32")},
          tokens[:, 1:])


def _run(trainer, keras, x, y):
  trainer.compile(optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=FLAGS.clipnorm),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  fit = lambda epochs: trainer.fit(x, y, batch_size=FLAGS.batch_size, epochs=epochs,
                                   shuffle=False, verbose=0).history["loss"]
  fit(1)
  start = time.perf_counter()
  losses = fit(FLAGS.epochs)
  seconds = time.perf_counter() - start
  tokens = FLAGS.epochs * FLAGS.batches * FLAGS.batch_size * FLAGS.sequence
  return tokens / seconds, losses[-1]


def main(argv):
  del argv
  tfpipe.create_logical_cpus(FLAGS.stages)
  import keras  # pylint: disable=g-import-not-at-top
  import keras_hub  # pylint: disable=g-import-not-at-top
  x, y = _data()
  print(f"Llama {FLAGS.layers} layers x {FLAGS.hidden}, vocabulary {FLAGS.vocabulary}, "
        f"{FLAGS.sequence} tokens x {FLAGS.batch_size} sequences x {FLAGS.batches} batches, "
        f"AdamW + global_clipnorm={FLAGS.clipnorm}, K={FLAGS.stages}, M={FLAGS.micro_batches}")
  print("| precision | trainer | tokens/s | x Keras | final loss |\n|---|---|---|---|---|")
  for precision in FLAGS.precisions:
    keras.mixed_precision.set_global_policy(precision)
    try:
      base, loss = _run(_model(keras, keras_hub), keras, x, y)
      print(f"| {precision} | Keras fit | {base:.0f} | 1.00 | {loss:.4f} |", flush=True)
      for method in FLAGS.methods:
        label = f"{method} K={FLAGS.stages} M={FLAGS.micro_batches}"
        try:
          pipe = tfpipe.Pipeline(_model(keras, keras_hub), num_stages=FLAGS.stages,
                                 method=method, micro_batches=FLAGS.micro_batches)
          speed, loss = _run(pipe, keras, x, y)
          print(f"| {precision} | {label} | {speed:.0f} | {speed / base:.2f} | {loss:.4f} |",
                flush=True)
        except ValueError as e:
          print(f"| {precision} | {label} | refused: {str(e)[:120]} | | |", flush=True)
    finally:
      keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
  app.run(main)
