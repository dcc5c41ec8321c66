"""Cluster scenarios, each run in a fresh process by tests/test_cluster.py.

A process connected to a cluster stays connected (TensorFlow registers new
functions with every task, dead or alive), so each scenario gets its own
process: `python -m tests.cluster_scenarios NAME` prints one JSON line.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
import numpy as np  # noqa: E402

import tfpipe  # noqa: E402
from tfpipe.cluster import local as local_cluster, servers as cluster  # noqa: E402
from tfpipe.rules import optimizers
from tfpipe.training import checkpoint
from tests import helpers  # noqa: E402


def _train(devices, method="pipedream", n=8, callbacks=(), pipe=None, epochs=1, calls=False):
  """`calls`: windows of 2 mini-batches of stage calls (kept forwards cross each boundary as
  their residuals), not the small model's inlined windows."""
  x, y = helpers.as_arrays(helpers.batches(n))
  if pipe is None:
    pipe = tfpipe.Pipeline(helpers.mlp(), devices=devices, method=method)
    pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy(),
                 steps_per_execution=2 if calls else "auto")
    if calls:
      pipe.runtime.inline = False
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=list(callbacks),
           epochs=epochs)
  return pipe


def equal(local):
  result = {}
  for method in ("sequential", "spectrain"):   # no kept forward; kept and predicted
    remote = _train(cluster.task_devices(local.spec), method)
    here = _train(tfpipe.default_devices()[:2], method)
    calls = _train(cluster.task_devices(local.spec), method, calls=True)
    gap = lambda run: max(float(np.max(np.abs(a - b)))
                          for a, b in zip(run.model.get_weights(), here.model.get_weights()))
    result[method] = {"gap": gap(remote), "calls_gap": gap(calls),
                      "stage1_device": remote.programs[1].trainable[0].value.device}
  return result


class _ParkedHeld(keras.callbacks.Callback):
  """After each mini-batch: how many window functions' parked variables (`slot`s) hold a
  float tensor of any element (`tfpipe.runtime.parked`)."""

  def __init__(self, pipe):
    super().__init__()
    self.pipe, self.held = pipe, []

  def on_train_batch_end(self, batch, logs=None):
    slots = set()
    for (slot, _), variable in self.pipe.runtime.parked.variables.items():
      if variable.dtype.is_floating:
        with tf.device(variable.device):
          if int(tf.size(variable.read_value())):
            slots.add(slot)
    self.held.append(len(slots))


def recurrent(local):
  """SpecTrain over an LSTM stage on the servers, in windows of one mini-batch: its kept
  forwards (with the lists of the LSTM's loop) carried between windows in variables on the
  servers; and the same on this process's CPUs. `held`: after each mini-batch on the servers,
  how many window functions' variables hold a carry."""
  x = np.random.default_rng(0).standard_normal((48, 6, 4)).astype("float32")
  y = np.arange(48) % 3
  weights = []
  for devices in (cluster.task_devices(local.spec), tfpipe.default_devices()[:2]):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 4))
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm")(inputs)
    h = keras.layers.LSTM(8, name="lstm2")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
    pipe = tfpipe.Pipeline(model, devices=devices, method="spectrain", partition=["lstm2"])
    pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), steps_per_execution=1)
    remote = devices[0].startswith("/job:worker")
    if remote:
      held = _ParkedHeld(pipe)
    pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0, epochs=2,
             callbacks=[held] if remote else [])
    weights.append(pipe.model.get_weights())
    if remote:
      inlined = [n.inline for n in pipe.runtime.numbered]
      parked = sorted({v.dtype.name for v in pipe.runtime.parked.variables.values()})
      slots = len({slot for slot, _ in pipe.runtime.parked.variables})
  return {"gap": max(float(np.max(np.abs(a - b))) for a, b in zip(*weights)),
          "inlined": inlined, "parked": parked, "held": held.held, "slots": slots}


class _WeightsAtEpochEnds(keras.callbacks.Callback):
  """Records the Keras model's weights at each epoch's end."""

  def __init__(self, reads):
    super().__init__()
    self.reads_weights, self.seen = reads, []

  def on_epoch_end(self, epoch, logs=None):
    self.seen.append(self.model.get_weights())


def moved(local):
  """Stages on servers: the Keras model's weights at epoch ends, with a callback that may read
  them and with one that says it does not; and after `fit`."""
  devices = cluster.task_devices(local.spec)
  result = {}
  for reads in (True, False):
    keras.utils.set_random_seed(3)
    pipe = tfpipe.Pipeline(helpers.mlp(), devices=devices, method="gpipe")
    pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
    start = pipe.model.get_weights()
    watch = _WeightsAtEpochEnds(reads)
    _train(devices, pipe=pipe, callbacks=[watch], epochs=2)
    gap = lambda a, b: max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))
    end = pipe.model.get_weights()
    result[reads] = {"epoch0_moved": gap(watch.seen[0], start),
                     "epoch1_to_end": gap(watch.seen[1], end),
                     "end_moved": gap(end, start), "end": [w.tolist() for w in end]}
  result["runs_gap"] = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                           for a, b in zip(result[True].pop("end"), result[False].pop("end")))
  return {str(k): v for k, v in result.items()}


