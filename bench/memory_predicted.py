"""Each stage's memory as predicted before training, against its host's measured peak.

For each --models model and --methods method: a pipeline on --hosts emulated hosts (each
server a process of its own in a memory control group), compiled, its per-stage memory
predicted (`tfpipe.training.footprint.predict`), then trained; each host's measured peak above
what its idle server held (the control group's peak less its usage once connected) is set
beside the prediction of the stages it holds. Each run is a process of its own, on hosts of
its own. Emulated hosts need root (network namespaces, memory control groups).

Models: llama (a KerasHub Llama from config, tied embedding: synchronous methods only),
transformer (the SpecTrain paper's, `tfpipe.models`), vgg16 (CIFAR-shaped images).

  python bench/memory_predicted.py [--models=llama,transformer,vgg16 --methods=gpipe,1f1b]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from bench import common, results_io  # noqa: E402

MODELS = ("llama", "transformer", "vgg16")
SYNCHRONOUS = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
flags.DEFINE_list("models", list(MODELS), f"models, of {MODELS}")
flags.DEFINE_list("methods", list(SYNCHRONOUS) + ["pipedream", "spectrain"],
                  "pipeline methods (asynchronous ones skip the tied Llama)")
flags.DEFINE_integer("hosts", 2, "emulated hosts (interleaved and zbv: two stages each)")
common.define(micro_batches=4, batch_size=8, results_dir=results_io.RESULTS)
flags.DEFINE_integer("steps", 6, "mini-batches per epoch (two epochs)")
flags.DEFINE_enum("optimizer", "momentum", ["sgd", "momentum", "adam"], "each stage's optimizer")
flags.DEFINE_list("mmap_thresholds", ["-1", "0"], "the servers' malloc mmap thresholds, "
                  "each run under each side by side (bytes; -1: tfpipe's default, 0: the C "
                  "library's adaptive one); the prediction is checked under the first")
flags.DEFINE_string("role", "main", "internal: `main`, or `model,method,threshold` for one run")
flags.DEFINE_string("out", "", "internal: where a run writes its result")
FLAGS = flags.FLAGS

_LENGTH, _VOCABULARY = 64, 8000


def _model(name):
  import keras
  keras.utils.set_random_seed(0)
  if name == "llama":
    import keras_hub
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=_VOCABULARY, num_layers=4, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=512, intermediate_dim=512 * 11 // 4)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
  from tfpipe import models
  if name == "transformer":
    return models.build("transformer", (_LENGTH,), 10, scale=0.5, vocab_size=_VOCABULARY,
                        blocks=2)
  return models.build("vgg16", (32, 32, 3), 10)


def _data(name):
  import numpy as np
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.steps
  if name == "llama":
    tokens = rng.integers(1, _VOCABULARY, (n, _LENGTH + 1))
    return ({"token_ids": tokens[:, :-1].astype("int32"),
             "padding_mask": np.ones((n, _LENGTH), "int32")}, tokens[:, 1:].astype("int32"))
  labels = rng.integers(0, 10, n).astype("int32")
  if name == "transformer":
    return rng.integers(1, _VOCABULARY, (n, _LENGTH)).astype("int32"), labels
  return rng.standard_normal((n, 32, 32, 3)).astype("float32"), labels


def _optimizer():
  import keras
  return {"sgd": lambda: keras.optimizers.SGD(0.01),
          "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
          "adam": lambda: keras.optimizers.Adam(1e-3)}[FLAGS.optimizer]()


class _EpochTimes:
  """A Keras callback: each epoch's seconds."""

  def __init__(self):
    import keras
    times = self.seconds = []

    class Callback(keras.callbacks.Callback):
      def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

      def on_epoch_end(self, epoch, logs=None):
        times.append(time.perf_counter() - self.start)

    self.callback = Callback()


