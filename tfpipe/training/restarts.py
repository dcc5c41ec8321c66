"""`Pipeline.fit(max_restarts=N)`: training goes on after a lost host, without a human.

When a task running stages stops answering, `fit` raises `cluster.WorkerLost`
naming it (the watchdog names a hung one within seconds). With `max_restarts`,
`fit` instead brings the task back (`tfpipe.cluster.recovery`: a server this
process started starts again; another is waited for), builds the stages again
on the new servers (`Pipeline.recompile`) and resumes from the newest checkpoint
of its `BackupAndRestore` callback, as a new process would: epochs after that
checkpoint are trained again, from the data position the checkpoint records,
so a synchronous method ends with the weights of an uninterrupted run. Each
restart is one line on stderr and one entry of `history.restarts`; the History
holds every epoch, those before the last restore from the earlier attempts.
"""

import sys
import time

import keras

from tfpipe import cluster
from tfpipe.cluster import recovery
from tfpipe.training import checkpoint as checkpoint_lib, data

__all__ = ["check", "fit"]


def check(max_restarts, timeout, callbacks, x):
  """Refuses, in one line, restarts that could lose work or cannot replay the data."""
  if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"`max_restarts` must be an integer >= 0. Received: {max_restarts!r}")
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
    raise ValueError(f"`restart_timeout` must be a positive number of seconds. "
                     f"Received: {timeout!r}")
  if not max_restarts:
    return
  if not any(isinstance(cb, (checkpoint_lib.BackupAndRestore, keras.callbacks.BackupAndRestore))
             for cb in callbacks or []):
    raise ValueError(f"max_restarts={max_restarts} resumes from the newest checkpoint: pass "
                     "tfpipe.checkpoint.BackupAndRestore(directory) (or "
                     "keras.callbacks.BackupAndRestore) among the callbacks")
  if data.is_iterable_data(x):
    raise ValueError(f"max_restarts={max_restarts} reads the data again from the checkpoint's "
                     f"epoch, which a {type(x).__name__} cannot give twice: pass arrays or a "
                     "tf.data.Dataset")


def _merged(earlier, history):
  """`history` with the epochs of `earlier` (an attempt that was cut short) before its first."""
  if earlier is None:
    return history
  first = history.epoch[0] if history.epoch else float("inf")
  keep = [i for i, e in enumerate(earlier.epoch) if e < first]
  history.epoch = [earlier.epoch[i] for i in keep] + history.epoch
  for key, values in earlier.history.items():
    history.history[key] = [values[i] for i in keep] + history.history.get(key, [])
  return history


def fit(pipe, attempt, max_restarts, timeout):
  """Runs `attempt()` (one `fit`), bringing lost tasks back up to `max_restarts` times."""
  lines, earlier = [], None
  while True:
    pipe.model.history = None   # Keras's History sets it at each epoch's end
    try:
      history = attempt()
    except cluster.WorkerLost as lost:
      if len(lines) >= max_restarts or not lost.tasks:
        raise
      start = time.monotonic()
      partial = pipe.model.history   # this attempt's epochs, if it finished any
      if isinstance(partial, keras.callbacks.History):
        earlier = _merged(earlier, partial)
      done = recovery.recover(lost, timeout)
      pipe.recompile()
      names = ", ".join(f"/job:{job}/task:{task}" for job, task, _ in lost.tasks)
      lines.append(f"restart {len(lines) + 1} of {max_restarts}: lost {names}; {done}, "
                   f"stages built again in {time.monotonic() - start:.1f} s; resuming from the "
                   "newest checkpoint")
      print(f"tfpipe: {lines[-1]}", file=sys.stderr, flush=True)
      continue
    history = _merged(earlier, history)
    history.restarts = lines
    return history
