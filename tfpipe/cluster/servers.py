"""Stages on several machines: TensorFlow servers, cluster specs and TF_CONFIG.

A pipeline whose devices name tasks of a cluster
(`/job:worker/task:1/device:CPU:0`) runs its stages there once this program
is connected (`connect`); tensors move between stages through TensorFlow's
own runtime (gRPC). `LocalCluster` (`tfpipe.cluster.local`) starts the servers as
processes on 127.0.0.1 (tests, `--cluster=local:W,P`); `from_tf_config` reads a real
cluster from `TF_CONFIG`. When a task dies, the next remote call fails and
`Pipeline.fit` raises `WorkerLost` naming the tasks that no longer answer;
a task that hangs (answers no probe) is named within seconds (`guard`).
`connect` refuses, within its timeout, a spec naming a task that does not
answer. TF servers are unauthenticated: anyone who reaches their port can
run operations there (see README, "Clusters").

  python -m tfpipe.cluster --spec='{"worker": ["127.0.0.1:2222"]}' --job=worker --task=0
starts one server by hand (`tfpipe.cluster.serving`).
"""

import contextlib
import json
import os
import socket
import sys

import tensorflow as tf

from tfpipe.cluster import exits, liveness, local
from tfpipe.runtime import iterators

__all__ = ["WorkerLost", "ClusterUnreachable", "connect", "connected_spec", "note_connected",
           "client_address", "route_address", "CLIENT_JOB",
           "from_tf_config", "task_devices", "check_devices", "unreachable_tasks",
           "describe_lost", "describe_state", "guard", "watch", "check_answering",
           "set_liveness", "LIVENESS", "EXIT_LOST", "reconnect", "owner"]

_CONNECTED = {"spec": None, "client": None}
_VERDICTS = {}       # (job, task) -> what the watchdog saw ("silent": hung or stopped)
EXIT_LOST = 3        # the exit status of a process stopped for a lost task (`guard`)
describe_state = liveness.describe_state


class WorkerLost(RuntimeError):
  """A task of the cluster stopped answering during training; `tasks` lists the lost ones as
  (job, task, address)."""

  def __init__(self, message, tasks=()):
    super().__init__(message)
    self.tasks = list(tasks)


class ClusterUnreachable(WorkerLost):
  """A task of a cluster spec does not answer when connecting."""


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


def _tasks(spec):
  """[(job, task, address)] of a cluster spec, checked."""
  if not isinstance(spec, dict) or not spec or any(
      not isinstance(a, (list, tuple)) or not a for a in spec.values()):
    raise ValueError("a cluster spec maps job names to lists of \"host:port\" addresses. "
                     f"Received: {spec!r}")
  tasks = []
  for job, addresses in spec.items():
    for task, address in enumerate(addresses):
      host, _, port = str(address).rpartition(":")
      if not host or not port.isdigit():
        raise ValueError(f"/job:{job}/task:{task} has address {address!r}: not host:port")
      tasks.append((job, task, address))
  return tasks


def check_answering(spec, timeout=5.0):
  """Refuses (`ClusterUnreachable`, within `timeout` seconds) a cluster `spec` naming a task
  whose server does not answer a probe (`tfpipe.cluster.liveness.probe`): nothing listens, or a
  stopped or hung process, which TensorFlow would wait for forever."""
  tasks = _tasks(spec)
  states = liveness.probe_all(tasks, timeout)
  down = [(job, task, address, states[(job, task)]) for job, task, address in tasks
          if states[(job, task)] != "ok"]
  if down:
    raise ClusterUnreachable(
        "cannot connect to the cluster: " + "; ".join(
            f"/job:{job}/task:{task} ({address}): {describe_state(state)}"
            for job, task, address, state in down)
        + f" (probed for {timeout:g} s). Start its servers first "
        "(python -m tfpipe.cluster --spec=... --job=... --task=...)")


CLIENT_JOB = "localhost"   # the job this program joins as (TensorFlow's name for it)


def _host_port(address, what):
  host, _, port = str(address).rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{what} must be \"host:port\" or a host. Received: {address!r}")
  return host.strip("[]"), int(port)


