"""Pipeline speedup on this machine: 2 stages vs 1 stage vs plain Keras vs MirroredStrategy.

Trains the SpecTrain paper's SNN (default 8 x 1024 SELU, batch 128) on synthetic data and
prints samples/s of every runner, measured side by side in one run (rounds
interleave the runners; the median epoch counts), and the ratios:
  pipeline K=2 / pipeline K=1  (the pipeline's speedup; the limit is 2.0 on 2 cores)
  pipeline K=1 / Keras fit     (the executor's own overhead, same thread budget)
  pipeline K=2 / MirroredStrategy over the same 2 devices
and, per runner, the cores kept busy (process CPU time / wall time of its fit call).
Pipelines run on each of `--executors`. Then, each in a process of its own
(bench/runtime_overhead.py's marginal time per mini-batch): plain Keras `fit`
with all cores as intra-op threads, the first method at K = 2 (and
`--more_stages`) on logical CPUs with the compiled executor, and at K=2 on two
TF server processes (one thread each), with their ratios to that Keras.
With 1 intra-op thread TensorFlow still runs independent ops of one step (e.g. the
weight and input gradients of a layer) on its 2 inter-op threads, so one stage
alone already keeps more than one core busy; the speedup of 2 stages is bounded
by the cores left over.

  python bench/pipeline_speedup.py [--width=1024 --depth=8 --batch_size=128 --rounds=5
                                    --micro_batches=M]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # 1.5-1.8x faster Dense on this CPU

import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402

import tfpipe  # noqa: E402

common.define(width=1024, depth=8, input_dim=784, batch_size=128, batches=40)
flags.DEFINE_integer("rounds", 5, "measured rounds (each runner trains one epoch per round)")
flags.DEFINE_string("partition", "profile", "pipeline balancing")
flags.DEFINE_list("methods", ["vanilla", "spectrain"], "pipelined methods to measure")
flags.DEFINE_integer("inter_op_threads", None, "TensorFlow inter-op threads (default: TF's)")
flags.DEFINE_list("executors", ["compiled", "threaded"], "pipeline executors to measure")
flags.DEFINE_list("more_stages", ["4"], "more K measured in processes of their own (compiled)")
flags.DEFINE_bool("processes", True, "also measure Keras with all cores and TF servers")
flags.DEFINE_integer("micro_batches", None, "micro_batches of the pipelines (default: each "
                     "method's own)")
FLAGS = flags.FLAGS


def _cpu_seconds():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main(argv):
  del argv
  import tensorflow as tf
  if FLAGS.inter_op_threads:  # before TensorFlow initialises
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
  devices = tfpipe.create_logical_cpus(2, intra_op_threads=1)
  import keras
  from tfpipe.models import mlp as models

  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.batches
  x = rng.standard_normal((n, FLAGS.input_dim)).astype("float32")
  y = rng.integers(0, 10, n)

  def model():
    keras.utils.set_random_seed(0)
    return models.snn((FLAGS.input_dim,), 10, width=FLAGS.width, depth=FLAGS.depth)

  def optimizer():
    return tfpipe.optimizers.SpecTrain(1e-3, 0.9)

  runners = {"keras fit": tfpipe.Single(model(), device=devices[0]),
             "dataparallel x2": tfpipe.DataParallel(model(), devices=devices)}
  for method in FLAGS.methods:
    for executor in FLAGS.executors:
      runners[f"{method} K=1 {executor}"] = tfpipe.Pipeline(
          model(), devices=devices[:1], method=method, executor=executor,
          micro_batches=FLAGS.micro_batches)
      runners[f"{method} K=2 {executor}"] = tfpipe.Pipeline(
          model(), devices=devices, method=method, partition=FLAGS.partition,
          profile_batch_size=FLAGS.batch_size, executor=executor,
          micro_batches=FLAGS.micro_batches)
  for name, runner in runners.items():
    runner.compile(optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if isinstance(runner, tfpipe.Pipeline):
      runner.summary()
  rates = {name: [] for name in runners}
  cores = {name: [] for name in runners}
  for r in range(FLAGS.rounds + 1):  # round 0 traces and warms up
    for name, runner in runners.items():
      cpu, wall = _cpu_seconds(), time.perf_counter()
      history = runner.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False)
      cpu, wall = _cpu_seconds() - cpu, time.perf_counter() - wall
      if r:
        rates[name].append(history.history["samples_per_second"][-1])
        cores[name].append(cpu / wall)
    if r:
      print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
  median = {name: float(np.median(v)) for name, v in rates.items()}
  print(f"\nsnn {FLAGS.depth} x {FLAGS.width}, batch {FLAGS.batch_size}, 2 logical CPU devices, "
        f"1 intra-op thread, {tf.config.threading.get_inter_op_parallelism_threads() or 'default'} "
        f"inter-op threads, oneDNN={os.environ['TF_ENABLE_ONEDNN_OPTS']}")
  print(f"{'runner':<20}{'samples/s':>12}{'cores busy':>12}")
  for name, value in median.items():
    print(f"{name:<20}{value:>12.1f}{float(np.median(cores[name])):>12.2f}")
  print()
  for method in FLAGS.methods:
    for executor in FLAGS.executors:
      two, one = median[f"{method} K=2 {executor}"], median[f"{method} K=1 {executor}"]
      print(f"{method} ({executor}): K=2 / K=1 = {two / one:.2f}   K=1 / keras fit = "
            f"{one / median['keras fit']:.2f}   K=2 / dataparallel = "
            f"{two / median['dataparallel x2']:.2f}")
  if FLAGS.processes:
    _processes()


def _processes():
  """Keras with all cores, and pipelines on logical CPUs and TF servers, each in its own process."""
  from bench import results_io
  values = dict(model="snn", input_dim=FLAGS.input_dim, width=FLAGS.width, depth=FLAGS.depth,
                batch_size=FLAGS.batch_size, batches=FLAGS.batches, rounds=FLAGS.rounds,
                method=FLAGS.methods[-1])
  rate = lambda config: FLAGS.batch_size / results_io.seconds_per_batch(config, **values)
  threads = os.cpu_count()
  keras_rate = rate({"runner": "keras", "threads": threads})
  rows = [[f"keras fit, {threads} intra-op threads", f"{keras_rate:.0f}", "1.00"]]
  for K in ["2"] + FLAGS.more_stages:
    value = rate({"runner": "compiled", "K": int(K), "partition": FLAGS.partition})
    rows.append([f"{values['method']} K={K}, logical CPUs, 1 thread each", f"{value:.0f}",
                 f"{value / keras_rate:.2f}"])
  value = rate({"runner": "compiled", "K": 2, "where": "servers", "partition": FLAGS.partition})
  rows.append([f"{values['method']} K=2, 2 TF servers, 1 thread each", f"{value:.0f}",
               f"{value / keras_rate:.2f}"])
  print("\nEach in a process of its own (marginal time per mini-batch, compiled executor):")
  print(results_io.markdown_table(["runner", "samples/s", "x keras fit"], rows))

if __name__ == "__main__":
  app.run(main)
