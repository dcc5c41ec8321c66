"""Stages on several machines: TensorFlow servers, cluster specs and TF_CONFIG.

A pipeline whose devices name tasks of a cluster
(`/job:worker/task:1/device:CPU:0`) runs its stages there once this program
is connected (`connect`); tensors move between stages through TensorFlow's
own runtime (gRPC). `LocalCluster` starts the servers as processes on
127.0.0.1 (tests, `--cluster=local:W,P`); `from_tf_config` reads a real
cluster from `TF_CONFIG`. When a task dies, the next remote call fails and
`Pipeline.fit` raises `WorkerLost` naming the tasks that no longer answer;
a task that hangs (answers no probe) is named within seconds (`guard`).
`connect` refuses, within its timeout, a spec naming a task that does not
answer. TF servers are unauthenticated: anyone who reaches their port can
run operations there (see README, "Clusters").

  python -m tfpipe.cluster --spec='{"worker": ["127.0.0.1:2222"]}' --job=worker --task=0
starts one server by hand.
"""

import argparse
import contextlib
import ctypes
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

import tensorflow as tf

from tfpipe.cluster import allocator, bind, emulation, exits, liveness
from tfpipe.runtime import iterators

__all__ = ["free_port", "WorkerLost", "ClusterUnreachable", "LocalCluster", "connect", "connected_spec", "note_connected",
           "client_address", "route_address", "CLIENT_JOB",
           "from_tf_config", "task_devices", "check_devices", "unreachable_tasks",
           "describe_lost", "describe_state", "guard", "watch", "check_answering",
           "set_liveness", "LIVENESS", "EXIT_LOST", "reconnect", "owner"]

_CONNECTED = {"spec": None, "client": None}
_LOCAL = []          # the LocalClusters of this process that are running
_VERDICTS = {}       # (job, task) -> what the watchdog saw ("silent": hung or stopped)
EXIT_LOST = 3        # the exit status of a process stopped for a lost task (`guard`)


class WorkerLost(RuntimeError):
  """A task of the cluster stopped answering during training; `tasks` lists the lost ones as
  (job, task, address)."""

  def __init__(self, message, tasks=()):
    super().__init__(message)
    self.tasks = list(tasks)


class ClusterUnreachable(WorkerLost):
  """A task of a cluster spec does not answer when connecting."""


