"""Shared by the bench scripts: where results go, how tables are written, how calls are timed.

Each script prints its tables and writes them, with any plots, under
bench/results/ (or --results_dir), so README can show the latest ones.
"""

import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["RESULTS", "markdown_table", "write", "report", "median_seconds", "seconds_per_batch",
           "in_child", "in_child_or_error", "ChildFailed", "fit_span"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def markdown_table(head, rows):
  """A Markdown table: `head` a list of column names, `rows` lists of cells (str() each)."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def write(results_dir, name, text):
  """Writes `text` to results_dir/name; returns the path."""
  os.makedirs(results_dir, exist_ok=True)
  path = os.path.join(results_dir, name)
  with open(path, "w") as f:
    f.write(text.rstrip() + "\n")
  return path


def report(results_dir, name, title, table):
  """Writes `title` and `table` to results_dir/name and prints them."""
  write(results_dir, name, f"{title}\n\n{table}\n")
  print(f"\n{title}\n\n{table}", flush=True)


def median_seconds(fn, repeats=20):
  """The median wall time of `repeats` calls of `fn`, after one untimed call (tracing)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


class ChildFailed(RuntimeError):
  """`in_child`'s function raised, or its process died: the message is its last line."""


def fit_span():
  """A Keras callback timing `fit` from on_train_begin to on_train_end (`.seconds`): tracing
  before the first batch counts, the per-fit setup and what follows the last hook do not."""
  import keras

  class Span(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
      self.start = time.perf_counter()

    def on_train_end(self, logs=None):
      self.seconds = time.perf_counter() - self.start

  return Span()


def in_child(fn, *args, timeout=None):
  """`fn(*args)` in a process of its own, forked from this one; returns its result (pickled
  back). What a bench script measures per configuration runs so, in a TensorFlow of its own:
  this process must not have started TensorFlow's runtime (importing it is fine: a fork then
  skips the child's import, which costs about 4 s of CPU). The child's output goes to a file
  whose last line a failure names (`ChildFailed`); past `timeout` seconds it is killed
  (`TimeoutError`)."""
  import multiprocessing
  import tempfile
  if "tensorflow" in sys.modules:
    from tfpipe import compat
    if compat.runtime_started():
      raise RuntimeError("in_child: this process has started TensorFlow's runtime, which a fork "
                         "would share; measure in a process that has not run a TensorFlow op")
  fork = multiprocessing.get_context("fork")
  receive, send = fork.Pipe(duplex=False)
  with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
    child = fork.Process(target=_child, args=(send, log.name, fn, args), daemon=True)
    child.start()
    send.close()
    try:
      if not receive.poll(timeout):
        raise TimeoutError(f"over {timeout} s")
      ok, value = receive.recv()
    except EOFError:
      child.join()
      lines = log.read().strip().splitlines()
      ok, value = False, lines[-1] if lines else f"exited with code {child.exitcode}"
    finally:
      if child.is_alive():
        child.kill()
      child.join()
      receive.close()
  if not ok:
    raise ChildFailed(value)
  return value


def in_child_or_error(fn, config, timeout, width=120):
  """`in_child(fn, config, timeout=timeout)`, or {"error": why} (its first `width` characters)
  where the child failed or ran past `timeout`: a bench script's row that says so."""
  try:
    return in_child(fn, config, timeout=timeout)
  except TimeoutError:
    return {"error": f"over {timeout} s"}
  except ChildFailed as e:
    return {"error": str(e)[:width]}


def _child(send, log, fn, args):
  """`in_child`'s process: its output to `log`, then (ok, result or error) to `send`."""
  import traceback
  fd = os.open(log, os.O_WRONLY | os.O_APPEND)
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  try:
    result = (True, fn(*args))
  except BaseException as e:  # noqa: BLE001 -- reported to the parent, with the traceback
    traceback.print_exc()
    result = (False, f"{type(e).__name__}: {e}".splitlines()[0])
  sys.stdout.flush()
  sys.stderr.flush()
  send.send(result)
  send.close()


def child_values(config, **flag_values):
  """bench/runtime_overhead.py's measurement of one configuration (a dict: runner, K, where,
  threads), in a process of its own with those flags: {name: value} of the "name value"
  lines it prints (seconds_per_batch, the marginal seconds per mini-batch; graph_ops_per_batch
  where known; seconds_per_hop for the transfer bound)."""
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime_overhead.py")
  result = subprocess.run([sys.executable, script, f"--child={json.dumps(config)}"]
                          + [f"--{name}={value}" for name, value in flag_values.items()],
                          cwd=os.path.dirname(os.path.dirname(script)), capture_output=True,
                          text=True, timeout=1800)
  values = dict(line.split()[:2] for line in result.stdout.splitlines()
                if line.startswith(("seconds_per_batch ", "graph_ops_per_batch ",
                                    "seconds_per_hop ")))
  if result.returncode != 0 or not values:
    raise RuntimeError(f"{config} failed:\n{result.stderr[-3000:]}")
  return {name: float(value) for name, value in values.items()}


def seconds_per_batch(config, **flag_values):
  """`child_values(...)["seconds_per_batch"]`."""
  return child_values(config, **flag_values)["seconds_per_batch"]
