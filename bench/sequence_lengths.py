"""Bucketed sequence lengths against one fixed length: traces, first epoch, time per token.

A KerasHub Llama built from config (`--layers` decoder layers of width `--hidden`, a
per-token head) trains through `--method` at K = `--stages`, M = `--micro_batches`, with
AdamW, on two streams of the same token count: every batch `--fixed` tokens long, and
batches bucketed by length (`--lengths`, in turn). Keras `fit` on one device runs the same
streams beside. For each: the windows traced (tfpipe) and the retracing warnings TensorFlow
printed, the first epoch's seconds, and the second epoch's microseconds per token; then
bucketed / fixed per token.

  python bench/sequence_lengths.py [--lengths=32,48,64,80,96 --fixed=64]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402

flags.DEFINE_integer("layers", 4, "decoder layers")
flags.DEFINE_integer("hidden", 64, "hidden width")
flags.DEFINE_integer("vocabulary", 256, "vocabulary size")
flags.DEFINE_list("lengths", ["32", "48", "64", "80", "96"], "the buckets' sequence lengths")
flags.DEFINE_integer("fixed", 64, "the fixed-length stream's sequence length")
common.define(batch_size=16, micro_batches=4)
flags.DEFINE_integer("rounds", 4, "batches of each bucket per epoch")
flags.DEFINE_integer("stages", 2, "K")
flags.DEFINE_string("method", "1f1b", "the pipeline method")
flags.DEFINE_string("steps_per_execution", None, "Keras's and the pipeline's window "
                    "(default: each's own)")
FLAGS = flags.FLAGS


class _Retraces(logging.Handler):
  """Counts TensorFlow's "triggered tf.function retracing" warnings."""

  def __init__(self):
    super().__init__()
    self.count = 0

  def emit(self, record):
    self.count += "retracing" in record.getMessage()


def _model(keras, keras_hub):
  keras.utils.set_random_seed(0)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers, num_query_heads=4,
      num_key_value_heads=2, hidden_dim=FLAGS.hidden, intermediate_dim=2 * FLAGS.hidden)
  head = keras.layers.Dense(FLAGS.vocabulary, name="lm_head")(backbone.output)
  return keras.Model(backbone.inputs, head, name="llama_lm")


def _stream(tf, lengths):
  """Batches of `lengths` in turn, `--rounds` times: (dataset, tokens per epoch)."""
  rng = np.random.default_rng(0)
  parts, tokens = [], 0
  for _ in range(FLAGS.rounds):
    for length in lengths:
      ids = rng.integers(1, FLAGS.vocabulary, (FLAGS.batch_size, length + 1)).astype("int32")
      x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((FLAGS.batch_size, length), "int32")}
      parts.append(tf.data.Dataset.from_tensors((x, ids[:, 1:])))
      tokens += FLAGS.batch_size * length
  data = parts[0]
  for part in parts[1:]:
    data = data.concatenate(part)
  return data, tokens


def _run(trainer, data, tokens, counter):
  """(traces, retracing warnings, first epoch s, second epoch us per token)."""
  before = counter.count
  start = time.perf_counter()
  trainer.fit(data, epochs=1, verbose=0)
  first = time.perf_counter() - start
  start = time.perf_counter()
  trainer.fit(data, epochs=1, verbose=0)
  second = time.perf_counter() - start
  runtime = getattr(trainer, "runtime", None)
  traces = runtime.traces if runtime is not None else "-"
  return traces, counter.count - before, first, 1e6 * second / tokens


def main(argv):
  del argv
  import tfpipe
  devices = tfpipe.devices.ensure_logical_cpus(FLAGS.stages, intra_op_threads=1)
  import keras
  import keras_hub
  import tensorflow as tf
  counter = _Retraces()
  logging.getLogger("tensorflow").addHandler(counter)
  streams = {"fixed": _stream(tf, [FLAGS.fixed] * len(FLAGS.lengths)),
             "bucketed": _stream(tf, [int(n) for n in FLAGS.lengths])}
  window = ({} if FLAGS.steps_per_execution is None else
            {"steps_per_execution": int(FLAGS.steps_per_execution)})
  compile_args = lambda: dict(optimizer=keras.optimizers.AdamW(1e-3),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              **window)
  rows = {}
  for name, (data, tokens) in streams.items():
    model = _model(keras, keras_hub)
    model.compile(**compile_args())
    with tf.device(devices[0]):
      rows[("keras fit", name)] = _run(model, data, tokens, counter)
    pipe = tfpipe.Pipeline(_model(keras, keras_hub), devices=devices[:FLAGS.stages],
                           method=FLAGS.method, micro_batches=FLAGS.micro_batches)
    pipe.compile(**compile_args())
    rows[(f"{FLAGS.method} K={FLAGS.stages}", name)] = _run(pipe, data, tokens, counter)
    print(f"{name} done", flush=True)
  print(f"\nLlama {FLAGS.layers} x {FLAGS.hidden}, batch {FLAGS.batch_size}; fixed {FLAGS.fixed} "
        f"tokens, bucketed {','.join(FLAGS.lengths)}; {len(FLAGS.lengths) * FLAGS.rounds} "
        "batches an epoch")
  print("| runner | stream | windows traced | retracing warnings | first epoch s | "
        "second epoch us/token | bucketed / fixed |")
  print("|---|---|---|---|---|---|---|")
  for (runner, name), (traces, warned, first, per_token) in rows.items():
    ratio = per_token / rows[(runner, "fixed")][3]
    print(f"| {runner} | {name} | {traces} | {warned} | {first:.1f} | {per_token:.1f} | "
          f"{ratio:.2f} |")


if __name__ == "__main__":
  app.run(main)
