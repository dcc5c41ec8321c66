"""Start-up: the first epoch's extra time (tracing and one-off work) vs plain Keras `fit`.

For each model, runner and window, trains two epochs and reports the first
epoch's time minus the second's (what the first call pays once: tracing,
graph optimisation, variable creation, and the garbage collection they make due, run at
the first epoch's end) and the second epoch's time, beside
plain Keras `fit` on the same model and data:

  llama:  KerasHub's Llama backbone from config (random weights, no download),
          12 decoder layers, width 64, 2 heads, sequence 32, vocabulary 1,024,
          mean-pooled into a 10-class head; batch 16, 64 batches per epoch.
  resnet: ResNet-20 at half width (tfpipe.models.cnn.resnet20, 20 conv layers)
          on 32 x 32 x 3 images, batch 32, 32 batches per epoch.
  mlp:    8 x Dense(256, relu) on 64 features (the staleness benchmark's kind of
          model), batch 512, 8 batches per epoch: a small model whose epoch is
          shorter than the default window.

Every pipelined method at K = `--stages`, with the default window
(steps_per_execution="auto") and `--windows`. Each configuration runs in a
process of its own (a clean TensorFlow, no traces shared), on K logical CPU
devices with one intra-op thread each; Keras runs on one device with the same
budget. Target (issue: start-up): extra time <= 2x Keras's for every method
and K, and a window of 64 no slower to start than the default (within 20%).

  python bench/startup.py [--models=llama,resnet --stages=2,4 --windows=auto,64
                           --methods=spectrain,gpipe,... --micro_batches=M]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from bench import workloads  # noqa: E402

flags.DEFINE_list("models", ["llama", "resnet"], "models to measure (llama, resnet, mlp)")
flags.DEFINE_list("stages", ["2", "4"], "numbers of stages K")
flags.DEFINE_list("windows", ["auto", "64"], "steps_per_execution values")
flags.DEFINE_list("methods", ["sequential", "gpipe", "1f1b", "zb", "interleaved", "zbv",
                              "vanilla", "pipedream", "spectrain", "ddg", "feature_replay",
                              "timeprest", "pipemare", "i_timeprest", "2bw"],
                  "pipelined methods")
flags.DEFINE_integer("layers", 12, "decoder layers of the Llama model")
flags.DEFINE_integer("micro_batches", None, "micro_batches for every pipeline (default: each "
                     "method's own)")
flags.DEFINE_integer("timeout", 900, "seconds one configuration may take")
flags.DEFINE_string("one", None, "run one configuration (JSON: model, method, K, window) in "
                    "this process and print its result")
FLAGS = flags.FLAGS

def _one(config):
  """Trains two epochs of one configuration; returns its timings."""
  import tfpipe
  K = config["K"]
  devices = tfpipe.create_logical_cpus(max(K, 1), intra_op_threads=1)
  import keras
  x, y, batch = workloads.data(config["model"])
  model = workloads.model(config["model"], FLAGS.layers)
  window = config["window"]
  compile_args = dict(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
  if config["method"] == "keras":
    import tensorflow as tf
    with tf.device(devices[0]):
      model.compile(**compile_args)
      runner = model
  else:
    runner = tfpipe.Pipeline(model, devices=devices[:K], method=config["method"],
                             micro_batches=config.get("micro_batches"))
    runner.compile(steps_per_execution=int(window) if window != "auto" else "auto",
                   **compile_args)
  times = []
  gc.collect()   # both epochs start with no garbage of the model's building
  for epoch in range(2):
    start = time.perf_counter()
    runner.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    if epoch == 0:
      # The full collection the first epoch's tracing makes due, counted where it is made:
      # left to run, it fell in the second epoch (0.37 s of a pipeline's, measured with
      # gc.callbacks; later epochs 0.01 s), which made the extra time read that much low.
      gc.collect()
    times.append(time.perf_counter() - start)
  return {"first": times[0], "second": times[1], "extra": times[0] - times[1],
          "micro_batches": getattr(runner, "micro_batches", 1)}


def _run(config):
  """`_one(config)` in a process of its own (`results_io.in_child`), or {"error": why}."""
  from bench import results_io
  return results_io.in_child_or_error(_one, config, FLAGS.timeout)


def main(argv):
  del argv
  if FLAGS.one:
    print("RESULT " + json.dumps(_one(json.loads(FLAGS.one))), flush=True)
    return
  from bench import results_io
  for name in FLAGS.models:
    if name not in workloads.SIZES:
      raise app.UsageError(f"--models: unknown model {name!r} (llama, resnet, mlp)")
    keras_result = _run({"model": name, "method": "keras", "K": 1, "window": "auto"})
    if "error" in keras_result:
      print(f"{name}: keras fit failed: {keras_result['error']}")
      continue
    base = keras_result["extra"]
    title = (f"{name}: Keras fit first-epoch extra {base:.1f} s, second epoch "
             f"{keras_result['second']:.1f} s")
    print(title, flush=True)
    rows = []
    for K in FLAGS.stages:
      for method in FLAGS.methods:
        label, cells = method, []
        for window in FLAGS.windows:
          result = _run({"model": name, "method": method, "K": int(K), "window": window,
                         "micro_batches": FLAGS.micro_batches})
          if "error" in result:
            cells += ["error", "", ""]
            print(f"  {method} K={K} window={window}: {result['error']}", flush=True)
            continue
          label = f"{method} (M={result['micro_batches']})"
          cells += [f"{result['extra']:.1f}", f"{result['extra'] / base:.1f}",
                    f"{result['second']:.2f}"]
          print(f"  {label} K={K} window={window}: extra {result['extra']:.1f} s "
                f"({result['extra'] / base:.1f}x keras), second epoch {result['second']:.2f} s",
                flush=True)
        rows.append([label, K] + cells)
    header = ["method", "K"]
    for window in FLAGS.windows:
      header += [f"extra s (window {window})", "x keras", "2nd epoch s"]
    print(f"\n{title}")
    print(results_io.markdown_table(header, rows), flush=True)


if __name__ == "__main__":
  app.run(main)
