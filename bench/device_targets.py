"""The targets for a machine with a GPU and many cores, beside plain Keras `fit` in one run.

GPU (`--parts=gpu`): the SpecTrain paper's SNN, `--gpu_depth` x `--gpu_width` SELU (16 x 4096),
batch 512, on one GPU: Keras `fit` compiled with XLA (`jit_compile=True`) against the
pipeline at K=1 (its `jit_compile` is on by default when every stage is a GPU), for each of
`--methods`, and at K=`--gpu_stages` on as many logical GPUs split from the one GPU (each
`--gpu_memory_mb`, a stream of its own): what the executor costs where compute is fast.
Targets: K=1 >= 0.95x Keras's samples/s, K=4 >= 0.9x K=1's, start-up <= 2x Keras's.

CPU (`--parts=cpu`): the SNN `--cpu_depth` x `--cpu_width` (8 x 1024, bench/pipeline_speedup's),
batch 128, on every core: Keras `fit` with all cores as intra-op threads against the
methods at K=`--cpu_stages` on logical CPU devices, (a) each device with a thread pool of
its own of cores/K threads (TF_OVERRIDE_GLOBAL_THREADPOOL), (b) all devices sharing one
pool of all cores; each with the method's advised options and with none, and
`--cpu_methods` (plain) on the shared pool. What bounds a pipeline there is measured beside
it: Keras `fit` with cores/K intra-op threads (one stage's pool): K stages of 1/K of the
model each at that speed, perfectly balanced, would run K x its samples/s. Every CPU row
gives the cores it kept busy (CPU seconds over wall seconds of the timed fits). Target:
K=4 >= 1.5x Keras.

Every configuration runs in a process of its own (`results_io.in_child`). Steady state is
marginal, as in bench/runtime_overhead.py: (median time of a fit over 2N batches - median
of a fit over N) / N, so the per-fit setup does not count. Start-up: the first fit's wall
time minus the median of the later fits of the same length (tracing, XLA compilation,
graph optimisation). The device's own start (CUDA context, XLA's first use) is paid before
the timing, in every process alike. The CPU part hides the GPU (CUDA_VISIBLE_DEVICES=-1).
docs/benchmarks.md ("A GPU and 16 cores") says how to install TensorFlow's GPU build for it.

  python bench/device_targets.py [--parts=gpu,cpu --methods=spectrain --rounds=3]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from bench import common, results_io  # noqa: E402

flags.DEFINE_list("parts", ["gpu", "cpu"], "what to measure: gpu, cpu")
flags.DEFINE_list("methods", ["spectrain"], "pipelined methods")
common.define(input_dim=784, results_dir=results_io.RESULTS)
flags.DEFINE_integer("gpu_width", 4096, "units per layer (GPU)")
flags.DEFINE_integer("gpu_depth", 16, "hidden layers (GPU)")
flags.DEFINE_integer("gpu_batch_size", 512, "batch size (GPU)")
flags.DEFINE_integer("gpu_batches", 64, "N, batches of the short fit (GPU)")
flags.DEFINE_integer("gpu_stages", 4, "K on logical GPUs split from the one GPU (0: none)")
flags.DEFINE_integer("gpu_memory_mb", 16384, "memory of each logical GPU, MB")
flags.DEFINE_list("cpu_methods", ["pipedream", "vanilla", "1f1b"],
                  "more methods at K on the CPU (plain options, the shared pool)")
flags.DEFINE_integer("cpu_width", 1024, "units per layer (CPU)")
flags.DEFINE_integer("cpu_depth", 8, "hidden layers (CPU)")
flags.DEFINE_integer("cpu_batch_size", 128, "batch size (CPU)")
flags.DEFINE_integer("cpu_batches", 40, "N, batches of the short fit (CPU)")
flags.DEFINE_integer("cpu_stages", 4, "K on logical CPU devices")
flags.DEFINE_integer("cores", 0, "cores to use on the CPU (0: all)")
flags.DEFINE_integer("rounds", 3, "measured rounds per configuration (medians)")
flags.DEFINE_integer("timeout", 300, "seconds one configuration may take")
FLAGS = flags.FLAGS


def _warm(device):
  """Starts the device and XLA before anything is timed: every process pays it alike."""
  import tensorflow as tf
  with tf.device(device):
    x = tf.ones([64, 64])
    tf.function(lambda a: tf.matmul(a, a), jit_compile=device.startswith("/GPU"))(x).numpy()


def _one(config):
  """One configuration in this (fresh) process: {"extra": s, "per_batch": s}."""
  if config["where"] == "cpu":   # on a GPU's machine Keras's jit_compile="auto" failed there
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
  if config.get("pools") == "per device":
    os.environ["TF_OVERRIDE_GLOBAL_THREADPOOL"] = "1"   # read when the devices are made
  import numpy as np
  import tensorflow as tf
  import tfpipe
  where, K, threads = config["where"], config["K"], config["threads"]
  if where == "gpu":
    if not tf.config.list_physical_devices("GPU"):
      raise RuntimeError("no GPU: TensorFlow lists none (is its GPU build installed, with "
                         "CUDA's libraries on LD_LIBRARY_PATH?)")
    if K > 1:
      gpu = tf.config.list_physical_devices("GPU")[0]
      tf.config.set_logical_device_configuration(
          gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=FLAGS.gpu_memory_mb)] * K)
    devices = [f"/GPU:{i}" for i in range(K)]
  elif config["runner"] == "keras":
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    devices = ["/CPU:0"]
  else:
    devices = tfpipe.create_logical_cpus(K, intra_op_threads=threads)
  _warm(devices[0])
  import keras
  from tfpipe.models import mlp
  size = config["size"]
  rng = np.random.default_rng(0)
  n = size["batch_size"] * size["batches"] * 2
  x = rng.standard_normal((n, FLAGS.input_dim)).astype("float32")
  y = rng.integers(0, 10, n)
  keras.utils.set_random_seed(0)
  model = mlp.snn((FLAGS.input_dim,), 10, width=size["width"], depth=size["depth"])
  optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if config["runner"] == "keras":
    with tf.device(devices[0]):
      model.compile(optimizer, loss, jit_compile=True if where == "gpu" else "auto")
    runner = model
  else:
    runner = tfpipe.Pipeline(model, devices=devices[:K], method=config["runner"],
                             profile_batch_size=size["batch_size"], advice=config["advised"],
                             **config.get("options", {}))
    runner.compile(optimizer, loss)
  span = results_io.fit_span()

  def fit(batches):
    start = time.perf_counter()
    count = batches * size["batch_size"]
    runner.fit(x[:count], y[:count], batch_size=size["batch_size"], epochs=1, verbose=0,
               shuffle=False, callbacks=[span])
    return time.perf_counter() - start, span.seconds

  N = size["batches"]
  first, _ = fit(N)
  fit(2 * N)   # the longer fit's window shapes
  cpu, wall = sum(os.times()[:2]), time.perf_counter()
  short, long = zip(*[(fit(N), fit(2 * N)) for _ in range(FLAGS.rounds)])
  busy = (sum(os.times()[:2]) - cpu) / (time.perf_counter() - wall)
  walls = [wall for wall, _ in short]
  per_batch = (statistics.median(s for _, s in long) - statistics.median(s for _, s in short)) / N
  return {"extra": first - statistics.median(walls), "per_batch": per_batch, "busy": busy}


def _measure(title, size, configs, target, bound=None):
  """Runs `configs` (name, config) beside Keras (the first); prints and returns the table.
  A config's "versus" names an earlier row its note compares it with; `bound` (a row's name,
  K) notes what K stages at that row's speed would give."""
  results = []
  for name, config in configs:
    result = results_io.in_child_or_error(_one, dict(config, size=size), FLAGS.timeout, 200)
    results.append((name, result))
    if "error" in result:
      print(f"  {name}: {result['error']}", flush=True)
    else:
      print(f"  {name}: {size['batch_size'] / result['per_batch']:.0f} samples/s, start-up "
            f"{result['extra']:.1f} s", flush=True)
  keras_result = results[0][1]
  if "error" in keras_result:
    return f"{title}\n\nKeras fit failed: {keras_result['error']}\n"
  by_name = dict(results)
  rows = []
  for (name, result), (_, config) in zip(results, configs):
    if "error" in result:
      rows.append([name, "error", "", "", "", "", result["error"][:80]])
      continue
    rate = size["batch_size"] / result["per_batch"]
    speed = keras_result["per_batch"] / result["per_batch"]
    versus = by_name.get(config.get("versus"), {})
    note = (f"{versus['per_batch'] / result['per_batch']:.2f}x {config['versus']}"
            if "per_batch" in versus else "")
    if bound and name == bound[0]:
      note = f"bound for K={bound[1]}: {bound[1] * speed:.2f}x Keras"
    rows.append([name, f"{rate:.0f}", f"{speed:.2f}", f"{result['extra']:.1f}",
                 f"{result['extra'] / keras_result['extra']:.1f}" if keras_result["extra"] > 0
                 else "-", f"{result['busy']:.1f}", note])
  table = results_io.markdown_table(
      ["runner", "samples/s", "x Keras", "start-up s", "x Keras's", "cores busy", "note"], rows)
  return f"{title} Target: {target}.\n\n{table}\n"


