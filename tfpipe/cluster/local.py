"""`LocalCluster`: TensorFlow servers in local processes (tests, `--cluster=local:W,P`, and
emulated hosts' servers: `tfpipe.cluster.emulated`), started by one launcher process
(`tfpipe.cluster.serving`) that forks a server per task; the servers die with this process.
"""

import contextlib
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from tfpipe.cluster import allocator, bind, exits, liveness

__all__ = ["LocalCluster", "free_port", "remove_leftover_files", "RUNNING"]

RUNNING = []   # the LocalClusters of this process that are running


def free_port():
  """A TCP port free on 127.0.0.1 now (for a task of a local cluster spec)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


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
  adaptive one; `tfpipe.cluster.allocator`); `cpu_allocator`: TensorFlow's allocator for
  their CPU tensors, "bfc" or "malloc" (None: `allocator.cpu_allocator()`, "bfc" unless
  TF_CPU_ALLOCATOR_USE_BFC says otherwise).
  """

  PORT = 2222   # the port of a task on a host of its own (`places`)

  def __init__(self, jobs, timeout=60.0, attempts=3, places=None,
               mmap_threshold=allocator.MMAP_THRESHOLD, cpu_allocator=None):
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
    self.cpu_allocator = allocator.cpu_allocator(cpu_allocator)
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
    RUNNING.append(self)
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
         f"--mmap_threshold={self.mmap_threshold}", f"--cpu_allocator={self.cpu_allocator}",
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
      if self in RUNNING:
        RUNNING.remove(self)
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
  """Removes the temporary files of processes that are gone (a killed run): the servers'
  error files, and the folders a trace of the hosts writes to
  (`tfpipe.instruments.transfers`); returns their paths."""
  removed, pattern = [], re.compile(r"^tfpipe-(?:server|hosts)-(\d+)-")
  folder = tempfile.gettempdir()
  for name in sorted(os.listdir(folder)):
    match = pattern.match(name)
    if match and not liveness.process_alive(int(match.group(1))):
      path = os.path.join(folder, name)
      with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path)
        else:
          os.remove(path)
        removed.append(path)
  return removed


def _place(host):
  """What a server on emulated `host` needs to go there (`_launch`)."""
  return {"netns": host.netns, "address": host.address, "procs": host.procs_files(),
          "memory": host.group.memory if host.group is not None else None}


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
