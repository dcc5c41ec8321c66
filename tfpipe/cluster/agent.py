"""Restarts of a whole training process, for what no restart inside it can mend.

A restart inside `fit` (`tfpipe.training.restarts`) brings a lost task back
in seconds without leaving the process. But a call that waits on a task which
cannot answer (a link down while the program connects again) cannot be taken
back: the process leaves with status `EXIT_LOST` (3), cleaning up first
(`tfpipe.cluster.exits`). `supervise(argv, max_restarts)` runs a training
program as a process of its own and starts it again each time it exits with
that status, as torchrun's agent does: the program resumes from its newest
checkpoint. The restarts the program made inside (its `tfpipe: restart` lines
on stderr, which pass through) count towards `max_restarts` too; the program
gets the rest in `TFPIPE_MAX_RESTARTS`. After every run the agent removes
what a killed run leaves (emulated hosts' namespaces, servers' error files);
SIGTERM and SIGINT given to the agent go to the program.
"""

import os
import re
import signal
import subprocess
import sys
import threading

from tfpipe.cluster import emulation, local, servers

__all__ = ["supervise", "SUPERVISED", "REMAINING"]

SUPERVISED = "TFPIPE_SUPERVISED"        # set in the program's environment: do not supervise
REMAINING = "TFPIPE_MAX_RESTARTS"       # the restarts the program may still make
_RESTART = re.compile(r"^tfpipe: restart \d+ of \d+")


def _relay(stream, counted):
  """Copies the program's stderr to this process's, counting its restart lines."""
  for line in iter(stream.readline, b""):
    if _RESTART.match(line.decode("utf-8", "replace")):
      counted.append(line)
    sys.stderr.buffer.write(line)
    sys.stderr.flush()


def _clean_up():
  """Removes what a program killed before its clean-up left (runs whose process is gone)."""
  removed = local.remove_leftover_files()
  try:
    removed += emulation.remove_leftovers()
  except (emulation.EmulationUnavailable, OSError):
    pass   # no emulated hosts here (not root, no pyroute2): none were made
  return removed


def supervise(argv, max_restarts, env=None):
  """Runs `argv` until it exits with a status other than `EXIT_LOST` or has restarted
  `max_restarts` times (inside it or here); returns its last exit status (128 + N when
  signal N ended it)."""
  if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"`max_restarts` must be an integer >= 0. Received: {max_restarts!r}")
  counted, restarts, current = [], 0, {}

  def forward(signum, _):
    process = current.get("process")
    if process is not None and process.poll() is None:
      process.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while True:
      left = max_restarts - restarts - len(counted)
      child_env = dict(os.environ if env is None else env, **{SUPERVISED: "1",
                                                               REMAINING: str(max(left, 0))})
      process = subprocess.Popen(argv, env=child_env, stderr=subprocess.PIPE)
      current["process"] = process
      relay = threading.Thread(target=_relay, args=(process.stderr, counted), daemon=True)
      relay.start()
      code = process.wait()
      relay.join()
      process.stderr.close()
      _clean_up()
      left = max_restarts - restarts - len(counted)
      if code != servers.EXIT_LOST or left <= 0:
        return 128 - code if code < 0 else code   # killed by a signal: as a shell says it
      restarts += 1
      print(f"tfpipe: process restart {restarts} ({restarts + len(counted)} of {max_restarts} "
            f"restarts): the program exited with status {code} (a lost task it could not "
            "take back); starting it again, resuming from the newest checkpoint",
            file=sys.stderr, flush=True)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)
