"""Exiting at once (`os._exit`) without leaving servers, namespaces or files behind.

A remote call that waits on a task which cannot answer (its host frozen, its
link down) cannot be taken back: TensorFlow's runtime holds it, and the only
way on is to leave the process. `exit_now` does so after the cleanups that
`register` recorded (a `LocalCluster`'s servers and files, an emulated
network's namespaces and groups), which `atexit` would skip. `deadline`
bounds work that may wait so (a restart's reconnect and stage building): past
it, the process exits with a message naming what did not finish.
"""

import contextlib
import os
import sys
import threading

__all__ = ["register", "unregister", "exit_now", "deadline"]

_CLEANUPS = []
_LOCK = threading.Lock()
_EXITING = threading.Lock()


def register(cleanup):
  """Runs `cleanup()` (no arguments) before `exit_now` leaves this process (not a fork of
  it, which must not remove what this process still uses); returns it."""
  with _LOCK:
    _CLEANUPS.append((os.getpid(), cleanup))
  return cleanup


def unregister(cleanup):
  """Forgets `cleanup` (it ran on its own)."""
  with _LOCK:
    _CLEANUPS[:] = [(pid, c) for pid, c in _CLEANUPS if c != cleanup]


def exit_now(code, message):
  """Prints `message` on stderr, runs the registered cleanups (newest first, each error
  ignored: this is the last thing the process does) and exits with status `code`."""
  _EXITING.acquire()   # never released: a second caller waits for the first one's exit
  print(message, file=sys.stderr, flush=True)
  with _LOCK:
    cleanups = [c for pid, c in reversed(_CLEANUPS) if pid == os.getpid()]
    _CLEANUPS.clear()
  for cleanup in cleanups:
    with contextlib.suppress(Exception):
      cleanup()
  sys.stderr.flush()
  os._exit(code)


@contextlib.contextmanager
def deadline(seconds, code, message):
  """Runs the body; if it has not finished within `seconds`, `exit_now(code, message)` (the
  body may wait in a call that cannot be cancelled)."""
  timer = threading.Timer(seconds, exit_now, (code, message))
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
