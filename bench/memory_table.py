"""Per-stage memory of every pipeline method: weights, weight versions, activations, optimizer
slots and gradient accumulators, measured by a short run (the SpecTrain paper's and Kang's
model-parallelism report's memory arguments: PipeDream stashes K-k versions, SpecTrain-repredict and
vanilla
none, GPipe M micro-batches of activations).

Trains the quickstart SNN (8 x 512 SELU on digits' 64 features) for a few
steps with every method and reads `tfpipe.instruments.memory.stage_memory`. Writes
bench/results/memory.md.

  python bench/memory_table.py [--num_stages=4 --batch_size=32]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common, results_io  # noqa: E402

flags.DEFINE_list("methods", None, "pipeline methods (default: all, plus spectrain repredict)")
flags.DEFINE_integer("num_stages", 4, "stages")
common.define(batch_size=32, width=512, depth=8, results_dir=results_io.RESULTS)
flags.DEFINE_integer("steps", 12, "steps to train (enough to fill the pipeline)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import keras
  import tfpipe
  from tfpipe.rules import optimizers
  from tfpipe.instruments import memory
  from tfpipe.models import mlp
  K = FLAGS.num_stages
  tfpipe.devices.ensure_logical_cpus(K, intra_op_threads=1)
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.steps
  x, y = rng.standard_normal((n, 64)).astype("float32"), rng.integers(0, 10, n)
  runs = [(m, {}) for m in (FLAGS.methods or tfpipe.PIPELINE_METHODS)]
  if not FLAGS.methods:
    runs.append(("spectrain", {"spectrain_backward": "repredict"}))
  rows = []
  for method, options in runs:
    keras.utils.set_random_seed(0)
    pipe = tfpipe.Pipeline(mlp.snn((64,), 10, width=FLAGS.width, depth=FLAGS.depth),
                           num_stages=K, method=method, **options)
    pipe.compile(optimizers.SpecTrain(0.01, 0.9),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pipe.fit(x, y, batch_size=FLAGS.batch_size, verbose=0, shuffle=False)
    label = method + ("" if not options else f" ({options['spectrain_backward']})")
    for k, row in enumerate(memory.stage_memory(pipe, FLAGS.batch_size)):
      rows.append([label if k == 0 else "", k] +
                  [f"{row[f] / 1024:.0f}" for f in memory.FIELDS + ("total",)])
    print(f"{label}: done", flush=True)
  title = (f"snn {FLAGS.depth} x {FLAGS.width}, {K} stages, batch {FLAGS.batch_size} "
           f"(micro-batches: gpipe and timeprest 4); KiB per stage at the peak the run measured")
  table = results_io.markdown_table(["method", "stage"] + list(memory.FIELDS) + ["total"], rows)
  results_io.report(FLAGS.results_dir, "memory.md", title, table)


if __name__ == "__main__":
  app.run(main)
