"""A model that does not fit on one host, trained across hosts of the same memory cap.

A KerasHub Llama (from config, random weights) trained with momentum SGD on token ids:
  1. Keras `fit` on one emulated host whose memory is capped at --cap: killed by the cap
     (the kernel's OOM killer), at the peak the host's control group read;
  2. Keras `fit` without a cap (a process of its own): its peak (VmHWM), losses and weights;
  3. the same training as a --method pipeline over --hosts emulated hosts, each capped at
     --cap, its TF server holding only its stages' weights, slots and activations; this
     program (the client, uncapped) holds the Keras model as built, as a GPU user's host
     memory does. Each host's peak (its control group) beside its stage's peak predicted
     before training (`tfpipe.training.footprint.predict`), and the largest difference of the
     final weights from Keras's, relative to the weights' scale.
Emulated hosts need root (network namespaces, memory control groups).

  python bench/memory_fit.py [--cap=3g --hosts=4 --layers=16 --hidden=1024 --steps=3]
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

flags.DEFINE_string("cap", "3g", "each host's memory cap (bytes, or with k, m, g)")
flags.DEFINE_integer("hosts", 4, "hosts of the pipeline (one stage each)")
flags.DEFINE_string("method", "1f1b", "a synchronous pipeline method")
common.define(micro_batches=2, batch_size=4, results_dir=results_io.RESULTS)
flags.DEFINE_string("partition", "params", "the pipeline's cuts (params: balance the weights, "
                    "what memory asks)")
flags.DEFINE_integer("layers", 16, "Llama decoder layers")
flags.DEFINE_integer("hidden", 1024, "Llama hidden size (heads of 128)")
flags.DEFINE_integer("vocabulary", 32000, "token ids")
flags.DEFINE_integer("length", 64, "tokens per sequence")
flags.DEFINE_integer("steps", 3, "mini-batches trained")
flags.DEFINE_enum("role", "main", ["main", "keras", "pipeline"], "internal: a process's part")
flags.DEFINE_string("out", "", "internal: where a part writes its result")
FLAGS = flags.FLAGS

_UNITS = {"k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}


def parse_bytes(text):
  """Bytes of "2.5g", "512m", "1000"."""
  text = str(text).strip().lower()
  try:
    value = float(text[:-1]) * _UNITS[text[-1]] if text[-1:] in _UNITS else float(text)
  except ValueError:
    value = -1
  if value <= 0:
    raise ValueError(f"--cap must be a number of bytes > 0, optionally with k, m or g. "
                     f"Received: {text!r}")
  return int(value)


def _model():
  import keras
  import keras_hub
  keras.utils.set_random_seed(0)
  heads = max(1, FLAGS.hidden // 128)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers, num_query_heads=heads,
      num_key_value_heads=heads, hidden_dim=FLAGS.hidden,
      intermediate_dim=FLAGS.hidden * 11 // 4)
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _data():
  import numpy as np
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, FLAGS.vocabulary, (FLAGS.batch_size * FLAGS.steps, FLAGS.length + 1))
  x = {"token_ids": tokens[:, :-1].astype("int32"),
       "padding_mask": np.ones((len(tokens), FLAGS.length), "int32")}
  return x, tokens[:, 1:].astype("int32")


def _compile_arguments():
  # Momentum SGD: its slot is a copy of the weights, as Adam's two are, but its step is
  # linear in the gradient (Adam's first steps make a float32 round-off of a gradient near
  # zero a step of the full learning rate either way).
  import keras
  return dict(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _peak_rss():
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _keras(out):
  """Keras fit in this process; writes its losses, peak and weights."""
  import numpy as np
  model = _model()
  model.compile(**_compile_arguments())
  x, y = _data()
  history = model.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0)
  np.savez(out + ".npz", *model.get_weights())
  with open(out, "w") as f:
    json.dump({"loss": history.history["loss"], "peak": _peak_rss(),
               "parameters": int(model.count_params())}, f)


def _pipeline(out):
  """The pipeline on capped emulated hosts, this process their client."""
  import numpy as np
  import tfpipe
  from tfpipe.training import footprint
  cap = parse_bytes(FLAGS.cap)
  with tfpipe.cluster.EmulatedCluster({"worker": FLAGS.hosts}, link="10gbit",
                                      memory=cap) as hosts:
    hosts.enter_client()
    devices = tfpipe.cluster.connect(hosts.spec)
    groups = [hosts.hosts[("worker", k)].group for k in range(FLAGS.hosts)]
    idle = [group.usage() for group in groups]   # a server that holds no stage yet
    model = _model()
    pipe = tfpipe.Pipeline(model, devices=devices, method=FLAGS.method,
                           micro_batches=FLAGS.micro_batches, partition=FLAGS.partition)
    pipe.compile(**_compile_arguments())
    x, y = _data()
    predicted = footprint.predict(pipe, FLAGS.batch_size,
                                  [v.shape for v in (x["token_ids"], x["padding_mask"])])
    start = time.monotonic()
    history = pipe.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0)
    seconds = time.monotonic() - start
    peaks = [group.peak() for group in groups]
    np.savez(out + ".npz", *model.get_weights())
    with open(out, "w") as f:
      json.dump({"loss": history.history["loss"], "peaks": peaks, "seconds": seconds,
                 "idle": idle,
                 "predicted": [row["total"] for row in predicted],
                 "client_peak": _peak_rss()}, f)
  os._exit(0)   # TensorFlow's teardown would try to reach the stopped servers


def _part(role, out, network=None):
  """Runs this script's `role` in a process of its own (on `network`'s host 0 when given);
  (exit code, its result or None)."""
  argv = [sys.executable, os.path.abspath(__file__), f"--role={role}", f"--out={out}"] + [
      f"--{name}={FLAGS[name].value}" for name in
      ("cap", "hosts", "method", "micro_batches", "partition", "layers", "hidden", "vocabulary", "length",
       "batch_size", "steps")]
  if network is None:
    code = subprocess.run(argv).returncode
  else:
    code = network.popen(network.hosts[0], argv).wait()
  result = None
  if code == 0 and os.path.exists(out):
    with open(out) as f:
      result = json.load(f)
  return code, result


def _gib(n):
  return f"{n / 2 ** 30:.2f}"


def main(argv):
  del argv
  if FLAGS.role == "keras":
    return _keras(FLAGS.out)
  if FLAGS.role == "pipeline":
    return _pipeline(FLAGS.out)
  try:
    cap = parse_bytes(FLAGS.cap)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  import numpy as np
  from tfpipe.cluster import emulation
  folder = tempfile.mkdtemp(prefix="tfpipe-memory-fit-")
  try:
    with emulation.Network(1, link="10gbit", memory=cap) as one:
      capped_code, _ = _part("keras", os.path.join(folder, "capped"), one)
      capped_peak = one.hosts[0].group.peak()
    print(f"Keras on one host capped at {FLAGS.cap}: exit {capped_code}, peak "
          f"{_gib(capped_peak)} GiB", flush=True)
    code, keras_run = _part("keras", os.path.join(folder, "keras"))
    if keras_run is None:
      raise SystemExit(f"Keras without a cap failed (exit {code})")
    print(f"Keras without a cap: peak {_gib(keras_run['peak'])} GiB", flush=True)
    code, piped = _part("pipeline", os.path.join(folder, "pipeline"))
    if piped is None:
      raise SystemExit(f"the pipeline failed (exit {code})")
    ours = np.load(os.path.join(folder, "pipeline.npz"))
    theirs = np.load(os.path.join(folder, "keras.npz"))
    names = sorted(ours.files, key=lambda n: int(n.split("_")[1]))
    scale = max(float(np.max(np.abs(theirs[n]))) for n in names)
    gap = max(float(np.max(np.abs(ours[n] - theirs[n]))) for n in names) / scale
  finally:
    for name in os.listdir(folder):
      os.remove(os.path.join(folder, name))
    os.rmdir(folder)
  killed = "killed by the cap" if capped_code in (-9, 137) else f"exit {capped_code}"
  lines = [
      f"`python bench/memory_fit.py --cap={FLAGS.cap} --hosts={FLAGS.hosts} "
      f"--method={FLAGS.method} --micro_batches={FLAGS.micro_batches} "
      f"--partition={FLAGS.partition} --layers={FLAGS.layers} "
      f"--hidden={FLAGS.hidden} --vocabulary={FLAGS.vocabulary} --length={FLAGS.length} "
      f"--batch_size={FLAGS.batch_size} --steps={FLAGS.steps}`: a KerasHub Llama of "
      f"{keras_run['parameters'] / 1e6:.0f} M parameters ({_gib(4 * keras_run['parameters'])} "
      "GiB of float32 weights), momentum SGD", "",
      f"- Keras `fit` on one host capped at {_gib(cap)} GiB: {killed}, at a peak of "
      f"{_gib(capped_peak)} GiB",
      f"- Keras `fit` without a cap: peak {_gib(keras_run['peak'])} GiB (VmHWM), losses "
      f"{[round(v, 5) for v in keras_run['loss']]}",
      f"- {FLAGS.method} on {FLAGS.hosts} hosts capped at {_gib(cap)} GiB each: trained in "
      f"{piped['seconds']:.0f} s, losses {[round(v, 5) for v in piped['loss']]}; final "
      f"weights differ from Keras's by {gap:.1e} of their scale; the client (uncapped, "
      f"holding the Keras model) peaked at {_gib(piped['client_peak'])} GiB", ""]
  table = results_io.markdown_table(
      ["host (stage)", "peak GiB (control group)", "idle server GiB", "peak - idle",
       "predicted GiB (before training)", "error"],
      [[k, _gib(p), _gib(i), _gib(p - i), _gib(c), f"{100 * (c - (p - i)) / (p - i):+.0f}%"]
       for k, (p, i, c) in enumerate(zip(piped["peaks"], piped["idle"], piped["predicted"]))])
  results_io.report(FLAGS.results_dir, "memory_fit.md",
                    "# A Llama that does not fit on one host, trained across capped hosts",
                    "\n".join(lines) + "\n" + table)


if __name__ == "__main__":
  app.run(main)
