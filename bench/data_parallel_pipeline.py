"""Data parallel x pipeline: R=2 replicas of a 2-stage pipeline against one 4-stage pipeline and
against `MirroredStrategy` over the same 4 logical CPUs.

Trains one MLP (default 8 x 512 SELU on synthetic data, batch 256) with
  Pipeline(method, num_stages=2, data_parallel=2)   devices r*2+k: replica r, stage k
  the same with cross_device_ops="hierarchical_copy" (the default in one process sums the
  replicas' gradients with ReductionToOneDevice, as MirroredStrategy does on CPUs)
  the same with cross_device_ops="ring" (each replica its own weights; the default across
  hosts), to see whether it would pay in one process too
  Pipeline(method, num_stages=4)
  MirroredStrategy over the 4 devices (`tfpipe.DataParallel`)
and prints the median samples/s of each over epochs after the first (the first traces),
with the ratios to the 4-stage pipeline. On this 2-core machine 4 logical CPUs (one
intra-op thread each) share 2 cores: the ratios say how each layout uses them, not
what 4 real devices would give.

  python bench/data_parallel_pipeline.py [--method=1f1b --micro_batches=4 --epochs=4]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402

flags.DEFINE_string("method", "1f1b", "the pipeline method")
common.define(micro_batches=4, width=512, depth=8, batch_size=256, batches=16)
flags.DEFINE_integer("epochs", 4, "epochs per runner (the first traces)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import tfpipe
  devices = tfpipe.devices.ensure_logical_cpus(4, intra_op_threads=1)
  import keras
  from tfpipe.models import mlp

  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.batches
  x, y = rng.standard_normal((n, 64)).astype("float32"), rng.integers(0, 10, n)
  pipeline = {"method": FLAGS.method, "micro_batches": FLAGS.micro_batches}
  runners = {
      "R=2 x K=2": lambda m: tfpipe.Pipeline(m, devices=devices[:4], data_parallel=2,
                                             **pipeline),
      "R=2 x K=2 hier. copy": lambda m: tfpipe.Pipeline(
          m, devices=devices[:4], data_parallel=2, cross_device_ops="hierarchical_copy",
          **pipeline),
      "R=2 x K=2 ring": lambda m: tfpipe.Pipeline(
          m, devices=devices[:4], data_parallel=2, cross_device_ops="ring", **pipeline),
      "R=1 x K=4": lambda m: tfpipe.Pipeline(m, devices=devices[:4], **pipeline),
      "MirroredStrategy x 4": lambda m: tfpipe.DataParallel(m, devices=devices[:4]),
  }
  rates = {}
  for name, build in runners.items():
    keras.utils.set_random_seed(0)
    runner = build(mlp.snn((64,), 10, width=FLAGS.width, depth=FLAGS.depth))
    runner.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = runner.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
                         shuffle=False)
    rates[name] = statistics.median(history.history["samples_per_second"][1:])
    print(f"{name}: {rates[name]:.0f} samples/s", flush=True)
  base = rates["R=1 x K=4"]
  print(f"\nsnn {FLAGS.depth} x {FLAGS.width}, batch {FLAGS.batch_size}, {FLAGS.method} "
        f"(M={FLAGS.micro_batches}), 4 logical CPUs")
  print(f"{'runner':<22}{'samples/s':>11}{'x R=1 x K=4':>13}")
  for name, rate in rates.items():
    print(f"{name:<22}{rate:>11.0f}{rate / base:>13.2f}")


if __name__ == "__main__":
  app.run(main)
