"""Dataset iterators deleted off the caller's thread.

Deleting a tf.data iterator joins its autotuning thread, whose sleep the deletion does not
cut short: optimisation periods that double (10 ms + 20 ms + ... + 10.24 s), so deleting an
epoch's iterator could hold `fit` up for seconds (measured: `bench/results/history.md`,
"Figures the code cited"). The wait holds no
GIL, so `release` hands an iterator to a thread that deletes it there, once nothing else
holds it; a user's dataset keeps its options. Python's exit waits for those threads, at most
EXIT_WAIT seconds (an `atexit` handler): a thread still inside TensorFlow's deletion when
Python finalises is unwound through C++ frames that do not rethrow, and the process aborts
(measured: a MultiWorkerMirroredStrategy worker exiting right after `fit`)."""

import atexit
import sys
import threading
import time
from typing import Any, List

__all__ = ["release", "wait", "THREAD_NAME", "EXIT_WAIT"]

# Seconds the deleting thread waits for the caller's own references to go; past it, it drops
# its reference and the iterator is deleted wherever the last one goes (as without it).
WAIT = 2.0
# Seconds Python's exit waits for deletions still running (past it, the process may abort).
EXIT_WAIT = 60.0
# The deleting threads' name: they end once their iterator is deleted, which may outlast a fit.
THREAD_NAME = "tfpipe-iterator-release"

# The deleting threads started, until `wait` finds them ended.
_THREADS: List[threading.Thread] = []


def release(iterator: Any) -> None:
  """Hands `iterator` (or None) to a daemon thread of its own, which deletes it once the
  caller's references are gone; returns None, for `iterator = release(iterator)`."""
  if iterator is not None:
    box = [iterator]
    del iterator
    thread = threading.Thread(target=_delete, args=(box,), name=THREAD_NAME, daemon=True)
    thread.start()
    _THREADS[:] = [t for t in _THREADS if t.is_alive()] + [thread]
  return None


def wait(timeout: float = 60.0) -> None:
  """Waits (at most `timeout` seconds in all) until every iterator released so far is deleted:
  before this program connects to a cluster, which resets TensorFlow's eager context under
  any deletion still running."""
  deadline = time.monotonic() + timeout
  for thread in list(_THREADS):
    thread.join(max(0.0, deadline - time.monotonic()))
  _THREADS[:] = [t for t in _THREADS if t.is_alive()]


def _delete(box: List[Any]) -> None:
  item = box.pop()
  deadline = time.monotonic() + WAIT
  # 2: `item` and getrefcount's argument; more while the caller still holds it.
  while sys.getrefcount(item) > 2 and time.monotonic() < deadline:
    time.sleep(0.005)
  del item


@atexit.register
def _wait_at_exit() -> None:
  """Python's exit waits for the deletions still running (at most EXIT_WAIT seconds)."""
  wait(EXIT_WAIT)
