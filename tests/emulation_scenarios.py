"""Scenarios on emulated hosts, each run in a fresh process by tests/test_emulation.py.

`python -m tests.emulation_scenarios NAME NETNS SPEC` moves this process into
network namespace NETNS (the client's host) before TensorFlow starts a thread,
connects to the cluster SPEC (JSON) and prints one JSON line.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfpipe.cluster import emulation  # noqa: E402


def pipeline(devices):
  """A 2-stage 1F1B pipeline on the emulated servers, and the same on this host's CPUs."""
  import keras
  import numpy as np
  import tfpipe
  from tests import helpers
  x, y = helpers.as_arrays(helpers.batches(8))
  weights = []
  for where in (devices, tfpipe.default_devices()[:2]):
    pipe = tfpipe.Pipeline(helpers.mlp(), devices=where, method="1f1b", micro_batches=2)
    pipe.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                 keras.losses.SparseCategoricalCrossentropy())
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    weights.append(pipe.model.get_weights())
    if where is devices:
      stage1 = pipe.programs[1].trainable[0].value.device
  return {"gap": max(float(np.max(np.abs(a - b))) for a, b in zip(*weights)),
          "stage1_device": stage1, "samples": len(x), "width": 16}


def carried(devices, executor):
  """SpecTrain on the emulated servers (windows of stage calls, or inlined: `executor`), its
  kept forwards carried between windows; and the same on this host's CPUs. Its weights,
  stage 0's weight bytes and the windows run, for the bytes the client's link may carry."""
  import keras
  import numpy as np
  import tfpipe
  from tests import helpers
  from tfpipe.instruments import memory
  from tfpipe.rules import optimizers
  x, y = helpers.as_arrays(helpers.batches(8, inputs=64))
  weights = []
  for where in (devices, tfpipe.default_devices()[:2]):
    pipe = tfpipe.Pipeline(helpers.mlp(width=384, depth=2, inputs=64), devices=where,
                           method="spectrain", partition=["logits"])
    pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy(),
                 steps_per_execution=1)
    if executor == "calls":
      pipe.runtime.inline = False
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    weights.append(pipe.model.get_weights())
    if where is devices:
      stage0 = memory.variable_bytes(pipe.programs[0].trainable)
      traces = pipe.runtime.traces
  return {"gap": max(float(np.max(np.abs(a - b))) for a, b in zip(*weights)),
          "stage0_bytes": stage0, "windows": len(x) // 16, "traces": traces,
          "model_bytes": sum(w.nbytes for w in weights[0])}


def replicas(devices, hub):
  """3 replicas of a 2-stage 1F1B pipeline, one stage per host: Keras's weights at the global
  batch (float64), and each host's bytes sent per step with the gradients summed as by
  default (across hosts: a ring, each replica its own weights) and by a reduction to
  replica 0 (weights sent out)."""
  import keras
  import numpy as np
  import tfpipe
  from tests import helpers
  from tfpipe.instruments import traffic
  x, y = helpers.as_arrays(helpers.batches(9, batch_size=12, inputs=64))
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  make = lambda: helpers.sequential_mlp(width=256, depth=2, inputs=64, dtype="float64")
  expected = make()
  expected.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss())
  expected.fit(x, y, batch_size=12, shuffle=False, verbose=0)
  result = {}
  for ops in (None, "reduce_to_one_device"):
    pipe = tfpipe.Pipeline(make(), devices=devices, method="1f1b", micro_batches=2,
                           data_parallel=3, cross_device_ops=ops)
    pipe.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss(), steps_per_execution=1)
    # As for stages too large to inline by their size: replicas on servers inline all the same.
    pipe.runtime.INLINE_OPS = pipe.runtime.INLINE_LOOP_OPS = 0
    counter = traffic.LinkTraffic(lambda: emulation.hub_counters(hub))
    pipe.fit(x, y, batch_size=12, shuffle=False, verbose=0, callbacks=[counter])
    result[ops or "default"] = {
        "gap": max(float(np.max(np.abs(a - b)))
                   for a, b in zip(pipe.model.get_weights(), expected.get_weights())),
        "sent": {name: sent for name, (sent, _) in counter.per_step().items()},
        "steps": counter.epoch_steps,
        "mirrored": [p.mirrors is not None for p in pipe.programs],
        "mirror_devices": [[w[0].value.device for w in p.mirrors.weights] if p.mirrors else []
                           for p in pipe.programs],
        "stage_bytes": [sum(int(np.prod(v.shape)) * 8 for v in p.trainable)
                        for p in pipe.programs],
        "stage_devices": pipe.stage_devices}
  return result


def recurrent_replicas(devices, hub):
  """3 replicas of a 2-stage 1F1B (and zero-bubble) pipeline whose first stage runs an LSTM (a
  while loop over 24 time steps), one stage per host: per method, the gap to Keras at the
  global batch (float64), each host's bytes sent per step, and each stage's weight bytes."""
  import keras
  import numpy as np
  import tfpipe
  from tfpipe.instruments import traffic
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(48, 24, 16)), rng.integers(0, 3, (48,))

  def make():
    keras.utils.set_random_seed(1)
    series = keras.Input((24, 16), dtype="float64")
    h = keras.layers.LSTM(48, dtype="float64", name="recurrent")(series)
    return keras.Model(series, keras.layers.Dense(3, dtype="float64", name="logits")(h))

  loss = lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
  expected = make()
  expected.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss())
  expected.fit(x, y, batch_size=12, shuffle=False, verbose=0)
  result = {}
  for method in ("1f1b", "zb"):   # zb: a backward in two halves
    pipe = tfpipe.Pipeline(make(), devices=devices, method=method, micro_batches=2,
                           data_parallel=3, partition=["logits"])
    pipe.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss(), steps_per_execution=1)
    counter = traffic.LinkTraffic(lambda: emulation.hub_counters(hub))
    pipe.fit(x, y, batch_size=12, shuffle=False, verbose=0, callbacks=[counter])
    result[method] = {
        "gap": max(float(np.max(np.abs(a - b)))
                   for a, b in zip(pipe.model.get_weights(), expected.get_weights())),
        "sent": {name: sent for name, (sent, _) in counter.per_step().items()},
        "stage_bytes": [sum(int(np.prod(v.shape)) * 8 for v in p.trainable)
                        for p in pipe.programs],
        "stage_layers": [[l.name for l in p.model.layers] for p in pipe.programs]}
  return result


def allocate(devices, mib):
  """A tensor of `mib` MiB made on the first server, then a small one: each one's error class
  and first line (None where it was made)."""
  import tensorflow as tf

  def made(size):
    try:
      with tf.device(devices[0]):
        return None, float(tf.reduce_sum(tf.ones([size << 18], tf.float32)))
    except tf.errors.OpError as e:
      tf.experimental.async_clear_error()   # remote ops run asynchronously: the error stays
      return type(e).__name__, str(e).splitlines()[0]

  return {"big": made(int(mib)), "small": made(1)}


def main(name, netns, spec, *args):
  emulation.enter(netns)   # this process is single-threaded here (a fork, or a fresh start)
  import tfpipe
  tfpipe.create_logical_cpus(2)
  devices = tfpipe.cluster.connect(json.loads(spec))
  print(json.dumps(globals()[name](devices, *args)), flush=True)
  os._exit(0)  # skip TensorFlow's teardown


if __name__ == "__main__":
  main(*sys.argv[1:])
