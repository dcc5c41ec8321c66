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
flags.DEFINE_list("allocators", ["bfc", "malloc"], "the servers' CPU allocators, each run "
                  "under each side by side: bfc (TensorFlow's, tfpipe's default), malloc (the "
                  "C library's adaptive mmap threshold), malloc:BYTES (a fixed one); the "
                  "prediction is checked under the first")
flags.DEFINE_string("role", "main", "internal: `main`, or `model,method,allocator` for one run")
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


def _allocator(text):
  """(CPU allocator, mmap threshold) of an --allocators entry; a UsageError names a bad one."""
  name, _, threshold = text.partition(":")
  if name not in ("bfc", "malloc") or (
      threshold and (name != "malloc" or not threshold.isdigit())):
    raise app.UsageError(f"--allocators takes bfc, malloc or malloc:BYTES. Received: {text!r}")
  return name, int(threshold or 0)


def _run(model_name, method, allocator_text, out):
  """One pipeline on emulated hosts; writes the prediction, each host's measured peak and
  each epoch's seconds."""
  import keras
  import tensorflow as tf
  import tfpipe
  from tfpipe.training import footprint
  name, threshold = _allocator(allocator_text)
  with tfpipe.cluster.EmulatedCluster({"worker": FLAGS.hosts}, link="10gbit", memory=64 << 30,
                                      mmap_threshold=threshold, cpu_allocator=name) as hosts:
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


def _one(model_name, method, allocator_text, folder):
  out = os.path.join(folder, f"{model_name}-{method}-{allocator_text.replace(':', '-')}.json")
  argv = [sys.executable, os.path.abspath(__file__),
          f"--role={model_name},{method},{allocator_text}", f"--out={out}"] + [
              f"--{name}={FLAGS[name].value}" for name in
              ("hosts", "micro_batches", "batch_size", "steps", "optimizer")]
  code = subprocess.run(argv).returncode
  if code != 0 or not os.path.exists(out):
    return None, f"exit {code}"
  with open(out) as f:
    return json.load(f), None


def _mib(n):
  return f"{n / 2 ** 20:.0f}"


def _host_parts(result, host):
  return [row for row, h in zip(result["predicted"], result["host_of_stage"]) if h == host]


def _dense(row):
  """A row's bytes of weights with dense gradients (its temporaries' base)."""
  from tfpipe.training import footprint
  return row["temporaries"] / footprint.TEMPORARIES


def compare(result, fit=None):
  """Per host: (predicted bytes of its stages, measured peak - idle, relative error); with
  `fit` = (temporaries factor, runtime bytes), the prediction's two fitted terms taken at
  those values."""
  rows = []
  for host, (peak, idle) in enumerate(zip(result["peaks"], result["idle"])):
    parts = _host_parts(result, host)
    predicted = sum(row["total"] for row in parts)
    if fit is not None:
      predicted += sum(fit[0] * _dense(row) - row["temporaries"] - row["runtime"]
                       for row in parts) + fit[1]
    measured = peak - idle
    rows.append((predicted, measured, (predicted - measured) / measured))
  return rows


def best_fit(results):
  """(temporaries factor, runtime bytes) that fit every host of `results` best (least
  squares): measured peak = the other fields + factor x dense weight bytes + runtime."""
  import numpy as np
  lhs, rhs = [], []
  for result in results:
    for host, (peak, idle) in enumerate(zip(result["peaks"], result["idle"])):
      parts = _host_parts(result, host)
      rest = sum(row["total"] - row["temporaries"] - row["runtime"] for row in parts)
      lhs.append([sum(_dense(row) for row in parts), 1.0])
      rhs.append(peak - idle - rest)
  factor, runtime = np.linalg.lstsq(np.array(lhs), np.array(rhs), rcond=None)[0]
  return float(factor), float(runtime)


def _allocator_words(text):
  name, threshold = _allocator(text)
  return ("TensorFlow's BFC" if name == "bfc" else "malloc, adaptive mmap threshold"
          if not threshold else f"malloc, mmap threshold {threshold} bytes")


def main(argv):
  del argv
  if FLAGS.role != "main":
    model_name, method, allocator_text = FLAGS.role.split(",")
    return _run(model_name, method, allocator_text, FLAGS.out)
  unknown = [m for m in FLAGS.models if m not in MODELS]
  if unknown:
    raise app.UsageError(f"--models takes {', '.join(MODELS)}. Received: {unknown}")
  for text in FLAGS.allocators:
    _allocator(text)
  allocators = FLAGS.allocators
  from tfpipe.training import footprint
  folder = tempfile.mkdtemp(prefix="tfpipe-memory-predicted-")
  table, side, results = [], [], []
  try:
    for model_name in FLAGS.models:
      for method in FLAGS.methods:
        if model_name == "llama" and method not in SYNCHRONOUS:
          continue   # its tied embedding sits on the first and last stages
        runs = [_one(model_name, method, a, folder) for a in allocators]
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
      f"--allocators={','.join(allocators)}`. MiB per host: predicted before "
      "training (the sum of its stages' `tfpipe.training.footprint.predict` totals: "
      f"temporaries {footprint.TEMPORARIES} x the bytes of weights with dense gradients, "
      f"runtime {footprint.RUNTIME / 2 ** 20:.0f} MiB a host), measured as the control "
      "group's peak less the "
      f"idle server's usage, the servers' CPU allocator "
      f"{_allocator_words(allocators[0])}.", ""]
  if results:
    errors = [abs(e) for r in results for _, _, e in compare(r)]
    fit = best_fit(results)
    at_fit = [abs(e) for r in results for _, _, e in compare(r, fit)]
    lines += [f"Largest error: {100 * max(errors):.0f}%; within 20%: "
              f"{sum(e <= 0.2 for e in errors)} of {len(errors)} hosts. The two fitted terms "
              f"that fit these hosts best (least squares): temporaries {fit[0]:.2f} x the dense "
              f"weight bytes, runtime {fit[1] / 2 ** 20:.0f} MiB; at them, within 20%: "
              f"{sum(e <= 0.2 for e in at_fit)} of {len(at_fit)} hosts (largest error "
              f"{100 * max(at_fit):.0f}%).", ""]
  text = "\n".join(lines) + "\n" + results_io.markdown_table(
      ["model", "method", "host", "predicted MiB", "measured MiB", "error",
       "predicted parts (MiB)"], table)
  if side:
    text += ("\n\nEach run under each allocator, side by side: the largest host's peak above "
             "idle (MiB), and the second epoch's speed relative to the first allocator's "
             "(the first's seconds over its own).\n\n" + results_io.markdown_table(
                 ["model", "method"] + [f"peak MiB, {_allocator_words(a)}" for a in allocators]
                 + [f"speed, {_allocator_words(a)}" for a in allocators[1:]], side))
  results_io.report(FLAGS.results_dir, "memory_predicted.md",
                    "# Per-stage memory, predicted before training and measured on hosts", text)


if __name__ == "__main__":
  app.run(main)
