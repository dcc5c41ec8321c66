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


def main(name, netns, spec):
  emulation.enter(netns)   # this process is single-threaded here (a fork, or a fresh start)
  import tfpipe
  tfpipe.create_logical_cpus(2)
  devices = tfpipe.cluster.connect(json.loads(spec))
  print(json.dumps(globals()[name](devices)), flush=True)
  os._exit(0)  # skip TensorFlow's teardown


if __name__ == "__main__":
  main(*sys.argv[1:])
