"""The executor's own cost: time per mini-batch of a tiny model, where compute is negligible.

Trains 8 x Dense(32) (ReLU), batch 32, on synthetic data with plain Keras `fit`
and with tfpipe pipelines at K = 1, 2, 4, 8 stages on logical CPUs and at
K = 2, 4 on TF server processes (one thread each), for the chosen executors.
Each configuration runs in a process of its own (its own thread settings and
devices), in one run of this script. The time per mini-batch is marginal:
(median time of a fit over 2N batches - median time of a fit over N batches) / N
over `--rounds`, each fit timed from on_train_begin to on_train_end, so tracing,
the per-fit setup and what happens after the last hook do not count. (A tf.data
iterator's deletion after a fit took 1.1-2.4 s in some fits here, measured; that
would swamp these figures; so would a full garbage collection, so each fit starts after
one.) Beside it, the graph ops one mini-batch runs (Keras's train
step, or the compiled executor's steady-state window per mini-batch; counted before
TensorFlow's graph optimisations) and the time per op: where the time per op is about the
same, the op count is what bounds the executor's cost.

  python bench/runtime_overhead.py [--stages=1,2,4,8 --server_stages=2,4
      --executors=compiled,threaded --method=spectrain --batches=64 --rounds=3]
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common, results_io  # noqa: E402

flags.DEFINE_list("stages", ["1", "2", "4", "8"], "K on logical CPU devices")
flags.DEFINE_list("server_stages", ["2", "4"], "K on TF server processes (empty: none)")
flags.DEFINE_list("executors", ["compiled", "threaded"], "pipeline executors to measure")
flags.DEFINE_string("method", "spectrain", "pipelined method")
flags.DEFINE_bool("advised", False,
                  "pipelines with advice=True (the options tfpipe.rules.advice measured for the "
                  "optimizer); off: each method's own rule")
flags.DEFINE_enum("model", "mlp", ["mlp", "snn"], "mlp: Dense + ReLU; snn: the SpecTrain paper's SELU SNN")
common.define(input_dim=32, width=32, depth=8, batch_size=32, batches=128,
              results_dir=results_io.RESULTS)
flags.DEFINE_integer("rounds", 5, "measured rounds per configuration (medians)")
flags.DEFINE_integer("keras_threads", 0, "intra-op threads of plain Keras (0: all cores)")
flags.DEFINE_string("steps_per_execution", "auto",
                    "compiled executor: mini-batches per graph call (auto: the pipeline's choice)")
flags.DEFINE_string("child", None, "internal: the configuration this process measures (JSON)")
FLAGS = flags.FLAGS


_SERVERS = []   # the child's local clusters, stopped before it exits


def _hop():
  """Seconds one small tensor ([batch, width] float32) takes from one TF server process to
  another, in a chain of dependent moves inside one function call (a bound on the stages'
  transfers on servers: each mini-batch moves its activations, gradients, inputs and labels)."""
  import tensorflow as tf
  import tfpipe
  tf.config.threading.set_intra_op_parallelism_threads(1)
  local = tfpipe.cluster.LocalCluster({"worker": 2})
  _SERVERS.append(local)
  devices = tfpipe.cluster.connect(local.spec)
  H = 64

  @tf.function
  def hops(x):
    for i in range(H):
      with tf.device(devices[i % 2]):
        x = x + 1.0
    return x

  with tf.device(devices[0]):
    x = tf.zeros([FLAGS.batch_size, FLAGS.width])
  for _ in range(3):
    hops(x).numpy()
  times = []
  for _ in range(FLAGS.rounds):
    start = time.perf_counter()
    hops(x).numpy()
    times.append(time.perf_counter() - start)
  return statistics.median(times) / H


def _measure(config):
  """Runs one configuration in this process; returns seconds per mini-batch (marginal)."""
  import tensorflow as tf
  import tfpipe
  K, where = config.get("K", 1), config.get("where", "cpu")
  if config["runner"] == "keras":
    tf.config.threading.set_intra_op_parallelism_threads(config["threads"])
    devices = ["/device:CPU:0"]
  elif where == "servers":
    tf.config.threading.set_intra_op_parallelism_threads(1)
    local = tfpipe.cluster.LocalCluster({"worker": K})
    _SERVERS.append(local)
    devices = tfpipe.cluster.connect(local.spec)
  else:
    devices = tfpipe.create_logical_cpus(K, intra_op_threads=1)
  import keras
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.batches * 2
  x = rng.standard_normal((n, FLAGS.input_dim)).astype("float32")
  y = rng.integers(0, 10, n)
  keras.utils.set_random_seed(0)
  if FLAGS.model == "snn":
    from tfpipe.models import mlp
    model = mlp.snn((FLAGS.input_dim,), 10, width=FLAGS.width, depth=FLAGS.depth)
  else:
    model = keras.Sequential([keras.Input((FLAGS.input_dim,))] + [
        keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth - 1)] + [
            keras.layers.Dense(10)])
  optimizer = tfpipe.optimizers.SpecTrain(1e-3, 0.9)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if config["runner"] == "keras":
    runner = model
    runner.compile(optimizer, loss)
  else:
    runner = tfpipe.Pipeline(model, devices=devices[:K], method=FLAGS.method,
                             executor=config["runner"], partition=config.get("partition", "uniform"),
                             profile_batch_size=FLAGS.batch_size, advice=FLAGS.advised)
    window = FLAGS.steps_per_execution
    runner.compile(optimizer, loss, steps_per_execution=window if window == "auto" else int(window))

  span = results_io.fit_span()

  def fit(batches):
    # A full garbage collection made due by earlier work (tracing) would otherwise land in one
    # of the timed fits (measured, K=8: every other 128-batch fit 0.28 s slower, the median
    # of 3 rounds' marginal time negative).
    gc.collect()
    runner.fit(x[:batches * FLAGS.batch_size], y[:batches * FLAGS.batch_size],
               batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=[span])
    return span.seconds

  N = FLAGS.batches
  fit(N), fit(2 * N)   # traces every window shape of both epoch lengths
  short, long = zip(*[(fit(N), fit(2 * N)) for _ in range(FLAGS.rounds)])
  return (statistics.median(long) - statistics.median(short)) / N, _graph_ops_per_batch(runner)


def _graph_ops_per_batch(runner):
  """Ops (graph nodes, before TensorFlow's graph optimisations; nested functions included)
  that one training step runs: Keras's train function per step, or the compiled executor's
  largest window (the steady state) per mini-batch, or its loop over mini-batches (one
  mini-batch's tasks: schedules that finish each mini-batch before the next). None for the
  threaded executor and for windows of stage calls run as a group (`tfpipe.runtime.groups`)."""
  import tensorflow as tf
  if hasattr(runner, "runtime"):
    if not hasattr(runner.runtime, "_train"):
      return None
    # pylint: disable=protected-access
    concretes = [(c, runner.runtime.window) for f in runner.runtime._train.functions.values()
                 for c in f._list_all_concrete_functions()]
    concretes += [(c, 1) for f in runner.runtime.loops.functions.functions.values()
                  for c in f._list_all_concrete_functions()]
  else:   # Keras's train step, traced on its own
    specs = (tf.TensorSpec([FLAGS.batch_size, FLAGS.input_dim], tf.float32),
             tf.TensorSpec([FLAGS.batch_size], tf.int64))
    concretes = [(tf.function(lambda x, y: runner.train_step((x, y))).get_concrete_function(
        *specs), 1)]
  counts = []
  for concrete, per in concretes:
    graph = concrete.graph.as_graph_def()
    counts.append((len(graph.node) + sum(len(f.node_def) for f in graph.library.function)) / per)
  return max(counts) if counts else None   # windows of stage calls in a group: not counted


def child(config):
  """`results_io.child_values` of `config`, measured in a new process with this one's flags."""
  names = ("model", "input_dim", "width", "depth", "batch_size", "batches", "rounds", "method",
           "steps_per_execution", "advised")
  return results_io.child_values(config, **{name: FLAGS[name].value for name in names})


def main(argv):
  del argv
  if FLAGS.child:
    try:
      config = json.loads(FLAGS.child)
      if config["runner"] == "hop":
        print(f"seconds_per_hop {_hop()}", flush=True)
      else:
        seconds, ops = _measure(config)
        print(f"seconds_per_batch {seconds}", flush=True)
        if ops is not None:
          print(f"graph_ops_per_batch {ops}", flush=True)
    finally:
      for local in _SERVERS:
        local.stop()
    os._exit(0)   # a process connected to servers skips TensorFlow's teardown
  threads = FLAGS.keras_threads or os.cpu_count()
  configs = [("plain Keras fit", "-", "-", {"runner": "keras", "threads": threads})]
  for executor in FLAGS.executors:
    configs += [(executor, K, "logical CPUs", {"runner": executor, "K": int(K)})
                for K in FLAGS.stages]
    configs += [(executor, K, "TF servers", {"runner": executor, "K": int(K), "where": "servers"})
                for K in FLAGS.server_stages if K]
  rows, keras_ms = [], None
  for name, K, where, config in configs:
    values = child(config)
    ms = 1e3 * values["seconds_per_batch"]
    ops = values.get("graph_ops_per_batch")
    keras_ms = keras_ms or ms
    per_op = f"{1e3 * ms / ops:.1f}" if ops else "-"
    rows.append([name, K, where, f"{ms:.2f}", f"{ms / keras_ms:.2f}",
                 f"{ops:.0f}" if ops else "-", per_op])
    counted = f", {ops:.0f} graph ops per mini-batch ({per_op} µs per op)" if ops else ""
    print(f"{name} K={K} on {where}: {ms:.2f} ms per mini-batch ({ms / keras_ms:.2f} x Keras)"
          f"{counted}", flush=True)
  if any(K for K in FLAGS.server_stages):
    hop = child({"runner": "hop"})["seconds_per_hop"]
    rows.append(["bound: one tensor between two TF server processes", "-", "TF servers",
                 f"{1e3 * hop:.3f}", "-", "-", "-"])
    print(f"one [{FLAGS.batch_size}, {FLAGS.width}] tensor between two TF server processes: "
          f"{1e6 * hop:.0f} µs", flush=True)
  title = (f"Executor cost: {FLAGS.model} {FLAGS.depth} x {FLAGS.width}, batch {FLAGS.batch_size}, "
           f"method {FLAGS.method}, {os.cpu_count()} cores; plain Keras with {threads} intra-op "
           "threads, every stage 1; marginal ms per mini-batch, median of "
           f"{FLAGS.rounds} rounds of {FLAGS.batches} extra batches")
  table = results_io.markdown_table(
      ["runner", "K", "devices", "ms per mini-batch", "x plain Keras", "graph ops per mini-batch",
       "µs per graph op"], rows)
  results_io.report(FLAGS.results_dir, "runtime_overhead.md", title, table)


if __name__ == "__main__":
  app.run(main)