def route_address(spec):
  """The address of this machine's interface that reaches the first task of `spec` (the
  route's source; a UDP socket's connect sends nothing)."""
  host, port = _host_port(_tasks(spec)[0][2], "a task's address")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, port))
    except OSError as e:
      raise ClusterUnreachable(f"no route from this machine to {host}:{port} (the first task "
                               f"of the cluster spec): {e}") from None
    return s.getsockname()[0]


def client_address(spec, address=None):
  """"host:port" where this program listens as a member of the cluster `spec`, reachable from
  its tasks: `address` ("host:port", or a host and a free port there), else the spec's
  "localhost" job, else the route to the spec's first task and a free port there. TensorFlow
  would register "localhost:PORT", which a task on another machine dials as itself."""
  if address is None and CLIENT_JOB in spec:
    address = spec[CLIENT_JOB][0]
  if address is not None and ":" in str(address).strip("[]"):
    _host_port(address, "the client's address")
    return str(address)
  host = str(address).strip("[]") if address is not None else route_address(
      {j: a for j, a in spec.items() if j != CLIENT_JOB})
  with socket.socket() as s:
    try:
      s.bind((host, 0))
    except OSError as e:
      raise ValueError(f"the client's address {host!r} is not one of this machine's: {e}") from None
    return f"{host}:{s.getsockname()[1]}"


def connect(spec, timeout=5.0, address=None):
  """Connects this program to the cluster `spec` (remote devices become usable), once every
  task answers (`check_answering`, within `timeout` seconds). This program joins the cluster
  at `client_address(spec, address)`, where the tasks pull tensors from it."""
  _tasks(spec)   # a malformed spec is refused as it is
  servers = {job: list(a) for job, a in spec.items() if job != CLIENT_JOB}
  check_answering(servers, timeout)
  client = client_address(spec, address)
  iterators.wait()   # no dataset iterator is deleted while the context is reset
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec(dict(servers, **{CLIENT_JOB: [client]})), rpc_layer="grpc")
  tf.config.experimental_connect_to_cluster(resolver, job_name=CLIENT_JOB,
                                            make_master_device_default=False)
  note_connected(servers, client)
  return task_devices(servers)


def note_connected(spec, client=None):
  """Records that this program is connected to the cluster `spec` (`connected_spec`), as a
  member at `client` ("host:port")."""
  _CONNECTED["spec"] = {job: list(addresses) for job, addresses in spec.items()}
  _CONNECTED["client"] = client


def connected_spec():
  """The cluster spec this program last connected to, or None."""
  return _CONNECTED["spec"]


def reconnect(timeout=5.0):
  """Connects again to the cluster this program last connected to, after a lost task's server
  started again: at the same client address, so TensorFlow updates the connection in place
  (a new one would reset this program's context, and a variable made before it, such as the
  Keras model's, would then silently ignore every assignment). What lived on the lost task is
  gone; what lives here and on the other tasks stays."""
  spec = connected_spec()
  if spec is None:
    raise RuntimeError("reconnect() needs an earlier connect()")
  return connect(spec, timeout, address=_CONNECTED["client"])


def owner(job, task, address):
  """The running `LocalCluster` of this process that started task (job, task) at `address`,
  or None (a cluster someone else started)."""
  for running in local.RUNNING:
    if running.owns(job, task, address) is not None:
      return running
  return None


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
  """(job, task, address, state) of the tasks whose server does not answer a probe
  (`tfpipe.cluster.liveness`: state "refused", "silent" or "closed")."""
  tasks = _tasks(spec)
  states = liveness.probe_all(tasks, timeout)
  return [(job, task, address, states[(job, task)]) for job, task, address in tasks
          if states[(job, task)] != "ok"]


def _used_tasks(devices):
  """[(job, task, address)] of the connected cluster that `devices` name."""
  spec = connected_spec() or {}
  used = []
  for d in devices:
    parsed = tf.DeviceSpec.from_string(d)
    key = (parsed.job, parsed.task or 0)
    if parsed.job in spec and key not in [(j, t) for j, t, _ in used]:
      used.append(key + (spec[parsed.job][key[1]],))
  return used


