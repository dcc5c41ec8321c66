"""What bounds a pipeline's steady state: the compiled executor's choices side by side.

On `bench/startup.py`'s 12-layer Llama (width 64, batch 16, 64 batches an epoch) at K
stages on K logical CPUs (one intra-op thread each), each method trains `--epochs` epochs
under each variant of the compiled executor, beside plain Keras `fit` on one device:

  calls:    the default: windows of stage-function calls, `CALL_WINDOW` mini-batches a call
            (forwards in flight at a call's end cross it without their tapes: recomputed);
  calls16:  the same, 16 mini-batches a call (4x fewer boundaries, 4x fewer recomputes);
  inlined:  every task's body traced into the window's graph (one optimised graph, no call
            per task: what small stages get; here it traces the whole model per window);
  xla:      stage functions compiled by XLA (`jit_compile=True`), and Keras likewise.

Keras `fit` on arrays deletes each epoch's tf.data iterator on its own thread, and the
deletion joins the input's autotuning thread, whose sleep it does not cut short: measured
(this model, 7 epochs in one `fit`, per-thread CPU sampled every 0.25 s), about half the
epochs hold a pause of 0.75-1 s in which no thread of the process runs (1.5 s epochs become
2.5 s); fed a dataset with autotuning off, every epoch ran 1.56-1.60 s. tfpipe deletes its
iterators off the caller's thread (`tfpipe.runtime.iterators`). So Keras is timed twice: as
users run it ("calls": arrays), and on its input without autotuning ("no pause": its compute
alone), and each pipeline's steady epoch is set against both.

It reports each run's first-epoch extra time (the first epoch minus the steady one), the
steady epoch (the median of the epochs after the first), x Keras's steady speed, and the
CPU seconds a steady epoch takes with the cores busy meanwhile (the process's CPU time over
the epoch's wall-clock): the work an executor adds shows as CPU seconds, and how many of the
cores Keras itself used bounds what a pipeline on them can gain. Each run is a process of
its own.

  python bench/steady_state.py [--methods=spectrain,1f1b --stages=4 --epochs=3
                                --variants=calls,calls16,inlined,xla]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import results_io, workloads  # noqa: E402

flags.DEFINE_list("methods", ["spectrain", "1f1b"], "pipelined methods (their own defaults)")
flags.DEFINE_integer("stages", 4, "K")
flags.DEFINE_integer("epochs", 3, "epochs per run (the first is start-up)")
flags.DEFINE_integer("layers", 12, "decoder layers of the Llama model")
flags.DEFINE_list("variants", ["calls", "calls16", "inlined", "xla"], "executor variants")
flags.DEFINE_integer("timeout", 900, "seconds one run may take")
flags.DEFINE_string("results_dir", results_io.RESULTS, "where the table goes")
FLAGS = flags.FLAGS

VARIANTS = ("calls", "calls16", "inlined", "xla")


def _one(config):
  """Trains one configuration for `epochs` epochs; returns each epoch's seconds."""
  import keras
  import tensorflow as tf
  import tfpipe
  from tfpipe.runtime import compiled
  devices = tfpipe.create_logical_cpus(config["K"], intra_op_threads=1)
  x, y, batch = workloads.data("llama")
  model = workloads.model("llama", config["layers"])
  args = dict(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
  variant = config["variant"]
  data = dict(x=x, y=y, batch_size=batch, shuffle=False)
  if config["method"] == "keras":
    with tf.device(devices[0]):
      model.compile(**args, jit_compile=variant == "xla")
    runner = model
    if variant == "no pause":   # its input without tf.data's autotuning (see the docstring)
      options = tf.data.Options()
      options.autotune.enabled = False
      data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(
          options))
  else:
    if variant == "calls16":
      compiled.CompiledRuntime.CALL_WINDOW = compiled.CompiledRuntime.CALL_WINDOW_MICRO = 16
    if variant == "inlined":
      compiled.CompiledRuntime.INLINE_OPS = 10 ** 12
    runner = tfpipe.Pipeline(model, devices=devices[:config["K"]], method=config["method"],
                             jit_compile=True if variant == "xla" else None)
    runner.compile(**args)
  times, cpu = [], []
  gc.collect()
  for epoch in range(config["epochs"]):
    start, used = time.perf_counter(), _cpu_seconds()
    runner.fit(**data, epochs=1, verbose=0)
    if epoch == 0:
      gc.collect()   # the collection the first epoch's tracing makes due (bench/startup.py)
    times.append(time.perf_counter() - start)
    cpu.append(_cpu_seconds() - used)
  return {"times": times, "cpu": cpu, "micro_batches": getattr(runner, "micro_batches", 1)}


def _cpu_seconds():
  """This process's CPU time so far (user and system, every thread)."""
  now = os.times()
  return now.user + now.system


def main(argv):
  del argv
  for variant in FLAGS.variants:
    if variant not in VARIANTS:
      raise app.UsageError(f"--variants: {variant!r} is not one of {', '.join(VARIANTS)}")
  if FLAGS.epochs < 2:
    raise app.UsageError(f"--epochs must be at least 2 (one start-up, one steady). "
                         f"Received: {FLAGS.epochs}")
  base = dict(K=FLAGS.stages, layers=FLAGS.layers, epochs=FLAGS.epochs)
  rows, keras_steady = [], {}
  for variant in ("calls", "no pause") + (("xla",) if "xla" in FLAGS.variants else ()):
    result = results_io.in_child_or_error(_one, dict(base, method="keras", variant=variant),
                                          FLAGS.timeout)
    if "error" not in result:
      keras_steady[variant] = statistics.median(result["times"][1:])
    rows.append(_row("keras fit" + (" (XLA)" if variant == "xla" else ""), variant, result,
                     keras_steady.get("calls"), keras_steady.get("no pause")))
  for method in FLAGS.methods:
    for variant in FLAGS.variants:
      result = results_io.in_child_or_error(_one, dict(base, method=method, variant=variant),
                                            FLAGS.timeout)
      rows.append(_row(method, variant, result, keras_steady.get("calls"),
                       keras_steady.get("no pause")))
      print(" | ".join(rows[-1]), flush=True)
  title = (f"Steady state: Llama ({FLAGS.layers} layers, width 64, batch 16, 64 batches an "
           f"epoch), K={FLAGS.stages} logical CPUs, one intra-op thread each, {FLAGS.epochs} "
           f"epochs; `python bench/steady_state.py --methods={','.join(FLAGS.methods)} "
           f"--variants={','.join(FLAGS.variants)}`")
  table = results_io.markdown_table(
      ["runner", "variant", "M", "first-epoch extra s", "steady s/epoch", "x Keras steady",
       "x Keras without its pause", "CPU s/epoch", "cores busy"],
      rows)
  results_io.report(FLAGS.results_dir, "steady_state.md", title, table)


def _row(name, variant, result, keras, unpaused):
  if "error" in result:
    return [name, variant, "-", "-", "-", result["error"], "-", "-", "-"]
  steady = statistics.median(result["times"][1:])
  cpu = statistics.median(result["cpu"][1:])
  speed = f"{keras / steady:.2f}" if keras else "-"
  against = f"{unpaused / steady:.2f}" if unpaused else "-"
  return [name, variant, str(result["micro_batches"]), f"{result['times'][0] - steady:.1f}",
          f"{steady:.2f}", speed, against, f"{cpu:.2f}", f"{cpu / steady:.2f}"]


if __name__ == "__main__":
  app.run(main)