def _gpu():
  size = dict(width=FLAGS.gpu_width, depth=FLAGS.gpu_depth, batch_size=FLAGS.gpu_batch_size,
              batches=FLAGS.gpu_batches)
  configs = [("keras fit (XLA)", dict(runner="keras", where="gpu", K=1, threads=None))]
  for method in FLAGS.methods:
    configs.append((f"{method} K=1", dict(runner=method, where="gpu", K=1, threads=None,
                                          advised=False)))
    if FLAGS.gpu_stages > 1:
      configs.append((f"{method} K={FLAGS.gpu_stages}, logical GPUs of one GPU",
                      dict(runner=method, where="gpu", K=FLAGS.gpu_stages, threads=None,
                           advised=False, versus=f"{method} K=1")))
  title = (f"GPU: snn {size['depth']} x {size['width']}, batch {size['batch_size']}, "
           f"{size['batches']} / {2 * size['batches']} batches per fit, median of "
           f"{FLAGS.rounds} rounds.")
  return _measure(title, size, configs, f"K=1 >= 0.95x Keras, K={FLAGS.gpu_stages} >= 0.9x "
                  "K=1, start-up <= 2x Keras's")


def _cpu():
  cores = FLAGS.cores or os.cpu_count()
  K = FLAGS.cpu_stages
  if cores < K:
    raise app.UsageError(f"--cores={cores} is fewer than --cpu_stages={K}")
  size = dict(width=FLAGS.cpu_width, depth=FLAGS.cpu_depth, batch_size=FLAGS.cpu_batch_size,
              batches=FLAGS.cpu_batches)
  configs = [(f"keras fit, {cores} threads", dict(runner="keras", where="cpu", K=1,
                                                   threads=cores)),
             (f"keras fit, {cores // K} threads", dict(runner="keras", where="cpu", K=1,
                                                        threads=cores // K))]
  for method in FLAGS.methods:
    for advised in (False, True) if method == "spectrain" else (True,):
      options = (" (advised)" if advised else " (plain, M=1)") if method == "spectrain" else ""
      configs.append((f"{method}{options} K={K}, a pool of {cores // K} threads per device",
                      dict(runner=method, where="cpu", K=K, threads=cores // K,
                           pools="per device", advised=advised)))
      configs.append((f"{method}{options} K={K}, one shared pool of {cores} threads",
                      dict(runner=method, where="cpu", K=K, threads=cores, pools="shared",
                           advised=advised)))
  for method in FLAGS.cpu_methods:
    options = {"micro_batches": K} if method in ("1f1b", "gpipe", "zb", "zbv") else {}
    configs.append((f"{method} K={K}{f' M={K}' if options else ''}, one shared pool of "
                    f"{cores} threads", dict(runner=method, where="cpu", K=K, threads=cores,
                                             pools="shared", advised=False, options=options)))
  title = (f"CPU: snn {size['depth']} x {size['width']}, batch {size['batch_size']}, {cores} "
           f"cores, {size['batches']} / {2 * size['batches']} batches per fit, median of "
           f"{FLAGS.rounds} rounds.")
  return _measure(title, size, configs, f"K={K} >= 1.5x Keras",
                  bound=(f"keras fit, {cores // K} threads", K))


def main(argv):
  del argv
  parts = {"gpu": _gpu, "cpu": _cpu}
  unknown = [p for p in FLAGS.parts if p not in parts]
  if unknown:
    raise app.UsageError(f"--parts: unknown {unknown} (gpu, cpu)")
  texts = []
  for part in FLAGS.parts:
    print(f"{part}:", flush=True)
    texts.append(parts[part]())
    print("\n" + texts[-1], flush=True)
  results_io.write(FLAGS.results_dir, "device_targets.md", "\n".join(texts))


if __name__ == "__main__":
  app.run(main)