def free_port():
  """A TCP port free on 127.0.0.1 now (for a task of a local cluster spec)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


describe_state = liveness.describe_state


class LocalCluster:
  """TensorFlow servers in local processes: `jobs` maps a job name to its task count.

  Use as a context manager; `spec` is the cluster spec dict (every task on
  127.0.0.1), `processes` maps (job, task) to its process. Every server is
  ready when the constructor returns, or it raises within `timeout` seconds
  naming the server and showing its error output. The servers die with
  this process, even when it is killed (SIGKILL): each watches its parent.
  `places` maps each (job, task) to an emulated host (`tfpipe.cluster.emulation.Host`):
  its server runs there, at the host's address (`tfpipe.cluster.emulated`).
  `mmap_threshold`: the servers' fixed malloc mmap threshold in bytes (0: the C library's
  adaptive one; `tfpipe.cluster.allocator`).
  """

  PORT = 2222   # the port of a task on a host of its own (`places`)

  def __init__(self, jobs, timeout=60.0, attempts=3, places=None,
               mmap_threshold=allocator.MMAP_THRESHOLD):
    if not jobs or any(not isinstance(n, int) or isinstance(n, bool) or n < 1
                       for n in jobs.values()):
      raise ValueError(f"jobs must map job names to task counts >= 1. Received: {jobs!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
      raise ValueError(f"`timeout` must be a number of seconds > 0. Received: {timeout!r}")
    if isinstance(mmap_threshold, bool) or not isinstance(mmap_threshold, int) or not (
        0 <= mmap_threshold <= allocator.LIMIT):
      raise ValueError(f"`mmap_threshold` must be a number of bytes from 0 to "
                       f"{allocator.LIMIT}. Received: {mmap_threshold!r}")
    self.mmap_threshold = mmap_threshold
    remove_leftover_files()   # of runs that were killed
    self.processes, self._errors, self._places = {}, {}, places
    if places is not None:   # a host each (`tfpipe.cluster.emulated`): every port is free there
      attempts = 1
    for attempt in range(attempts):
      self.spec = {job: [f"{places[(job, t)].address}:{self.PORT}" if places else
                         f"127.0.0.1:{free_port()}" for t in range(n)]
                   for job, n in jobs.items()}
      try:
        self._start(timeout)
        break
      except _PortTaken:   # another process took a port between choosing and binding it
        self.stop()
        if attempt + 1 == attempts:
          raise RuntimeError(f"could not start the servers of {jobs}: their ports were taken "
                             f"{attempts} times in a row") from None
      except BaseException:
        self.stop()
        raise
    _LOCAL.append(self)
    exits.register(self.stop)   # also when the process must leave at once

  def _start(self, timeout):
    """One launcher process imports TensorFlow once and forks a server per task (each import
    costs about 4 s of CPU: a cluster of N servers pays it once, not N times)."""
    host = self.spec[next(iter(self.spec))][0].rpartition(":")[0]
    env, why = bind.server_env(host, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                          CUDA_VISIBLE_DEVICES=""))
    if why:
      warnings.warn(f"the local TF servers listen on every interface, not 127.0.0.1 only: "
                    f"{why}", UserWarning, stacklevel=3)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tasks = [(job, task) for job, addresses in self.spec.items() for task in range(len(addresses))]
    self.processes, self._errors = {}, {}
    for key in tasks + [None]:   # None: the launcher's own errors
      self._errors[key] = tempfile.NamedTemporaryFile(mode="w+", prefix=_files_prefix())
    self._launcher = subprocess.Popen(
        [sys.executable, "-m", "tfpipe.cluster", f"--spec={json.dumps(self.spec)}",
         f"--tasks={','.join(f'{j}:{t}' for j, t in tasks)}", f"--parent={os.getpid()}",
         f"--mmap_threshold={self.mmap_threshold}",
         f"--errors={json.dumps([self._errors[key].name for key in tasks])}"]
        + ([f"--places={json.dumps([_place(self._places[key]) for key in tasks])}"]
           if self._places else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors[None], env=env,
        cwd=root)
    self._exits, self._buffer, self._reading = {}, b"", threading.RLock()
    deadline = time.monotonic() + timeout
    pending = set(tasks)
    while pending or len(self.processes) < len(tasks):
      event = self._event(deadline)
      if event is None:   # the deadline passed, or the launcher exited
        job, task = sorted(pending or set(tasks) - set(self.processes))[0]
        state = (f"not ready after {timeout:g} s" if self._launcher.poll() is None
                 else f"exit code {self._launcher.poll()}")
        error = self._error_output(job, task) or self._error_output(None, None)
        raise RuntimeError(f"the server of /job:{job}/task:{task} at {self.spec[job][task]} "
                           f"did not start ({state})" + (f": {error}" if error else ""))
      kind, job, task = event[:3]
      if kind == "ready":
        pending.discard((job, task))
      elif kind == "exit":
        error = self._error_output(job, task)
        if "address already in use" in error.lower() or "could not listen" in error.lower():
          raise _PortTaken()
        raise RuntimeError(f"the server of /job:{job}/task:{task} at {self.spec[job][task]} "
                           f"did not start (exit code {event[3]})"
                           + (f": {error}" if error else ""))

  def _event(self, deadline=None):
    """The launcher's next line as (kind, job, task[, number]); None when it and its servers
    have exited, or when `deadline` (None: do not wait) passes first. One thread at a time:
    the liveness watchdog kills servers from its own thread."""
    with self._reading:
      return self._next_event(deadline)

  def _next_event(self, deadline):
    fd = self._launcher.stdout.fileno()
    while b"\n" not in self._buffer:
      remaining = 0.0 if deadline is None else deadline - time.monotonic()
      if remaining < 0:
        return None
      if not select.select([fd], [], [], min(remaining, 0.5))[0]:
        if deadline is None:
          return None
        continue
      chunk = os.read(fd, 4096)
      if not chunk:   # every writer (the launcher, its servers) has exited
        return None
      self._buffer += chunk
    line, self._buffer = self._buffer.split(b"\n", 1)
    kind, job, task, *numbers = line.decode().split()
    if kind == "started":
      self.processes[(job, int(task))] = _Server(self, (job, int(task)), int(numbers[0]))
    elif kind == "exit":
      self._exits[(job, int(task))] = int(numbers[0])
    return (kind, job, int(task), *(int(n) for n in numbers))

  def exit_code(self, key, wait=False):
    """The exit code of server `key`, or None while it runs (`wait`: until it exits)."""
    if self._launcher is None:   # stopped
      return self._exits.get(key, -9)
    while key not in self._exits:
      if self._event(time.monotonic() + 0.5 if wait else None) is None:
        if self._launcher.poll() is not None:   # the servers die with it (parent-death signal)
          self._exits.setdefault(key, -9)
        elif not wait:
          return None
    return self._exits[key]

  def _error_output(self, job, task, lines=5):
    errors = self._errors[None if job is None else (job, task)]
    errors.seek(0)
    kept = [l.strip() for l in errors.read().splitlines() if l.strip()]
    return " | ".join(kept[-lines:])

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

  def restart(self, job, task, timeout=60.0):
    """Starts the server of (job, task) again, at its address, after its process exited (a
    lost task: killed, or hung and killed by the watchdog); returns once it is ready, or
    raises naming it within `timeout` seconds."""
    key = (job, task)
    if key not in self.processes:
      raise ValueError(f"/job:{job}/task:{task} is not a server of this cluster")
    old = self.processes[key]
    if old.poll() is None:
      old.kill()
    self.exit_code(key, wait=True)   # its exit reported, so the launcher may fork it again
    self._exits.pop(key, None)
    self._launcher.stdin.write(f"start {job} {task}\n".encode())
    self._launcher.stdin.flush()
    deadline = time.monotonic() + timeout
    while True:
      event = self._event(deadline)
      if event is None:
        error = self._error_output(job, task)
        raise RuntimeError(f"the server of /job:{job}/task:{task} at {self.spec[job][task]} "
                           f"did not start again within {timeout:g} s"
                           + (f": {error}" if error else ""))
      if event[:3] == ("ready", job, task):
        return
      if event[:3] == ("exit", job, task) and self.processes[key] is not old:
        raise RuntimeError(f"the server of /job:{job}/task:{task} at {self.spec[job][task]} "
                           f"exited as it started again (exit code {event[3]}): "
                           f"{self._error_output(job, task)}")

  def owns(self, job, task, address):
    """The process of task (job, task) at `address` when this cluster started it, else None."""
    if self.spec.get(job, [None] * (task + 1))[task:task + 1] == [address]:
      return self.processes.get((job, task))
    return None

  def stop(self):
    try:
      self._stop_launcher()
    finally:   # the error files go even if the launcher could not be told (a broken pipe)
      for errors in self._errors.values():
        errors.close()
      self._errors = {}
      if self in _LOCAL:
        _LOCAL.remove(self)
      exits.unregister(self.stop)

  def _stop_launcher(self):
    launcher = getattr(self, "_launcher", None)
    if launcher is None:
      return
    try:
      while self._event() is not None:   # every server it has started so far
        pass
      for process in self.processes.values():
        process.kill()
      launcher.stdin.close()
    finally:
      launcher.terminate()   # it kills any server it has started since, reaps them, exits
      try:
        launcher.wait(timeout=10)
      except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()
      launcher.stdout.close()
      self._launcher = None


def _files_prefix(pid=None):
  """The prefix of the error files of this process's servers (`pid`'s)."""
  return f"tfpipe-server-{os.getpid() if pid is None else pid}-"


def remove_leftover_files():
  """Removes the servers' error files of processes that are gone (a killed run); returns
  their paths."""
  removed, pattern = [], re.compile(r"^tfpipe-server-(\d+)-")
  folder = tempfile.gettempdir()
  for name in sorted(os.listdir(folder)):
    match = pattern.match(name)
    if match and not liveness.process_alive(int(match.group(1))):
      with contextlib.suppress(OSError):
        os.remove(os.path.join(folder, name))
        removed.append(os.path.join(folder, name))
  return removed


def _place(host):
  """What a server on emulated `host` needs to go there (`_launch`)."""
  return {"netns": host.netns, "address": host.address, "procs": host.procs_files()}


class _Server:
  """A server process of a LocalCluster (a child of its launcher): `pid`, and `poll`, `kill`
  and `wait` as a `subprocess.Popen`'s."""

  def __init__(self, local, key, pid):
    self._local, self._key, self.pid = local, key, pid

  def poll(self):
    return self._local.exit_code(self._key)

  def wait(self):
    return self._local.exit_code(self._key, wait=True)

  def kill(self):
    if self.poll() is None:
      try:
        os.kill(self.pid, 9)
      except ProcessLookupError:   # exited; the launcher reports it
        pass