def describe_lost(error, devices):
  """A `WorkerLost` naming the tasks that stopped answering, for the `error` of a remote call;
  None when every task of the connected cluster still answers (the error is another one)."""
  spec = connected_spec() or {}
  used = {(j, t) for j, t, _ in _used_tasks(devices)}
  unreachable = unreachable_tasks(spec) if spec else []
  lost = [t for t in unreachable if (t[0], t[1]) in used] or unreachable
  if not lost:
    return None
  names = ", ".join(f"/job:{j}/task:{t} ({a})" for j, t, a, _ in lost)
  hung = [f"/job:{j}/task:{t}" for j, t, _, _ in lost if _VERDICTS.get((j, t)) == "silent"]
  how = (f"{', '.join(hung)} stopped answering (hung or stopped) and was killed; "
         if hung else "")
  return WorkerLost(f"lost {names}: {how}its server stopped answering during training "
                    f"({type(error).__name__}: {str(error).splitlines()[0]})",
                    [(j, t, a) for j, t, a, _ in lost])


# The watchdog's probes during training (`guard`): every `interval` s, each waiting `timeout`
# s for an answer; `misses` silent ones in a row lose the task. `set_liveness` changes them.
LIVENESS = {"interval": 1.0, "timeout": 2.0, "misses": 2}


def set_liveness(interval=1.0, timeout=2.0, misses=2):
  """How `guard` watches tasks from now on (a slow or loaded network may need more misses)."""
  for name, value in (("interval", interval), ("timeout", timeout)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
      raise ValueError(f"`{name}` must be a positive number of seconds. Received: {value!r}")
  if isinstance(misses, bool) or not isinstance(misses, int) or misses < 1:
    raise ValueError(f"`misses` must be a positive integer. Received: misses={misses!r}")
  LIVENESS.update(interval=float(interval), timeout=float(timeout), misses=misses)


def guard(devices, interval=None, timeout=None, misses=None):
  """Watches the cluster tasks that `devices` name while the body runs (training).

  A task that stops answering (`tfpipe.cluster.liveness.Watchdog`: within
  interval + misses * timeout seconds, 5 s by default; None takes
  `LIVENESS`, see `set_liveness`) leaves the body's
  remote calls waiting forever, so it is named at once on stderr; then a
  server this process started (`LocalCluster`) is killed, which fails the
  waiting call (`describe_lost` then names the task in a `WorkerLost`), and
  for any other server the process exits with status `EXIT_LOST` (3): its
  TensorFlow runtime cannot take back the call. A task that answers, but
  slowly (`liveness.SLOW_FACTOR`), is named on stderr, and named again once
  it answers as usual; training goes on. No devices on a cluster: nothing is
  watched.
  """
  chosen = {"interval": interval, "timeout": timeout, "misses": misses}
  settings = {k: LIVENESS[k] if v is None else v for k, v in chosen.items()}
  return watch(_used_tasks(devices), **settings)


@contextlib.contextmanager
def watch(tasks, interval=1.0, timeout=2.0, misses=2):
  """`guard` over `tasks` [(job, task, address)] of any cluster (e.g. the peers of a
  MultiWorkerMirroredStrategy worker); yields the `liveness.Watchdog`, whose `stop` ends
  the watch early (once no remote call can wait on the tasks any more)."""
  def on_lost(lost):
    for job, task, _, state in lost:
      _VERDICTS[(job, task)] = state
    names = "; ".join(f"/job:{j}/task:{t} ({a}): {describe_state(s)}" for j, t, a, s in lost)
    print(f"tfpipe: lost {names}", file=sys.stderr, flush=True)
    owned = [p for j, t, a, _ in lost for c in list(local.RUNNING) for p in [c.owns(j, t, a)] if p]
    if len(owned) == len(lost):
      for process in owned:
        process.kill()
      return
    exits.exit_now(EXIT_LOST, "tfpipe: a remote call waits on it and cannot be cancelled: "
                   f"exiting with status {EXIT_LOST}")

  def on_slow(job, task, address, seconds, usual):
    if seconds is None:
      print(f"tfpipe: /job:{job}/task:{task} ({address}) answers as usual again",
            file=sys.stderr, flush=True)
    else:
      print(f"tfpipe: /job:{job}/task:{task} ({address}) answers slowly: {seconds:.2f} s "
            f"against {usual * 1e3:.1f} ms at best (a slow or lossy link, or a busy host); "
            "training goes on", file=sys.stderr, flush=True)

  with liveness.Watchdog(tasks, on_lost, interval, timeout, misses, on_slow) as watchdog:
    yield watchdog