def _run(model_name, method, threshold, out):
  """One pipeline on emulated hosts; writes the prediction, each host's measured peak and
  each epoch's seconds."""
  import keras
  import tensorflow as tf
  import tfpipe
  from tfpipe.cluster import allocator
  from tfpipe.training import footprint
  threshold = allocator.MMAP_THRESHOLD if threshold < 0 else threshold
  with tfpipe.cluster.EmulatedCluster({"worker": FLAGS.hosts}, link="10gbit", memory=64 << 30,
                                      mmap_threshold=threshold) as hosts:
    hosts.enter_client()
    devices = tfpipe.cluster.connect(hosts.spec)
    groups = [hosts.hosts[("worker", k)].group for k in range(FLAGS.hosts)]
    idle = [group.usage() for group in groups]
    model = _model(model_name)
    pipe = tfpipe.Pipeline(model, devices=devices, method=method, partition="params",
                           micro_batches=FLAGS.micro_batches)
    pipe.compile(_optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(model_name)
    shapes = [tuple(v.shape[:1]) + tuple(v.shape[1:]) for v in tf.nest.flatten(x)]
    predicted = footprint.predict(pipe, FLAGS.batch_size, shapes)
    epochs = _EpochTimes()
    pipe.fit(x, y, batch_size=FLAGS.batch_size, epochs=2, shuffle=False, verbose=0,
             callbacks=[epochs.callback])
    peaks = [group.peak() for group in groups]
    placed = sorted(set(pipe.devices), key=pipe.devices.index)
    with open(out, "w") as f:
      json.dump({"predicted": predicted, "peaks": peaks, "idle": idle, "epochs": epochs.seconds,
                 "host_of_stage": [placed.index(d) for d in pipe.devices]}, f)
  os._exit(0)   # TensorFlow's teardown would try to reach the stopped servers


def _one(model_name, method, threshold, folder):
  out = os.path.join(folder, f"{model_name}-{method}-{threshold}.json")
  argv = [sys.executable, os.path.abspath(__file__),
          f"--role={model_name},{method},{threshold}", f"--out={out}"] + [
              f"--{name}={FLAGS[name].value}" for name in
              ("hosts", "micro_batches", "batch_size", "steps", "optimizer")]
  code = subprocess.run(argv).returncode
  if code != 0 or not os.path.exists(out):
    return None, f"exit {code}"
  with open(out) as f:
    return json.load(f), None


def _mib(n):
  return f"{n / 2 ** 20:.0f}"


def compare(result, buffers=None):
  """Per host: (predicted bytes of its stages, measured peak - idle, relative error), the
  prediction's buffers taken as `buffers` times the trainable bytes where given."""
  rows = []
  for host, (peak, idle) in enumerate(zip(result["peaks"], result["idle"])):
    parts = [row for row, h in zip(result["predicted"], result["host_of_stage"]) if h == host]
    predicted = sum(row["total"] for row in parts)
    if buffers is not None:
      predicted += sum(buffers * row["gradients"] - row["buffers"] for row in parts)
    measured = peak - idle
    rows.append((predicted, measured, (predicted - measured) / measured))
  return rows


def exact_factors(results):
  """Per host of `results`, the buffers factor (times its trainable bytes) that would make
  its prediction equal its measured peak."""
  factors = []
  for result in results:
    for host, (peak, idle) in enumerate(zip(result["peaks"], result["idle"])):
      parts = [row for row, h in zip(result["predicted"], result["host_of_stage"]) if h == host]
      trainable = sum(row["gradients"] for row in parts)
      rest = sum(row["total"] - row["buffers"] for row in parts)
      if trainable:
        factors.append((peak - idle - rest) / trainable)
  return factors


def _threshold_words(threshold):
  return ("tfpipe's default" if threshold < 0 else "the C library's adaptive one"
          if threshold == 0 else f"{threshold} bytes")


def main(argv):
  del argv
  if FLAGS.role != "main":
    model_name, method, threshold = FLAGS.role.split(",")
    return _run(model_name, method, int(threshold), FLAGS.out)
  unknown = [m for m in FLAGS.models if m not in MODELS]
  if unknown:
    raise app.UsageError(f"--models takes {', '.join(MODELS)}. Received: {unknown}")
  try:
    thresholds = [int(t) for t in FLAGS.mmap_thresholds]
  except ValueError:
    raise app.UsageError(f"--mmap_thresholds takes integers. Received: "
                         f"{FLAGS.mmap_thresholds}") from None
  from tfpipe.training import footprint
  folder = tempfile.mkdtemp(prefix="tfpipe-memory-predicted-")
  table, side, results = [], [], []
  try:
    for model_name in FLAGS.models:
      for method in FLAGS.methods:
        if model_name == "llama" and method not in SYNCHRONOUS:
          continue   # its tied embedding sits on the first and last stages
        runs = [_one(model_name, method, t, folder) for t in thresholds]
        result, why = runs[0]
        if result is None:
          print(f"{model_name} {method}: failed ({why})", flush=True)
          table.append([model_name, method, "", "", "", f"failed ({why})", ""])
          continue
        results.append(result)
        for host, (predicted, measured, error) in enumerate(compare(result)):
          parts = [row for row, h in zip(result["predicted"], result["host_of_stage"])
                   if h == host]
          detail = ", ".join(f"{field} {_mib(sum(r[field] for r in parts))}"
                             for field in footprint.FIELDS)
          table.append([model_name, method, host, _mib(predicted), _mib(measured),
                        f"{100 * error:+.0f}%", detail])
          print(f"{model_name} {method} host {host}: predicted {_mib(predicted)} MiB, "
                f"measured {_mib(measured)} MiB ({100 * error:+.0f}%)", flush=True)
        if len(runs) > 1 and all(r is not None for r, _ in runs):
          peaks = [max(p - i for p, i in zip(r["peaks"], r["idle"])) for r, _ in runs]
          seconds = [r["epochs"][-1] for r, _ in runs]
          side.append([model_name, method] + [_mib(p) for p in peaks] +
                      [f"{seconds[0] / t:.2f}" for t in seconds[1:]])
  finally:
    for name in os.listdir(folder):
      os.remove(os.path.join(folder, name))
    os.rmdir(folder)
  lines = [
      f"`python bench/memory_predicted.py --models={','.join(FLAGS.models)} "
      f"--methods={','.join(FLAGS.methods)} --hosts={FLAGS.hosts} "
      f"--micro_batches={FLAGS.micro_batches} --batch_size={FLAGS.batch_size} "
      f"--steps={FLAGS.steps} --optimizer={FLAGS.optimizer} "
      f"--mmap_thresholds={','.join(FLAGS.mmap_thresholds)}`. MiB per host: predicted before "
      "training (the sum of its stages' `tfpipe.training.footprint.predict` totals, buffers "
      f"{footprint.BUFFERS} x trainable bytes), measured as the control group's peak less the "
      f"idle server's usage, the servers' malloc mmap threshold "
      f"{_threshold_words(thresholds[0])}.", ""]
  if results:
    errors = [abs(e) for r in results for _, _, e in compare(r)]
    factors = sorted(exact_factors(results))
    median = factors[len(factors) // 2]
    at_median = [abs(e) for r in results for _, _, e in compare(r, median)]
    lines += [f"Largest error: {100 * max(errors):.0f}%; within 20%: "
              f"{sum(e <= 0.2 for e in errors)} of {len(errors)} hosts. The buffers factor "
              f"that would make each host's prediction exact: median {median:.1f}, from "
              f"{factors[0]:.1f} to {factors[-1]:.1f}; at the median, within 20%: "
              f"{sum(e <= 0.2 for e in at_median)} of {len(at_median)} hosts (largest error "
              f"{100 * max(at_median):.0f}%).", ""]
  text = "\n".join(lines) + "\n" + results_io.markdown_table(
      ["model", "method", "host", "predicted MiB", "measured MiB", "error",
       "predicted parts (MiB)"], table)
  if side:
    text += ("\n\nEach run under each threshold, side by side: the largest host's peak above "
             "idle (MiB), and the second epoch's speed relative to the first threshold's "
             "(its seconds over theirs).\n\n" + results_io.markdown_table(
                 ["model", "method"] + [f"peak MiB, {_threshold_words(t)}" for t in thresholds]
                 + [f"speed, {_threshold_words(t)}" for t in thresholds[1:]], side))
  results_io.report(FLAGS.results_dir, "memory_predicted.md",
                    "# Per-stage memory, predicted before training and measured on hosts", text)


if __name__ == "__main__":
  app.run(main)
