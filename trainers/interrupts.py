"""SIGINT stops the trainer within seconds, even while TensorFlow waits inside a call.

Python runs its SIGINT handler (KeyboardInterrupt) only when the main thread
returns to the interpreter; a call waiting on a remote task may never
return. `exit_on_interrupt` lets Python's handler run as usual and also
wakes a watcher thread (`signal.set_wakeup_fd`), which exits the process if
the main thread has not finished within `grace` seconds. Local TF servers
die with the process (`tfpipe.cluster.LocalCluster`).
"""

import os
import signal
import sys
import threading
import time

__all__ = ["exit_on_interrupt"]


def exit_on_interrupt(status, grace=1.5):
  """Installs the watcher (main thread only); exits with `status` `grace` seconds after a
  SIGINT the main thread has not finished handling."""
  read, write = os.pipe()
  os.set_blocking(write, False)
  signal.set_wakeup_fd(write, warn_on_full_buffer=False)

  def watch():
    while True:
      data = os.read(read, 64)
      if int(signal.SIGINT) in data:
        time.sleep(grace)
        print("interrupted", file=sys.stderr, flush=True)
        os._exit(status)

  threading.Thread(target=watch, name="trainer-interrupt", daemon=True).start()
