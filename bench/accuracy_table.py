"""The SpecTrain paper's table 1 in miniature: min train loss, min validation loss and max
validation accuracy of every method, on workloads that run offline here, with learning curves.

Each workload is MODEL:DATASET (default snn:digits, the quickstart model); a
tfds dataset (cifar10, imdb_reviews) runs when it is already in --data_dir or
TFDS_DATA_DIR and is skipped with a note otherwise. Every method trains from
the same initial weights and data order with the trainer's `run`. Writes
bench/results/accuracy_<model>_<dataset>.md and a PNG of the validation curves.

  python bench/accuracy_table.py [--epochs=15 --workloads=snn:digits,vgg16:cifar10]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import common, results_io  # noqa: E402

flags.DEFINE_list("workloads", ["snn:digits"], "MODEL:DATASET pairs")
flags.DEFINE_list("methods", None, "methods (default: every method tfpipe has but asgd)")
flags.DEFINE_integer("epochs", 15, "epochs per method")
flags.DEFINE_integer("num_stages", 2, "stages (devices for dataparallel)")
common.define(batch_size=32, results_dir=results_io.RESULTS)
flags.DEFINE_float("learning_rate", 0.01, "learning rate")
flags.DEFINE_float("model_scale", 1.0, "model width multiplier")
flags.DEFINE_string("data_dir", None, "tfds data directory (default: $TFDS_DATA_DIR)")
FLAGS = flags.FLAGS

SNN_QUICKSTART = dict(snn_width=512, snn_depth=8)


def plot(curves, title, path):
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for method, history in curves.items():
    epochs = range(1, len(history["val_loss"]) + 1)
    axes[0].plot(epochs, history["val_loss"], label=method)
    axes[1].plot(epochs, history["val_accuracy"], label=method)
  for ax, label in zip(axes, ("validation loss", "validation accuracy")):
    ax.set_xlabel("epoch")
    ax.set_ylabel(label)
  axes[0].set_yscale("log")
  axes[1].legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run_workload(model, dataset):
  import tfpipe
  from trainers import config as config_lib, datasets, main as trainer_main
  # asgd joins a cluster, which this process would stay joined to: run it on its own.
  methods = FLAGS.methods or [m for m in tfpipe.METHODS if m not in tfpipe.CLUSTER_METHODS]
  base = dict(model=model, dataset=dataset, num_stages=FLAGS.num_stages,
              batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate, momentum=0.9,
              epochs=FLAGS.epochs, seed=0, verbose=0, model_scale=FLAGS.model_scale,
              data_dir=FLAGS.data_dir, breakdown=False, throughput_window=None)
  if model == "snn":
    base.update(SNN_QUICKSTART)
  try:
    datasets.load(config_lib.TrainConfig(**base))
  except datasets.DataUnavailableError as e:
    print(f"{model}:{dataset}: skipped, the data is not here ({str(e).splitlines()[0]})")
    return None
  rows, curves = [], {}
  for method in methods:
    history, _, _ = trainer_main.run(config_lib.TrainConfig(**dict(base, method=method)))
    curves[method] = history
    rows.append([method, f"{min(history['loss']):.4f}", f"{min(history['val_loss']):.4f}",
                 f"{100 * max(history['val_accuracy']):.2f}%"])
    print(f"{model}:{dataset} {method}: done", flush=True)
  title = (f"{model} on {dataset}, {FLAGS.num_stages} stages, batch {FLAGS.batch_size}, "
           f"lr {FLAGS.learning_rate}, {FLAGS.epochs} epochs")
  table = results_io.markdown_table(
      ["method", "min train loss", "min validation loss", "max validation accuracy"], rows)
  name = f"accuracy_{model}_{dataset}"
  png = os.path.join(FLAGS.results_dir, name + ".png")
  os.makedirs(FLAGS.results_dir, exist_ok=True)
  plot(curves, title, png)
  text = f"{title}\n\n{table}\n\nLearning curves: {name}.png\n"
  results_io.write(FLAGS.results_dir, name + ".md", text)
  return text


def main(argv):
  del argv
  from trainers import config as config_lib, main as trainer_main
  trainer_main.setup_devices(config_lib.TrainConfig(num_stages=FLAGS.num_stages))  # before TF runs
  for workload in FLAGS.workloads:
    model, _, dataset = workload.partition(":")
    if not dataset:
      raise app.UsageError(f"a workload is MODEL:DATASET. Received: {workload!r}")
    text = run_workload(model, dataset)
    if text:
      print("\n" + text)


if __name__ == "__main__":
  app.run(main)
