"""`Pipeline.fit(max_restarts=N)`: training goes on after a lost host, without a human.

When a task running stages stops answering, `fit` raises `cluster.WorkerLost`
naming it (the watchdog names a hung one within seconds). With `max_restarts`,
`fit` instead brings the task back (`tfpipe.cluster.recovery`: a server this
process started starts again; another is waited for), builds the stages again
on the new servers (`Pipeline.recompile`) and resumes from the newest checkpoint
of its `BackupAndRestore` callback, as a new process would: epochs after that
checkpoint are trained again, from the data position the checkpoint records,
so a synchronous method ends with the weights of an uninterrupted run (before
the first checkpoint, from the weights `fit` started from, kept here). A
`tf.data.Dataset` that reshuffles each iteration cannot give an earlier epoch's
order again in the same process (each iterator advances its shuffle seed), so
`x` may be a function that builds the data: `fit` calls it for each attempt, and
a restart then reads the order of an uninterrupted run (`made`). Each
restart is one line on stderr and one entry of `history.restarts`. A task lost
again while the stages are built takes one more restart; a restart that does
not finish within `restart_timeout` + `RECOMPILE_SECONDS` (a call that waits on
a task which cannot answer) exits with status 3, cleaning up first. The History
holds every epoch, those before the last restore from the earlier attempts.
"""

import sys
import time

import keras
import tensorflow as tf

from tfpipe import cluster
from tfpipe.cluster import exits, recovery
from tfpipe.training import checkpoint as checkpoint_lib, data

__all__ = ["check", "fit", "made", "RECOMPILE_SECONDS"]

# A restart may take `restart_timeout` to bring the task back, and this long more to connect
# again and build the stages; past that, the process exits with status 3 (`exits.deadline`).
RECOMPILE_SECONDS = 60.0


def check(max_restarts, timeout, callbacks, x, y=None):
  """Refuses, in one line, restarts that could lose work or cannot replay the data."""
  if callable(x) and y is not None:
    raise ValueError("`x` is a function that builds the data (a dataset of (inputs, targets)), "
                     f"so `y` must be None. Received: y of type {type(y).__name__}")
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
  if data.is_iterable_data(x) and not callable(x):
    raise ValueError(f"max_restarts={max_restarts} reads the data again from the checkpoint's "
                     f"epoch, which a {type(x).__name__} cannot give twice: pass arrays or a "
                     "tf.data.Dataset")


def made(x):
  """The data of one attempt of `fit`: `x`, or what `x()` builds when `x` is a function."""
  if not callable(x):
    return x
  built = x()
  if built is None or callable(built):
    raise ValueError("`x` is a function, which `fit` calls for the data of each attempt; it "
                     f"returned {built!r}, not data (a tf.data.Dataset, arrays, a generator)")
  return built


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


def _checkpointed(callbacks):
  """Whether the checkpoint callback among `callbacks` has written a checkpoint yet."""
  for cb in callbacks or []:
    directory = getattr(cb, "directory", None) or getattr(cb, "backup_dir", None)
    if isinstance(cb, (checkpoint_lib.BackupAndRestore, keras.callbacks.BackupAndRestore)):
      return bool(checkpoint_lib.intact_checkpoints(directory))
  return False


def _names(lost):
  return ", ".join(f"/job:{job}/task:{task}" for job, task, _ in lost.tasks)


def _rebuild(pipe, lost, timeout):
  """Brings the tasks of `lost` back (a task that does not come back raises `WorkerLost`) and
  builds the stages again; returns (what was done, in words, and the `WorkerLost` of a task
  lost again while the stages were built, or None)."""
  done = recovery.recover(lost, timeout)
  try:
    with cluster.guard(pipe.remote_stages()):   # a host that hangs meanwhile is named
      pipe.recompile()
  except tf.errors.OpError as e:
    again = cluster.describe_lost(e, pipe.remote_stages())
    if again is None or not again.tasks:
      raise
    return done, again
  return done, None


def fit(pipe, attempt, max_restarts, timeout, callbacks=None):
  """Runs `attempt()` (one `fit`), bringing lost tasks back up to `max_restarts` times."""
  lines, earlier, lost = [], None, None
  # A task lost before the first checkpoint is written: training starts again from the
  # weights `fit` started from (the model holds newer ones from each epoch's end).
  initial = pipe.model.get_weights() if max_restarts else None
  while True:
    if lost is not None:
      if len(lines) >= max_restarts or not lost.tasks:
        raise lost
      start, number = time.monotonic(), f"restart {len(lines) + 1} of {max_restarts}"
      # A task that stops answering while this program connects again or builds its stages
      # holds a call that cannot be taken back: past the deadline the process exits, cleanly.
      with exits.deadline(timeout + RECOMPILE_SECONDS, cluster.EXIT_LOST,
                          f"tfpipe: {number} did not finish within "
                          f"{timeout + RECOMPILE_SECONDS:g} s (a task stopped answering while "
                          "this program connected again or built its stages); the checkpoints "
                          f"are kept: run again to resume. Exiting with status "
                          f"{cluster.EXIT_LOST}"):
        done, again = _rebuild(pipe, lost, timeout)
        if again is not None:
          # Lost again while the stages were built (a link down again): one more restart.
          lines.append(f"{number}: lost {_names(lost)}; lost {_names(again)} again while "
                       "the stages were built")
          print(f"tfpipe: {lines[-1]}", file=sys.stderr, flush=True)
          lost = again
          continue
      resume = "resuming from the newest checkpoint"
      if not _checkpointed(callbacks):
        pipe.model.set_weights(initial)
        resume = "no checkpoint yet: starting again from the weights fit started from"
      lines.append(f"{number}: lost {_names(lost)}; {done}, stages built again in "
                   f"{time.monotonic() - start:.1f} s; {resume}")
      print(f"tfpipe: {lines[-1]}", file=sys.stderr, flush=True)
      lost = None
    pipe.model.history = None   # Keras's History sets it at each epoch's end
    try:
      history = attempt()
    except cluster.WorkerLost as e:
      partial = pipe.model.history   # this attempt's epochs, if it finished any
      if isinstance(partial, keras.callbacks.History):
        earlier = _merged(earlier, partial)
      lost = e
      continue
    history = _merged(earlier, history)
    history.restarts = lines
    return history