def replicas(local):
  """Two replicas of a 2-stage 1F1B pipeline, each on two server processes, against Keras at
  the global batch (float64)."""
  x, y = helpers.as_arrays(helpers.batches(6))
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  expected = helpers.sequential_mlp(dtype="float64")
  expected.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss())
  expected.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  pipe = tfpipe.Pipeline(helpers.sequential_mlp(dtype="float64"),
                         devices=cluster.task_devices(local.spec), method="1f1b",
                         micro_batches=2, data_parallel=2)
  pipe.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  return {"gap": max(float(np.max(np.abs(a - b)))
                     for a, b in zip(pipe.model.get_weights(), expected.get_weights())),
          "stage_devices": pipe.stage_devices}


def refuse(local):
  messages = []
  for devices in (["/job:worker/task:0/device:CPU:0", "/job:worker/task:2/device:CPU:0"],
                  ["/job:ps/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0"]):
    try:
      tfpipe.Pipeline(helpers.mlp(), devices=devices)
      messages.append(None)
    except ValueError as e:
      messages.append(str(e))
  # The compiled executor's profiler sees this process only: no timeline of server stages.
  pipe = tfpipe.Pipeline(helpers.mlp(), devices=cluster.task_devices(local.spec), record=True)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  _train(None, n=2, pipe=pipe)
  try:
    pipe.breakdown()
    messages.append(None)
  except ValueError as e:
    messages.append(str(e))
  return {"messages": messages, "records": len(pipe.records), "window": pipe.runtime.window}


class _KillAt(keras.callbacks.Callback):
  """Kills worker 1 at `batch`, or with `stop` SIGSTOPs it: its process hangs (the kernel
  still accepts connections)."""

  def __init__(self, local, batch, stop=False):
    super().__init__()
    self.local, self.batch, self.stop, self.when = local, batch, stop, None

  def on_train_batch_end(self, batch, logs=None):
    if batch == self.batch and self.when is None:
      if self.stop:
        os.kill(self.local.processes[("worker", 1)].pid, signal.SIGSTOP)
      else:
        self.local.kill("worker", 1)
      self.when = time.time()


def dead(local, directory):
  devices = cluster.task_devices(local.spec)
  saver = checkpoint.BackupAndRestore(directory)
  pipe = _train(devices, callbacks=[saver])
  good = saver.manager.latest_checkpoint
  killer = _KillAt(local, 3)
  try:
    _train(devices, n=200, pipe=pipe, epochs=3, callbacks=[killer, saver])
    error = None
  except cluster.WorkerLost as e:
    error = str(e)
  return {"error": error, "seconds": time.time() - killer.when,
          "latest": saver.manager.latest_checkpoint, "good": good,
          "unreachable": [list(t[:2]) for t in cluster.unreachable_tasks(local.spec)]}


def hung(local):
  stopper = _KillAt(local, 3, stop=True)
  try:
    _train(cluster.task_devices(local.spec), n=400, epochs=3, callbacks=[stopper])
    error = None
  except cluster.WorkerLost as e:
    error = str(e)
  return {"error": error, "seconds": time.time() - stopper.when}


class _Faults(keras.callbacks.Callback):
  """Injects each of `faults` [(epoch, batch, "kill" | "stop")] once into worker 1: kill -9,
  or SIGSTOP (its process hangs; the watchdog kills it, as this process started it)."""

  def __init__(self, local, faults):
    super().__init__()
    self.local, self.faults, self.epoch, self.when = local, list(faults), 0, []

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_epoch_end(self, epoch, logs=None):
    self.on_train_batch_end("end")   # before the checkpoint callback saves the epoch

  def on_train_batch_end(self, batch, logs=None):
    for fault in list(self.faults):
      if fault[:2] == (self.epoch, batch):
        self.faults.remove(fault)
        pid = self.local.processes[("worker", 1)].pid
        os.kill(pid, signal.SIGKILL if fault[2] == "kill" else signal.SIGSTOP)
        self.when.append(time.time())


