"""Is a TF server alive? An RPC-level probe, and a watchdog that names a dead or hung task.

A TCP connect is no answer: the kernel accepts connections for a stopped
(SIGSTOP) or hung process. `probe` speaks the first step of gRPC's
HTTP/2: it sends the client preface and waits for the server's SETTINGS
frame, which only the running server process writes. States:
  "ok":      the server answered;
  "refused": nothing listens there (or the host is unreachable);
  "silent":  the port accepts connections but the process does not answer
             within the timeout (stopped, hung, or not a gRPC server);
  "closed":  the connection was closed without an answer.

`Watchdog` probes the tasks a run uses every `interval` seconds from a
daemon thread; after `misses` probes in a row without an answer it calls
`on_lost(lost)` with [(job, task, address, state)]. A task that answers, but
`misses` times in a row slower than `SLOW_FACTOR` times its usual answer
(the fastest it gave) and than `SLOW_FLOOR` seconds (a delayed or lossy link,
a host swapping), is handed to `on_slow(job, task, address, seconds, usual)`
once, and to `on_slow(..., None, usual)` once it answers as usual again. A remote call to a
hung server never returns, so the caller decides what unblocks it (see
`tfpipe.cluster.guard`).
"""

import concurrent.futures
import json
import os
import signal
import socket
import sys
import threading
import time

__all__ = ["probe", "probe_all", "Watchdog", "STATES", "describe_state", "await_tasks",
           "SLOW_FACTOR", "SLOW_FLOOR"]

STATES = ("ok", "refused", "silent", "closed")
SLOW_FACTOR = 5.0
SLOW_FLOOR = 0.25     # seconds: a probe is a TCP connect and two small writes

# The HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113 section 3.4).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_SETTINGS = 0x4


def probe(address, timeout=2.0):
  """The state of the gRPC server at "host:port" (see the module docstring), within `timeout`
  seconds."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout
  try:
    conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
  except OSError:
    return "refused"
  try:
    conn.sendall(_PREFACE)
    header = b""
    while len(header) < 9:
      conn.settimeout(max(0.01, deadline - time.monotonic()))
      chunk = conn.recv(9 - len(header))
      if not chunk:
        return "closed"
      header += chunk
    return "ok" if header[3] == _SETTINGS else "closed"
  except socket.timeout:
    return "silent"
  except OSError:
    return "closed"
  finally:
    conn.close()


def describe_state(state):
  """What a probe state says of a task, in words."""
  return {"refused": "nothing listens there",
          "silent": "it accepts connections but its process does not answer (stopped or hung)",
          "closed": "it closed the connection without answering (not a TensorFlow server?)",
          "ok": "it answers"}[state]


def _timed(address, timeout):
  start = time.monotonic()
  return probe(address, timeout), time.monotonic() - start


def probe_all(tasks, timeout=2.0, timed=False):
  """{(job, task): state} of `tasks` [(job, task, address)], probed in parallel; `timed`:
  {(job, task): (state, seconds the probe took)}."""
  if not tasks:
    return {}
  with concurrent.futures.ThreadPoolExecutor(min(16, len(tasks))) as pool:
    answers = pool.map(lambda t: _timed(t[2], timeout), tasks)
    return {(job, task): answer if timed else answer[0]
            for (job, task, _), answer in zip(tasks, answers)}


class Watchdog:
  """Probes `tasks` [(job, task, address)] every `interval` seconds while running (a context
  manager); `on_lost([(job, task, address, state)])` once, after `misses` probes in a row
  without an answer from any of them (each probe waits `timeout` seconds), unless `stop` came
  first; `on_slow` (see the module docstring) for a task that answers slowly."""

  def __init__(self, tasks, on_lost, interval=1.0, timeout=2.0, misses=2, on_slow=None):
    self.tasks, self.on_lost, self.on_slow = list(tasks), on_lost, on_slow
    self.interval, self.timeout, self.misses = interval, timeout, misses
    self.lost = None
    self._stop = threading.Event()
    self._verdict = threading.Lock()   # held while `on_lost` runs: `stop` waits for it
    self._thread = None

  def __enter__(self):
    if self.tasks:
      self._thread = threading.Thread(target=self._run, name="tfpipe-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self.stop()
    if self._thread is not None:
      self._thread.join()

  def stop(self):
    """No verdict from now on (a task may end now: nothing waits on it any more); returns at
    once, or once an `on_lost` already running has returned."""
    with self._verdict:
      self._stop.set()

  def _run(self):
    missed, usual, slow, named = {}, {}, {}, set()
    while not self._stop.wait(self.interval):
      answers = probe_all(self.tasks, self.timeout, timed=True)
      if self._stop.is_set():
        return
      states = {key: state for key, (state, _) in answers.items()}
      for key, state in states.items():
        missed[key] = missed.get(key, 0) + 1 if state != "ok" else 0
      for job, task, address in self.tasks if self.on_slow is not None else ():
        state, seconds = answers[(job, task)]
        if state != "ok":
          continue
        fastest = usual.get((job, task), seconds)
        usual[(job, task)] = min(fastest, seconds)
        late = seconds > max(SLOW_FACTOR * fastest, SLOW_FLOOR)
        slow[(job, task)] = slow.get((job, task), 0) + 1 if late else 0
        if slow[(job, task)] >= self.misses and (job, task) not in named:
          named.add((job, task))
          self.on_slow(job, task, address, seconds, fastest)
        elif not late and (job, task) in named:
          named.discard((job, task))
          self.on_slow(job, task, address, None, fastest)
      lost = [(job, task, address, states[(job, task)]) for job, task, address in self.tasks
              if missed[(job, task)] >= self.misses]
      if lost:
        with self._verdict:
          if not self._stop.is_set():
            self.lost = lost
            self.on_lost(lost)
        return


def process_alive(pid):
  """Whether process `pid` exists (another user's counts)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def await_tasks(tasks, timeout, parent):
  """Waits until every task of `tasks` [(job, task, address)] has answered a probe once; if
  some have not within `timeout` seconds, names them on stderr and terminates process
  `parent` (SIGKILL), which waits on them in a call TensorFlow cannot cancel. Run as a
  process of its own (`python liveness.py`: the standard library only), since that call may
  hold Python's lock."""
  waiting, deadline = list(tasks), time.monotonic() + timeout
  while waiting:
    states = probe_all(waiting, timeout=2.0)
    waiting = [t for t in waiting if states[(t[0], t[1])] != "ok"]
    if waiting and time.monotonic() > deadline:
      names = "; ".join(f"/job:{job}/task:{task} ({address}): "
                        f"{describe_state(states[(job, task)])}" for job, task, address in waiting)
      print(f"tfpipe: the cluster's workers did not all start within {timeout:g} s: {names}",
            file=sys.stderr, flush=True)
      os.kill(parent, signal.SIGKILL)   # TensorFlow may catch SIGTERM (preemption notices)
      return 1
    if waiting:
      time.sleep(0.5)
  return 0


if __name__ == "__main__":   # python liveness.py TASKS_JSON TIMEOUT PARENT_PID
  sys.exit(await_tasks([tuple(t) for t in json.loads(sys.argv[1])], float(sys.argv[2]),
                       int(sys.argv[3])))