class _PortTaken(Exception):
  """A local server could not bind its port (another process took it first)."""


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
  for local in _LOCAL:
    if local.owns(job, task, address) is not None:
      return local
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
  TensorFlow runtime cannot take back the call. No devices on a cluster:
  nothing is watched.
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
    owned = [p for j, t, a, _ in lost for c in list(_LOCAL) for p in [c.owns(j, t, a)] if p]
    if len(owned) == len(lost):
      for process in owned:
        process.kill()
      return
    exits.exit_now(EXIT_LOST, "tfpipe: a remote call waits on it and cannot be cancelled: "
                   f"exiting with status {EXIT_LOST}")

  with liveness.Watchdog(tasks, on_lost, interval, timeout, misses) as watchdog:
    yield watchdog


def _watch_parent(parent):
  """Exits this server when process `parent` is gone (killed too: SIGKILL leaves no chance to
  stop its children): at once through Linux's parent-death signal, else within 0.2 s."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass

  def watch():
    while os.getppid() == parent:
      time.sleep(0.2)
    os._exit(0)

  if os.getppid() != parent:
    os._exit(0)
  threading.Thread(target=watch, name="tfpipe-parent", daemon=True).start()


def serve(argv):
  """Runs the TF servers the command line names (`python -m tfpipe.cluster --help`)."""
  parser = argparse.ArgumentParser(description="Runs one TensorFlow server of a cluster.")
  parser.add_argument("--spec", required=True, help="cluster spec as JSON")
  parser.add_argument("--job")
  parser.add_argument("--task", type=int)
  parser.add_argument("--tasks", help="job:task,... : fork a server for each (LocalCluster)")
  parser.add_argument("--errors", help="with --tasks: a JSON list, each server's stderr file")
  parser.add_argument("--places", help="with --tasks: a JSON list, each server's emulated host "
                                       "(network namespace, address, control group files)")
  parser.add_argument("--parent", type=int, default=None,
                      help="exit when the process with this PID exits")
  parser.add_argument("--mmap_threshold", type=int, default=allocator.MMAP_THRESHOLD,
                      help="a fixed malloc mmap threshold in bytes: freed blocks this large "
                           "go back to the host (a lower peak, slower steps; 4194304 where "
                           "memory binds); 0 (default): the C library's adaptive one "
                           "(tfpipe.cluster.allocator)")
  parser.add_argument("--every_interface", action="store_true",
                      help="listen on every interface (TensorFlow's default), not only on the "
                           "address the spec gives this task")
  args = parser.parse_args(argv)
  if (args.tasks is None) == (args.job is None or args.task is None):
    parser.error("give --job and --task (one server), or --tasks (servers forked here)")
  try:
    allocator.fix_mmap_threshold(args.mmap_threshold)   # before TensorFlow allocates
  except ValueError as e:
    parser.error(str(e))
  if args.parent is not None and args.tasks is None:   # a launcher watches after its forks
    _watch_parent(args.parent)
  spec = json.loads(args.spec)
  if args.tasks is not None:
    _launch([(job, int(task)) for job, _, task in (t.partition(":") for t in args.tasks.split(","))],
            spec, json.loads(args.errors), args.parent,
            json.loads(args.places) if args.places else None)
    return
  address = spec[args.job][args.task]
  if not args.every_interface and "TFPIPE_BIND_HOST" not in os.environ:
    env, why = bind.server_env(address.rpartition(":")[0].strip("[]"))
    if why is None:   # again, with the bind shim loaded: listen on the spec's address only
      os.execve(sys.executable, [sys.executable, "-m", "tfpipe.cluster"] + list(argv), env)
    print(f"warning: listening on every interface, not only {address}: {why}",
          file=sys.stderr, flush=True)
  _run_server(spec, args.job, args.task, lambda: print("ready", flush=True))


def _run_server(spec, job, task, ready):
  """Serves task `task` of `job` until killed; exits 1 naming the address if it cannot listen."""
  tf.config.threading.set_intra_op_parallelism_threads(1)
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                  start=True)
  except (tf.errors.OpError, RuntimeError) as e:
    print(f"error: could not listen at {spec[job][task]} (/job:{job}/task:{task}): "
          f"{str(e).splitlines()[0]} (is the port taken by another process?)", file=sys.stderr,
          flush=True)
    sys.exit(1)
  ready()
  server.join()


def _go_to(place):
  """Moves this (single-threaded, just forked) server onto its emulated host: its network
  namespace, its control groups, and its address for the bind shim."""
  emulation.enter(place["netns"])
  for path in place["procs"]:
    with open(path, "w") as f:
      f.write(str(os.getpid()))
  os.environ["TFPIPE_BIND_HOST"] = place["address"]


def _launch(tasks, spec, errors, parent, places=None):
  """LocalCluster's launcher: forks a server per task (TensorFlow imported, no op run yet) and
  reports on stdout, a line each: `started JOB TASK PID`, `ready JOB TASK`, `exit JOB TASK
  CODE`; `start JOB TASK` on stdin forks a task's exited server again. Exits once every
  server has exited and stdin is closed; they exit with it (parent-death signal).
  SIGTERM: it kills its servers (and starts no more), reaps them and exits."""

  def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())   # one write: whole lines

  children, stopping = {}, []

  def stop(*_):
    stopping.append(True)
    for pid in list(children):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)

  def fork(index):
    job, task = tasks[index]
    pid = os.fork()
    if pid == 0:   # the server
      signal.signal(signal.SIGTERM, signal.SIG_DFL)
      code = 1
      try:
        os.dup2(os.open(errors[index], os.O_WRONLY | os.O_APPEND), 2)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        _watch_parent(os.getppid())
        if places:
          _go_to(places[index])
        _run_server(spec, job, task, lambda j=job, t=task: say("ready", j, t))
      except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
      except BaseException:   # noqa: B036 -- reported as its exit code, with the traceback
        traceback.print_exc()
      finally:
        os._exit(code)
    children[pid] = (job, task)
    say("started", job, task, pid)
    if stopping:   # SIGTERM came between the fork and the line above
      stop()

  signal.signal(signal.SIGTERM, stop)
  for index in range(len(tasks)):
    if stopping:
      break
    fork(index)
  if parent is not None:   # only now: no other thread ran at the forks
    _watch_parent(parent)
  # Until its servers have exited and its input is closed: `start JOB TASK` on stdin forks
  # that task's server again (`LocalCluster.restart`).
  commands, listening = b"", True
  while children or (listening and not stopping):
    if listening and select.select([0], [], [], 0.2)[0]:
      chunk = os.read(0, 4096)
      listening, commands = bool(chunk), commands + chunk
      while b"\n" in commands:
        line, commands = commands.split(b"\n", 1)
        words = line.decode().split()
        key = (words[1], int(words[2])) if len(words) == 3 and words[0] == "start" else None
        if key in tasks and key not in children.values() and not stopping:
          fork(tasks.index(key))
    elif not listening:
      time.sleep(0.2)
    while children:
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      job, task = children.pop(pid, (None, None))
      if job is not None:
        say("exit", job, task, os.waitstatus_to_exitcode(status))

