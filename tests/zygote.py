"""Programs that tests run, started as forks of a process that has imported TensorFlow.

Starting Python and importing TensorFlow, Keras and tfpipe costs 4-6 s of CPU; the suite
runs a few dozen programs (bench scripts, the trainer, cluster scenarios). `run` gives each a
process of its own as `subprocess.run` does (its argv, working directory, environment, exit
code, stdout and stderr), but forked from a zygote: a process per pytest worker that imported
those libraries once and never ran a TensorFlow op, so each child still configures its
devices, threads and servers as a fresh program does.

`start` is `subprocess.Popen`'s counterpart for programs a test reads while they run, signals
or runs beside each other (its stdout a pipe, SIGINT as a terminal gives it, a session of its
own): the zygote answers with the child's pid at once and writes its exit code to a file
when it ends.

The zygote reads one request per line on stdin (JSON: argv, cwd, env, the output files) and
answers on stdout with the child's exit code (or, for `start`, its pid).
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_lock = threading.Lock()
_zygote = None


def _ask(request):
  """Sends `request` to this process's zygote (started on first use); its JSON answer."""
  global _zygote
  if _zygote is None or _zygote.poll() is not None:
    _zygote = subprocess.Popen([sys.executable, "-m", "tests.zygote"], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  _zygote.stdin.write(json.dumps(request) + "\n")
  _zygote.stdin.flush()
  answer = _zygote.stdout.readline()
  if not answer:
    raise RuntimeError(f"the zygote exited (code {_zygote.wait()}) running {request['argv']}")
  return json.loads(answer)


def run(argv, cwd=ROOT, env=None, timeout=600):
  """`subprocess.run([sys.executable, *argv], cwd=..., env=..., capture_output=True,
  text=True)` for `argv` of the forms `-m MODULE ARGS`, `-c CODE` and `SCRIPT ARGS`;
  returns a `subprocess.CompletedProcess`, raises `subprocess.TimeoutExpired`."""
  with _lock, tempfile.TemporaryDirectory() as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    code = _ask({"argv": list(argv), "cwd": str(cwd),
                 "env": dict(os.environ if env is None else env), "stdout": out, "stderr": err,
                 "timeout": timeout})["returncode"]
    with open(out) as f, open(err) as g:
      stdout, stderr = f.read(), g.read()
  if code is None:
    raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
  return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def start(argv, cwd=ROOT, env=None):
  """`subprocess.Popen([sys.executable, *argv], cwd=..., env=..., stdout=PIPE, stderr=PIPE,
  text=True, start_new_session=True)`, SIGINT raising KeyboardInterrupt as in a program
  started from a terminal; a `Started`."""
  tmp = tempfile.mkdtemp(prefix="zygote-")
  paths = {name: os.path.join(tmp, name) for name in ("stdout", "stderr", "exit")}
  os.mkfifo(paths["stdout"])
  with _lock:
    pid = _ask({"argv": list(argv), "cwd": str(cwd),
                "env": dict(os.environ if env is None else env), "start": True, **paths})["pid"]
  return Started([sys.executable, *argv], pid, tmp, paths)


class Started:
  """A program `start` forked, as much of a `subprocess.Popen` as the tests use: `pid`,
  `stdout` (text, read while it runs), `poll`, `wait`, `communicate`, `send_signal`, `kill`;
  `os.killpg(pid, ...)` reaches what it started (its own process group)."""

  def __init__(self, args, pid, tmp, paths):
    self.args, self.pid, self.returncode = args, pid, None
    self._tmp, self._paths, self._reader, self._rest = tmp, paths, None, []
    self.stdout = open(paths["stdout"])   # the child opens its end first thing
    _started.append(self)

  def poll(self):
    if self.returncode is None and os.path.exists(self._paths["exit"]):
      with open(self._paths["exit"]) as f:
        self.returncode = int(f.read())
    return self.returncode

  def wait(self, timeout=None):
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(self.args, timeout)
      time.sleep(0.02)
    return self.returncode

  def communicate(self, timeout=None):
    """(stdout not read yet, stderr) once the program exits; `subprocess.TimeoutExpired`
    after `timeout` seconds (the program keeps running, as with Popen)."""
    if self._reader is None:   # one reader, whose text a later call returns after a timeout
      self._reader = threading.Thread(target=lambda: self._rest.append(self.stdout.read()),
                                      daemon=True)
      self._reader.start()
    self.wait(timeout)
    self._reader.join(timeout=30)   # EOF once every holder of the pipe's write end has exited
    with open(self._paths["stderr"]) as f:
      stderr = f.read()
    return "".join(self._rest), stderr

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def _cleanup(self):
    if self.poll() is None:
      try:
        os.killpg(self.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.stdout.close()
    shutil.rmtree(self._tmp, ignore_errors=True)


_started = []


@atexit.register
def _stop():
  for child in _started:
    child._cleanup()   # pylint: disable=protected-access
  if _zygote is not None and _zygote.poll() is None:
    _zygote.stdin.close()
    _zygote.wait(timeout=30)


def _child(request):
  """The forked program: its directory, environment, output and argv, then `__main__`."""
  import runpy
  import traceback
  # Its output first: `start`'s caller waits on opening the stdout pipe's other end.
  for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  os.setpgrp()   # its own group: a timeout kills what it started too
  if request.get("start"):   # SIGINT as a terminal gives it (a suite run as a background
    signal.signal(signal.SIGINT, signal.default_int_handler)   # job starts with it ignored)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)   # the zygote's requests are not its input
  extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  argv = request["argv"]
  code = 0
  try:
    if argv[0] == "-m":
      sys.argv = [argv[1]] + argv[2:]
      sys.path[:1] = [os.getcwd()] + extra
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
      sys.argv = ["-c"] + argv[2:]
      sys.path[:1] = [""] + extra
      exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
      sys.argv = list(argv)
      sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0]))] + extra
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:   # noqa: B036 -- as the interpreter does: the traceback, exit 1
    traceback.print_exc()
    code = 1
  # As Python's exit: wait for the threads that are not daemons, then run the atexit
  # handlers (those the zygote's imports registered, as a fresh program's imports would).
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and not thread.daemon:
      thread.join()
  atexit._run_exitfuncs()   # pylint: disable=protected-access
  import logging
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _reap(pid, path):
  """Waits for a started child; its exit code (negative: the signal that ended it) to `path`."""
  _, status = os.waitpid(pid, 0)
  with open(path + ".part", "w") as f:
    f.write(str(os.waitstatus_to_exitcode(status)))
  os.replace(path + ".part", path)


def _serve():
  answers = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)   # what the imports print goes to stderr, never into the answers
  # What every program here imports first; nothing here may run a TensorFlow op.
  import keras  # noqa: F401
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot  # noqa: F401
  import numpy  # noqa: F401
  import tensorflow  # noqa: F401
  from absl import app, flags  # noqa: F401
  import tfpipe  # noqa: F401
  from tests import tracing
  tracing.skip_op_tracebacks()   # in every program it forks, as in the tests' own process
  for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
      answers.close()
      _child(request)
    if request.get("start"):   # answer now; a thread writes the exit code when it ends
      threading.Thread(target=_reap, args=(pid, request["exit"]), daemon=True).start()
      answers.write(json.dumps({"pid": pid}) + "\n")
      answers.flush()
      continue
    deadline = time.monotonic() + request["timeout"]
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        code = os.waitstatus_to_exitcode(status)
        break
      if time.monotonic() > deadline:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        code = None
        break
      time.sleep(0.02)
    answers.write(json.dumps({"returncode": code}) + "\n")
    answers.flush()


if __name__ == "__main__":
  _serve()
