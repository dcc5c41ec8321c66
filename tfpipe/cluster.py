"""Stages on several machines: TensorFlow servers, cluster specs and TF_CONFIG.

A pipeline whose devices name tasks of a cluster
(`/job:worker/task:1/device:CPU:0`) runs its stages there once this program
is connected (`connect`); tensors move between stages through TensorFlow's
own runtime (gRPC). `LocalCluster` starts the servers as processes on
127.0.0.1 (tests, `--cluster=local:W,P`); `from_tf_config` reads a real
cluster from `TF_CONFIG`. When a task dies, the next remote call fails and
`Pipeline.fit` raises `WorkerLost` naming the tasks that no longer answer.

  python -m tfpipe.cluster --spec='{"worker": ["127.0.0.1:2222"]}' --job=worker --task=0
starts one server by hand.
"""

import json
import os
import socket
import subprocess
import sys
import time

import tensorflow as tf

__all__ = ["WorkerLost", "LocalCluster", "connect", "connected_spec", "from_tf_config",
           "task_devices", "check_devices", "unreachable_tasks", "describe_lost"]

_CONNECTED = {"spec": None}


class WorkerLost(RuntimeError):
  """A task of the cluster stopped answering during training."""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalCluster:
  """TensorFlow servers in local processes: `jobs` maps a job name to its task count.

  Use as a context manager; `spec` is the cluster spec dict, `processes`
  maps (job, task) to its process. Every server is ready when the
  constructor returns (or it raises within `timeout` seconds).
  """

  def __init__(self, jobs, timeout=60.0):
    if not jobs or any(not isinstance(n, int) or n < 1 for n in jobs.values()):
      raise ValueError(f"jobs must map job names to task counts >= 1. Received: {jobs!r}")
    self.spec = {job: [f"127.0.0.1:{_free_port()}" for _ in range(n)] for job, n in jobs.items()}
    self.processes = {}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    try:
      for job, addresses in self.spec.items():
        for task in range(len(addresses)):
          self.processes[(job, task)] = subprocess.Popen(
              [sys.executable, "-m", "tfpipe.cluster", f"--spec={json.dumps(self.spec)}",
               f"--job={job}", f"--task={task}"],
              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
      deadline = time.time() + timeout
      for (job, task), process in self.processes.items():
        line = process.stdout.readline()   # blocks until the server prints "ready" or exits
        if line.strip() != "ready" or time.time() > deadline:
          raise RuntimeError(f"the server of /job:{job}/task:{task} did not start "
                             f"(exit code {process.poll()})")
    except BaseException:
      self.stop()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  def dead(self):
    """(job, task) of the servers whose process has exited."""
    return [key for key, p in self.processes.items() if p.poll() is not None]

  def kill(self, job, task):
    self.processes[(job, task)].kill()
    self.processes[(job, task)].wait()

  def stop(self):
    for process in self.processes.values():
      if process.poll() is None:
        process.kill()
    for process in self.processes.values():
      process.wait()


def from_tf_config(environ=None):
  """The cluster spec dict of the TF_CONFIG environment variable."""
  raw = (environ or os.environ).get("TF_CONFIG")
  if not raw:
    raise ValueError("TF_CONFIG is not set: it must hold {\"cluster\": {...}} (a cluster spec)")
  try:
    spec = json.loads(raw)["cluster"]
  except (ValueError, KeyError, TypeError):
    raise ValueError(f"TF_CONFIG must be JSON with a \"cluster\" entry. Received: {raw!r}") from None
  if not isinstance(spec, dict) or not spec:
    raise ValueError(f"TF_CONFIG's cluster must map job names to addresses. Received: {spec!r}")
  return spec


def connect(spec):
  """Connects this program to the cluster `spec` (remote devices become usable)."""
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(spec), rpc_layer="grpc")
  tf.config.experimental_connect_to_cluster(resolver, make_master_device_default=False)
  _CONNECTED["spec"] = {job: list(addresses) for job, addresses in spec.items()}
  return task_devices(spec)


def connected_spec():
  """The cluster spec this program last connected to, or None."""
  return _CONNECTED["spec"]


def task_devices(spec, job="worker"):
  """One device per task of `job`: its first CPU."""
  if job not in spec:
    raise ValueError(f"the cluster has no job {job!r}: jobs {sorted(spec)}")
  return [f"/job:{job}/replica:0/task:{t}/device:CPU:0" for t in range(len(spec[job]))]


def check_devices(devices, spec):
  """Refuses, before training, a device naming a job or task the cluster spec lacks."""
  for d in devices:
    parsed = tf.DeviceSpec.from_string(d)
    if parsed.job in (None, "localhost"):
      continue
    tasks = spec.get(parsed.job)
    if tasks is None:
      raise ValueError(f"device {d!r} names job {parsed.job!r}, which the cluster spec does not "
                       f"have (jobs: {sorted(spec)})")
    task = parsed.task or 0
    if task >= len(tasks):
      raise ValueError(f"device {d!r} names task {task} of job {parsed.job!r}, which has "
                       f"{len(tasks)} task{'s' if len(tasks) != 1 else ''} in the cluster spec")


def unreachable_tasks(spec, timeout=2.0):
  """(job, task, address) of the tasks whose server does not accept a connection."""
  lost = []
  for job, addresses in spec.items():
    for task, address in enumerate(addresses):
      host, _, port = address.rpartition(":")
      try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
      except OSError:
        lost.append((job, task, address))
  return lost


def describe_lost(error, devices):
  """A `WorkerLost` naming the tasks that stopped answering, for the `error` of a remote call;
  None when every task of the connected cluster still answers (the error is another one)."""
  spec = connected_spec() or {}
  used = {(tf.DeviceSpec.from_string(d).job, tf.DeviceSpec.from_string(d).task or 0)
          for d in devices}
  unreachable = unreachable_tasks(spec)
  lost = [t for t in unreachable if (t[0], t[1]) in used] or unreachable
  if not lost:
    return None
  names = ", ".join(f"/job:{j}/task:{t} ({a})" for j, t, a in lost)
  return WorkerLost(f"lost {names}: its server stopped answering during training "
                    f"({type(error).__name__}: {str(error).splitlines()[0]})")


def _serve(argv):
  import argparse
  parser = argparse.ArgumentParser(description="Runs one TensorFlow server of a cluster.")
  parser.add_argument("--spec", required=True, help="cluster spec as JSON")
  parser.add_argument("--job", required=True)
  parser.add_argument("--task", type=int, required=True)
  args = parser.parse_args(argv)
  tf.config.threading.set_intra_op_parallelism_threads(1)
  server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(args.spec)), job_name=args.job,
                                task_index=args.task, start=True)
  print("ready", flush=True)
  server.join()


if __name__ == "__main__":
  _serve(sys.argv[1:])
