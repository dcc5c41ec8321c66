"""Every method on the quickstart model (digits, 2 stages): accuracy, samples/s, and the simulator.

For each method: trains the SpecTrain paper's SNN on scikit-learn's digits with the
trainer's `run` (the quickstart config, fewer epochs by default), reports
the best validation accuracy and the median samples/s over epochs; for the
pipeline methods it asks `tfpipe.plan.simulator` for the samples/s it predicts
for the same schedule from two sets of stage times:
  isolated: each stage's forward and backward timed alone on its device;
  timeline: the median task and transfer times recorded while the method
            ran (epochs after the first), which include what isolated
            timings miss (the stages share the cores, per-task overhead);
and prints predicted / measured for each.

  python bench/simulate_vs_measured.py [--epochs=5 --methods=gpipe,ddg]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import results_io  # noqa: E402

ALL = ("single", "dataparallel", "sequential", "gpipe", "vanilla", "pipedream", "spectrain",
       "ddg", "feature_replay", "timeprest")
flags.DEFINE_list("methods", list(ALL), "methods to run")
flags.DEFINE_integer("epochs", 5, "epochs per method")
flags.DEFINE_integer("micro_batches", 4, "micro-batches for gpipe and timeprest")
flags.DEFINE_integer("repeats", 20, "timed calls per profiled task")
FLAGS = flags.FLAGS


def profile_costs(pipe, batch, micro_batches, repeats):
  """Per-stage forward and backward seconds per mini-batch, measured at the method's unit size."""
  import tensorflow as tf
  from tfpipe.plan import simulator
  x, y = batch
  n = int(x.shape[0]) // micro_batches
  xs, y = [x[:n]], y[:n]
  one = tf.constant(1.0 / micro_batches, tf.float64)
  forward, backward, transfer = [], [], []
  for program in pipe.programs:
    if program.is_last:
      step = results_io.median_seconds(lambda: program.backward(
          [program.forward(xs, labels=(y, None))[1]], None, 0, one, False), repeats)
      forward.append(step / 3 * micro_batches)
      backward.append(2 * step / 3 * micro_batches)
      break
    f = results_io.median_seconds(lambda: program.forward(xs, 0), repeats)
    ys, kept = program.forward(xs, 0)
    dys = [tf.ones_like(t) for t in ys]
    fb = results_io.median_seconds(   # a recomputing backward: forward and backward
        lambda: program.backward([kept.recomputable()], dys, 0, one, False), repeats)
    forward.append(f * micro_batches)
    backward.append(max(fb - f, 0.0) * micro_batches)
    device = pipe.programs[program.index + 1].device
    transfer.append(results_io.median_seconds(lambda: [tf.identity(t).numpy() for t in _on(device, ys)], repeats)
                    * micro_batches)
    xs = ys
  pipe._load_weights()  # undo the profiling updates
  return simulator.Costs(forward, backward, transfer)


def _on(device, tensors):
  import tensorflow as tf
  with tf.device(device):
    return [tf.identity(t) for t in tensors]


def main(argv):
  del argv
  import numpy as np
  from tfpipe.plan import simulator
  from trainers import config as config_lib, main as trainer_main
  rows = []
  for method in FLAGS.methods:
    micro = FLAGS.micro_batches if method in ("gpipe", "timeprest") else None
    config = config_lib.TrainConfig(
        model="snn", snn_width=512, snn_depth=8, dataset="digits", method=method, num_stages=2,
        batch_size=32, learning_rate=0.01, momentum=0.9, epochs=FLAGS.epochs, seed=0, verbose=0,
        micro_batches=micro, breakdown=True)   # the recorded per-task timeline: threaded
    history, trainer, _ = trainer_main.run(config)
    measured = statistics.median(history["samples_per_second"][1:] or
                                 history["samples_per_second"])
    row = [method, max(history["val_accuracy"]), measured, None, None]
    if hasattr(trainer, "programs"):
      from trainers import datasets
      data = datasets.load(config)
      batch = next(iter(data.train))
      costs = profile_costs(trainer, batch, trainer.micro_batches, FLAGS.repeats)
      batches = int(data.train.cardinality())
      timeline = simulator.simulate_method(method, costs, batches, micro_batches=micro)
      row[3] = timeline.samples_per_second(config.batch_size)
      records = [r for r in trainer.records if r.epoch >= 1] or trainer.records
      recorded = simulator.costs_from_records(records, trainer.num_stages, trainer.micro_batches,
                                              trainer.policy.recompute)
      timeline = simulator.simulate_method(method, recorded, batches, micro_batches=micro)
      row[4] = timeline.samples_per_second(config.batch_size)
    rows.append(row)
    print(f"{method}: done", flush=True)
  print(f"\nsnn 8 x 512 on digits, 2 stages, batch 32, {FLAGS.epochs} epochs "
        f"(median samples/s over epochs after the first)")
  print(f"{'':<40}{'isolated times':>23}{'timeline times':>23}")
  print(f"{'method':<16}{'max val_acc':>12}{'samples/s':>12}" +
        f"{'predicted':>12}{'pred/meas':>11}" * 2)
  for method, acc, measured, *predicted in rows:
    cells = "".join(f"{p:>12.0f}{p / measured:>11.2f}" if p else f"{'-':>12}{'-':>11}"
                    for p in predicted)
    print(f"{method:<16}{acc:>12.4f}{measured:>12.0f}{cells}")
  for label, column in (("isolated", 3), ("timeline", 4)):
    errors = np.abs(np.array([r[column] / r[2] for r in rows if r[column]]) - 1)
    if errors.size:
      print(f"prediction error |pred/meas - 1| from {label} times: median "
            f"{np.median(errors):.2f}, max {np.max(errors):.2f}")


if __name__ == "__main__":
  app.run(main)
