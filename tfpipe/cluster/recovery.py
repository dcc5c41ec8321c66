"""Lost tasks brought back: a server this process started starts again, another is waited for.

`recover(lost, timeout)` takes a `WorkerLost` (its `tasks`): a task of a
`LocalCluster` (or `EmulatedCluster`) this process runs is forked again by its
launcher at its address (milliseconds: TensorFlow is already imported there);
a task of a cluster someone else runs (`--cluster=tf_config`) is probed until it
answers again, for at most `timeout` seconds. Then this program connects to the
cluster again (the tasks' state of the old connection is gone: the caller builds
its stages again).
"""

import time

from tfpipe.cluster import liveness, servers

__all__ = ["recover"]


def _wait_for(job, task, address, deadline, timeout, restarted=False):
  """Seconds until (job, task) answered a probe again; `WorkerLost` at `deadline` (the end of
  the restart's `timeout`)."""
  start = time.monotonic()
  state = "refused"
  while time.monotonic() < deadline:
    state = liveness.probe_all([(job, task, address)], min(2.0, timeout))[(job, task)]
    if state == "ok":
      return time.monotonic() - start
    time.sleep(0.5)
  why = ("its server was started again but cannot be reached (is its link down?)" if restarted
         else "this process did not start its server, so it cannot restart it: start it again "
         "(python -m tfpipe.cluster --spec=... --job=... --task=...) and run again")
  raise servers.WorkerLost(
      f"/job:{job}/task:{task} ({address}) did not answer again within {timeout:g} s "
      f"({servers.describe_state(state)}); {why}, or give a longer restart timeout",
      [(job, task, address)])


def recover(lost, timeout=120.0):
  """Brings the tasks of `lost` back and connects again; returns what was done, in words.
  A task is waited for until this program reaches it, within `timeout` seconds, even when
  its server was started again here: a link that is down delays both."""
  done, deadline = [], time.monotonic() + timeout
  for job, task, address in lost.tasks:
    local = servers.owner(job, task, address)
    if local is not None:
      local.restart(job, task, timeout)
    # One budget for the restart and the wait: never twice `timeout`.
    waited = _wait_for(job, task, address, deadline, timeout, restarted=local is not None)
    done.append(f"/job:{job}/task:{task} " + ("started again" if local is not None else
                                              "answered again")
                + (f", reached after {waited:.1f} s" if waited >= 1.0 else ""))
  servers.reconnect(timeout=min(timeout, 30.0))
  return ", ".join(done)
