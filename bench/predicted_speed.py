"""The simulator's predictions against measured speed: is a short profile enough to know a
method's samples/s without running it?

For each model (the synchronous-schedule benchmark's 8 x 512 MLP, batch 256; the start-up
benchmark's 12-layer KerasHub Llama, batch 16), each K and each method (its defaults; M for
the synchronous schedules): builds the pipeline on K logical CPUs (one intra-op thread
each), takes `tfpipe.instruments.costs.measure`'s profile (each stage's tasks timed alone
inside a graph at the micro-batch size, the call a task pays when the executor does not
trace it inline, the cores the devices share), asks the simulator for samples/s
(`costs.predict`), then trains `--epochs` epochs and takes the median samples/s of the
epochs after the first. Prints predicted, measured and the error; writes
bench/results/predicted_speed.md (`--name`). Timings here vary by about a fifth between runs of the
same command: read the errors against that.

  python bench/predicted_speed.py [--models=mlp,llama --stages=2,4
                                   --methods=gpipe,1f1b,zb,interleaved,zbv,spectrain,pipedream,vanilla]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import common  # noqa: E402

from bench import results_io, workloads  # noqa: E402

flags.DEFINE_list("models", ["mlp", "llama"], "mlp (8 x --mlp_width SELU, batch 256) or llama")
flags.DEFINE_list("stages", ["2", "4"], "pipeline depths K")
flags.DEFINE_list("methods", ["gpipe", "1f1b", "zb", "interleaved", "zbv", "spectrain",
                              "pipedream", "vanilla"], "methods, each with its defaults")
common.define(micro_batches=4, results_dir=results_io.RESULTS)
flags.DEFINE_integer("epochs", 4, "epochs per run (the first traces)")
flags.DEFINE_integer("mlp_batches", 64, "mini-batches per epoch for the MLP")
flags.DEFINE_integer("mlp_width", 512, "units per layer of the MLP")
flags.DEFINE_string("name", "predicted_speed.md", "the table's file name")
FLAGS = flags.FLAGS

SYNCHRONOUS = ("gpipe", "1f1b", "zb", "interleaved", "zbv")


def _model_and_data(name):
  import numpy as np
  if name == "llama":
    x, y, batch = workloads.data("llama")
    return workloads.model("llama", 12), x, y, batch
  from tfpipe.models import mlp
  import keras
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  n = 256 * FLAGS.mlp_batches
  x, y = rng.standard_normal((n, 64)).astype("float32"), rng.integers(0, 10, n)
  return mlp.snn((64,), 10, width=FLAGS.mlp_width, depth=8), x, y, 256


def _one(name, K, method):
  import keras
  import tfpipe
  from tfpipe.instruments import costs as costs_lib
  model, x, y, batch = _model_and_data(name)
  options = {"micro_batches": FLAGS.micro_batches} if method in SYNCHRONOUS else {}
  pipe = tfpipe.Pipeline(model, num_stages=K, method=method, **options)
  pipe.compile(keras.optimizers.SGD(0.01, momentum=0.9),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  first = {k: v[:batch] for k, v in x.items()} if isinstance(x, dict) else x[:batch]
  start = time.perf_counter()
  costs = costs_lib.measure(pipe, first, y[:batch])
  profiled = time.perf_counter() - start
  V = pipe.policy.virtual_stages
  predicted = costs_lib.predict(costs, method, batch, pipe.micro_batches,
                                virtual_stages=V if V > 1 else None)
  # The methods run one after another in this process: the garbage of the earlier ones' graphs
  # and of this one's first epoch is collected before and between epochs, not inside a
  # measured one, as in bench/sync_schedules.py.
  collect = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: gc.collect() if epoch == 0 else None)
  gc.collect()
  history = pipe.fit(x, y, batch_size=batch, epochs=FLAGS.epochs, verbose=0, shuffle=False,
                     callbacks=[collect])
  measured = statistics.median(history.history["samples_per_second"][1:])
  cores = "-" if costs.cores is None else f"{costs.cores:.2f}"
  return [name, K, method, pipe.micro_batches, f"{profiled:.1f}", cores, f"{predicted:.0f}",
          f"{measured:.0f}", f"{predicted / measured - 1:+.0%}"]


def main(argv):
  del argv
  import tfpipe
  stages = [int(k) for k in FLAGS.stages]
  tfpipe.devices.ensure_logical_cpus(max(stages), intra_op_threads=1)
  rows = []
  for name in FLAGS.models:
    for K in stages:
      for method in FLAGS.methods:
        rows.append(_one(name, K, method))
        print(" ".join(map(str, rows[-1])), flush=True)
  errors = [abs(float(r[-1].rstrip("%"))) for r in rows]
  title = ("# The simulator's samples/s from a short profile, against measured\n\n"
           f"`python bench/predicted_speed.py --models={','.join(FLAGS.models)} "
           f"--stages={','.join(FLAGS.stages)} --methods={','.join(FLAGS.methods)}`: "
           f"K logical CPUs of this machine's cores, {FLAGS.epochs} epochs, measured = median "
           f"of the epochs after the first. Within 20%: {sum(e <= 20 for e in errors)} of "
           f"{len(errors)}; median error {statistics.median(errors):.0f}%.")
  table = results_io.markdown_table(["model", "K", "method", "M", "profile s", "cores",
                                     "predicted",
                                     "measured", "error"], rows)
  results_io.report(FLAGS.results_dir, FLAGS.name, title, table)


if __name__ == "__main__":
  app.run(main)
