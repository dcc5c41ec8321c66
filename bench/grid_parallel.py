"""Batch-only, model-only and integrated batch x model parallelism (Laugier et al.'s integrated
parallelism paper) on the fully
connected workloads: samples/s and the bytes each step moves between devices.

Trains the layer-wise partitioning paper's DNN (7 sigmoid layers) and the SpecTrain paper's SNN
(SELU), both at
--width, on synthetic 784-feature inputs with `tfpipe.tensor_parallel` on
grids of --devices logical CPUs (batch-only D x 1, model-only 1 x D, and the
square grid), beside one device, measured in one run. Writes
bench/results/grid.md.

  python bench/grid_parallel.py [--width=1024 --batch_size=256 --steps=40 --workloads=dnn,snn]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common, results_io  # noqa: E402

common.define(width=1024, batch_size=256, results_dir=results_io.RESULTS)
flags.DEFINE_integer("steps", 40, "steps per runner")
flags.DEFINE_list("workloads", ["dnn", "snn"], "the layer-wise partitioning paper's dnn (7 sigmoid layers), the SpecTrain paper's snn "
                  "(8 SELU layers)")
flags.DEFINE_integer("devices", 4, "devices in every grid (a square number for the 2-D grid)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import keras
  import tfpipe
  from tfpipe.baselines import tensor_parallel
  from tfpipe.models import mlp
  from tfpipe.instruments.throughput import ThroughputMeter
  D = FLAGS.devices
  side = int(round(D ** 0.5))
  tfpipe.devices.ensure_logical_cpus(D, intra_op_threads=1)
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.steps
  x, y = rng.standard_normal((n, 784)).astype("float32"), rng.integers(0, 10, n)
  grids = [("single", None), ("batch only", f"{D}x1"), ("model only", f"1x{D}")]
  if side * side == D:
    grids.append(("grid", f"{side}x{side}"))
  rows = []
  depths = {"dnn": 7, "snn": 8}
  unknown = sorted(set(FLAGS.workloads) - set(depths))
  if unknown:
    raise app.UsageError(f"--workloads: unknown {unknown} (dnn, snn)")
  for workload in FLAGS.workloads:
    depth = depths[workload]
    for label, grid in grids:
      keras.utils.set_random_seed(0)
      model = getattr(mlp, workload)((784,), 10, width=FLAGS.width, depth=depth)
      trainer = tfpipe.create(model, "single") if grid is None else tfpipe.create(
          model, "grid", grid=grid)
      trainer.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      meter = ThroughputMeter(FLAGS.batch_size, window=(5, FLAGS.steps - 1))
      trainer.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False,
                  callbacks=[meter])
      units = [l.units for l in tensor_parallel.dense_layers(model)]
      moved = tensor_parallel.communication_bytes(units, 784, FLAGS.batch_size, grid or "1x1")
      rate = meter.samples_per_second()
      rows.append([f"{workload} {depth} x {FLAGS.width}", label, grid or "1x1", f"{rate:.0f}",
                   f"{moved['weights'] / 2**20:.1f}", f"{moved['activations'] / 2**20:.1f}"])
      print(f"{workload} {label}: {rate:.0f} samples/s", flush=True)
  title = (f"batch {FLAGS.batch_size}, samples/s over steps 5..{FLAGS.steps - 1}, {D} logical "
           "CPUs on this machine's cores; MiB moved between devices per step (weights and "
           "their gradients; activations and theirs)")
  table = results_io.markdown_table(
      ["workload", "parallelism", "grid", "samples/s", "weights MiB/step", "activations MiB/step"],
      rows)
  results_io.report(FLAGS.results_dir, "grid.md", title, table)


if __name__ == "__main__":
  app.run(main)