def restarts(local, directory):
  """A 1f1b pipeline on two servers, worker 1 killed at the end of epoch 0 (before its
  checkpoint) and in epoch 1, frozen in epoch 2, with max_restarts=3, against the same
  training uninterrupted on this process's devices."""
  x, y = helpers.as_arrays(helpers.batches(12))
  # A dataset that reshuffles each iteration, built by a function: `fit` builds it again for
  # each attempt, so a restart replays the order of the uninterrupted run.
  data = lambda: (tf.data.Dataset.from_tensor_slices((x, y))
                  .shuffle(len(x), seed=1, reshuffle_each_iteration=True).batch(16))

  def trained(devices, function, **extra):
    keras.utils.set_random_seed(0)   # the shuffle's seed is (global seed, 1)
    pipe = tfpipe.Pipeline(helpers.mlp(), devices=devices, method="1f1b", micro_batches=2)
    pipe.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy())
    return pipe, pipe.fit(data if function else data(), epochs=3, verbose=0, **extra)

  here, expected = trained(tfpipe.default_devices()[:2], False)
  faults = _Faults(local, [(0, "end", "kill"), (1, 5, "kill"), (2, 3, "stop")])
  remote, history = trained(cluster.task_devices(local.spec), True, max_restarts=3,
                            callbacks=[faults, checkpoint.BackupAndRestore(directory)])
  scale = max(float(np.max(np.abs(w))) for w in here.model.get_weights())
  gap = max(float(np.max(np.abs(a - b)))
            for a, b in zip(remote.model.get_weights(), here.model.get_weights()))
  return {"relative_gap": gap / scale, "epochs": history.epoch, "restarts": history.restarts,
          "losses": history.history["loss"], "expected": expected.history["loss"],
          "faults_left": len(faults.faults)}


class _OutlivePeer(keras.callbacks.Callback):
  """Ends training only after the peer at `address` has exited, and 3 s more (the watchdog's
  interval + misses * timeout): a worker slower than its peer after the last step."""

  def __init__(self, address):
    super().__init__()
    self.address = address

  def on_train_end(self, logs=None):
    from tfpipe.cluster import liveness
    deadline = time.monotonic() + 120
    while liveness.probe(self.address) != "refused" and time.monotonic() < deadline:
      time.sleep(0.2)
    time.sleep(3.0)


def mwms(addresses, index):
  """One worker of MultiWorkerMirroredStrategy data parallelism (TF_CONFIG set here); worker 0
  ends its training only after worker 1 has exited."""
  os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses.split(",")},
                                        "task": {"type": "worker", "index": int(index)}})
  from tfpipe.baselines import multi_worker
  strategy = multi_worker.make_strategy()  # before any other TensorFlow op
  # A per-token model over named inputs fed from dict data (as the trainer builds a KerasHub
  # backbone's), against Keras; first, since worker 0's last training outlives worker 1.
  def per_token():
    keras.utils.set_random_seed(5)
    ids, mask = keras.Input((6,), dtype="int32", name="token_ids"), keras.Input((6,), name="mask")
    h = keras.layers.Embedding(20, 8)(ids) * keras.ops.expand_dims(mask, -1)
    return keras.Model([ids, mask], keras.layers.Dense(20)(h))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 20, (64, 7)).astype("int32")
  text = tf.data.Dataset.from_tensor_slices((
      {"mask": np.ones((64, 6), "float32"), "token_ids": tokens[:, :-1]}, tokens[:, 1:])).batch(16)
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  lm = per_token()
  lm_trainer = multi_worker.MultiWorkerDataParallel(lm, strategy, build=per_token)
  lm_trainer.compile(keras.optimizers.Adam(0.01), loss())
  lm_history = lm_trainer.fit(text, epochs=1)
  lm_single = per_token()
  lm_single.compile(keras.optimizers.Adam(0.01), loss())
  lm_keras = lm_single.fit(text, epochs=1, verbose=0)
  x, y = helpers.as_arrays(helpers.batches(6))
  model = helpers.sequential_mlp(width=16, depth=3)
  trainer = multi_worker.MultiWorkerDataParallel(model, strategy)
  trainer.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  slow = [_OutlivePeer(addresses.split(",")[1])] if int(index) == 0 else []
  history = trainer.fit(x, y, batch_size=16, epochs=2, callbacks=slow)
  # The same training on this process's one device, for comparison.
  single = helpers.sequential_mlp(width=16, depth=3)
  single.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  print(json.dumps({
      "lm_loss": lm_history.history["loss"], "lm_keras_loss": lm_keras.history["loss"],
      "lm_gap_to_single": max(float(np.max(np.abs(a - b)))
                              for a, b in zip(lm.get_weights(), lm_single.get_weights())),
      "workers": trainer.workers, "loss": history.history["loss"],
      "checksum": float(sum(np.abs(w).sum() for w in model.get_weights())),
      "gap_to_single": max(float(np.max(np.abs(a - b)))
                           for a, b in zip(model.get_weights(), single.get_weights()))}),
        flush=True)
  os._exit(0)


def main(name, *args):
  if name == "mwms":
    mwms(*args)
  tfpipe.create_logical_cpus(2)
  with local_cluster.LocalCluster({"worker": 4 if name == "replicas" else 2}) as local:
    cluster.connect(local.spec)
    result = globals()[name](local, *args)
    print(json.dumps(result), flush=True)
  os._exit(0)  # skip TensorFlow's teardown, which may wait on a killed task


if __name__ == "__main__":
  main(*sys.argv[1:])
