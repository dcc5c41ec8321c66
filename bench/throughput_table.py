"""Samples/s of every method at each stage count, measured in one run, with ratios to single
device and to dataparallel, and each pipeline's time breakdown (SpecTrain paper fig. 9-10).

Trains the quickstart SNN (default 8 x 512 SELU) on synthetic 784-feature
inputs; each runner trains --steps steps and its throughput is taken over
the window of steps (the paper: the 50th to the 250th iteration). The stage
counts share this machine's cores: K logical CPUs on 2 cores here. Writes
bench/results/throughput.md.

  python bench/throughput_table.py [--stages=2,4 --steps=80 --window=10,79]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common, results_io  # noqa: E402

flags.DEFINE_list("methods", None, "pipeline methods (default: all)")
flags.DEFINE_list("stages", ["2", "4"], "stage counts (devices for dataparallel)")
common.define(width=512, depth=8, batch_size=64, results_dir=results_io.RESULTS)
flags.DEFINE_integer("steps", 80, "steps each runner trains")
flags.DEFINE_list("window", ["10", "79"], "FIRST,LAST step of the throughput window")
FLAGS = flags.FLAGS


def measure(method, K, x, y, window):
  import keras
  import tfpipe
  from tfpipe.rules import optimizers
  from tfpipe.models import mlp
  from tfpipe.instruments.throughput import ThroughputMeter
  keras.utils.set_random_seed(0)
  model = mlp.snn(x.shape[1:], 10, width=FLAGS.width, depth=FLAGS.depth)
  pipelined = method in tfpipe.PIPELINE_METHODS
  trainer = tfpipe.create(model, method, num_stages=K, **({"record": True} if pipelined else {}))
  trainer.compile(optimizers.SpecTrain(0.01, 0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  meter = ThroughputMeter(FLAGS.batch_size, window)
  trainer.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False,
              callbacks=[meter])
  return meter.samples_per_second(), (trainer.breakdown() if pipelined else None)


def _breakdown_cell(result):
  """Per stage: compute / transfer+idle_transfer / idle_imbalance, in percent."""
  return " ".join(f"{100 * s['compute']:.0f}/{100 * (s['transfer'] + s['idle_transfer']):.0f}/"
                  f"{100 * s['idle_imbalance']:.0f}" for s in result.shares)


def main(argv):
  del argv
  import tfpipe
  stage_counts = [int(k) for k in FLAGS.stages]
  tfpipe.devices.ensure_logical_cpus(max(stage_counts), intra_op_threads=1)
  window = tuple(int(w) for w in FLAGS.window)
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.steps
  x = rng.standard_normal((n, 784)).astype("float32")
  y = rng.integers(0, 10, n)
  methods = FLAGS.methods or list(tfpipe.PIPELINE_METHODS)
  single, _ = measure("single", 1, x, y, window)
  print(f"single: {single:.0f} samples/s", flush=True)
  rows = [["single", 1, f"{single:.0f}", "1.00", "-", "-"]]
  for K in stage_counts:
    dp, _ = measure("dataparallel", K, x, y, window)
    rows.append(["dataparallel", K, f"{dp:.0f}", f"{dp / single:.2f}", "1.00", "-"])
    print(f"dataparallel K={K}: {dp:.0f} samples/s", flush=True)
    for method in methods:
      rate, result = measure(method, K, x, y, window)
      rows.append([method, K, f"{rate:.0f}", f"{rate / single:.2f}", f"{rate / dp:.2f}",
                   _breakdown_cell(result)])
      print(f"{method} K={K}: {rate:.0f} samples/s", flush=True)
  title = (f"snn {FLAGS.depth} x {FLAGS.width} on synthetic data, batch {FLAGS.batch_size}, "
           f"samples/s over steps {window[0]}..{window[1]}; K logical CPUs on this machine's "
           "cores. Breakdown per stage: compute / transfer (incl. waiting for it) / "
           "imbalance idle, % of wall time")
  table = results_io.markdown_table(
      ["method", "stages", "samples/s", "/ single", "/ dataparallel", "breakdown per stage"],
      rows)
  results_io.report(FLAGS.results_dir, "throughput.md", title, table)


if __name__ == "__main__":
  app.run(main)
