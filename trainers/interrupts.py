"""SIGINT stops the trainer within seconds, even while TensorFlow waits inside a call.

Python runs its SIGINT handler (KeyboardInterrupt) only when the main thread
returns to the interpreter; a call waiting on a remote task may never
return. `exit_on_interrupt` lets Python's handler run as usual and also
wakes a watcher thread (`signal.set_wakeup_fd`), which exits the process if
the main thread has not finished within `grace` seconds. SIGTERM exits at
once, from the main thread or, when it waits inside a call, from the watcher.
Either way the process's TF servers, emulated hosts and files are removed
first (`tfpipe.cluster.exits`).
"""

import os
import signal
import threading
import time

from tfpipe.cluster import exits

__all__ = ["exit_on_interrupt", "TERMINATED"]

TERMINATED = 128 + signal.SIGTERM   # as a shell reports it


def _terminate(*_):
  exits.exit_now(TERMINATED, "terminated (SIGTERM)")


_TERM = {signal.SIGTERM}


def _forget():
  """In a fork: signals are its own again (no wakeup pipe, SIGTERM's default action)."""
  try:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  except ValueError:   # forked from a thread other than the main one: it has no handlers
    pass
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _TERM)


def exit_on_interrupt(status, grace=1.5):
  """Installs the watcher (main thread only); exits with `status` `grace` seconds after a
  SIGINT the main thread has not finished handling, and with `TERMINATED` at a SIGTERM."""
  read, write = os.pipe()
  os.set_blocking(write, False)
  signal.set_wakeup_fd(write, warn_on_full_buffer=False)
  signal.signal(signal.SIGTERM, _terminate)
  # A fork that does not exec (pyroute2 enters a namespace in one, then ends it with SIGTERM)
  # would write its signals into this process's pipe and run this process's handler.
  # SIGTERM waits (blocked) from the fork until the child has forgotten the handlers.
  os.register_at_fork(before=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, _TERM),
                      after_in_parent=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, _TERM),
                      after_in_child=_forget)

  def watch():
    while True:
      data = os.read(read, 64)
      if int(signal.SIGTERM) in data:
        _terminate()
      if int(signal.SIGINT) in data:
        time.sleep(grace)
        exits.exit_now(status, "interrupted")

  threading.Thread(target=watch, name="trainer-interrupt", daemon=True).start()
