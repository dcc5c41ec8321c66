"""The server processes: `python -m tfpipe.cluster --spec=... --job=... --task=...` serves one
task; with `--tasks`, a `LocalCluster`'s launcher forks a server per task (TensorFlow
imported once) and reports their starts, readiness and exits on stdout.
"""

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import threading
import time
import traceback

import tensorflow as tf

from tfpipe.cluster import allocator, bind, emulation

__all__ = ["serve"]


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
  parser.add_argument("--cpu_allocator", choices=allocator.CPU_ALLOCATORS, default=None,
                      help="TensorFlow's allocator for CPU tensors: bfc (TensorFlow's best-fit "
                           "allocator, at most the host's memory) or malloc; default: what "
                           "TF_CPU_ALLOCATOR_USE_BFC says, else bfc (tfpipe.cluster.allocator)")
  parser.add_argument("--every_interface", action="store_true",
                      help="listen on every interface (TensorFlow's default), not only on the "
                           "address the spec gives this task")
  args = parser.parse_args(argv)
  if (args.tasks is None) == (args.job is None or args.task is None):
    parser.error("give --job and --task (one server), or --tasks (servers forked here)")
  try:
    allocator.fix_mmap_threshold(args.mmap_threshold)   # before TensorFlow allocates
    allocator.use_cpu_allocator(args.cpu_allocator)
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
  namespace, its control groups, its address for the bind shim, and its memory cap as its
  CPU allocator's limit."""
  emulation.enter(place["netns"])
  for path in place["procs"]:
    with open(path, "w") as f:
      f.write(str(os.getpid()))
  os.environ["TFPIPE_BIND_HOST"] = place["address"]
  if place.get("memory") and allocator.cpu_allocator() == "bfc":   # the host's cap binds
    allocator.use_cpu_allocator("bfc", limit=int(place["memory"]))


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
