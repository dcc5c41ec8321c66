"""Traces of chosen training steps: a Chrome trace-event JSON of the runtime's own tasks
(opens in Perfetto or chrome://tracing) and a TensorBoard profile (`tf.profiler`) of the
device ops, for the same steps.

K: stages, k: stage index. A step is a mini-batch counted over the whole run
(epoch * batches_per_epoch + batch). Tracing never stops training: a
profiler that fails to start or stop gives a warning.
"""

import json
import os
import warnings

import tensorflow as tf

__all__ = ["TRACE_FILE", "chrome_trace", "write_chrome_trace", "StepTracer", "parse_steps"]

TRACE_FILE = "tfpipe_trace.json"
_NAMES = {"F": "forward", "B": "backward", "FB": "forward+backward", "U": "update",
          "R": "receive gradient", "S": "barrier", "XF": "transfer to next stage",
          "XB": "transfer to previous stage"}


def parse_steps(value):
  """(first, last) from "50,60" or a pair; both included, first <= last, both >= 0."""
  if value is None:
    return None
  parts = value.split(",") if isinstance(value, str) else list(value)
  try:
    first, last = (int(p) for p in parts)
  except (TypeError, ValueError):
    raise ValueError(f"trace steps must be two integers FIRST,LAST. Received: {value!r}") from None
  if not 0 <= first <= last:
    raise ValueError(f"trace steps need 0 <= FIRST <= LAST. Received: {value!r}")
  return first, last


def _step(record, batches_per_epoch):
  return record.epoch * batches_per_epoch + record.batch


def chrome_trace(records, devices, batches_per_epoch, steps=None):
  """The trace-event dict of `records` whose step lies in `steps` = (first, last), or all.

  One track per stage worker ("stage k (device)") and one per link direction;
  each event names its task, e.g. "F12.3", with its kind, step and version.
  """
  chosen = [r for r in records
            if steps is None or steps[0] <= _step(r, batches_per_epoch) <= steps[1]]
  K = len(devices)
  tracks = {("stage", k): f"stage {k} ({devices[k]})" for k in range(K)}
  for k in range(K - 1):
    tracks[("XF", k)] = f"link {k} -> {k + 1}"
    tracks[("XB", k + 1)] = f"link {k + 1} -> {k}"
  tids = {key: n for n, key in enumerate(tracks)}
  events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "tfpipe runtime"}}]
  events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tids[key], "args": {"name": name}}
             for key, name in tracks.items()]
  origin = min((r.start for r in chosen), default=0.0)
  for r in sorted(chosen, key=lambda r: r.start):
    track = (r.kind, r.stage) if r.kind in ("XF", "XB") else ("stage", r.stage)
    micro = "" if r.micro is None else f".{r.micro}"
    events.append({
        "ph": "X", "pid": 0, "tid": tids[track], "name": f"{r.kind}{r.batch}{micro}",
        "ts": (r.start - origin) * 1e6, "dur": max(0.0, r.end - r.start) * 1e6,
        "args": {"kind": _NAMES.get(r.kind, r.kind), "stage": r.stage, "epoch": r.epoch,
                 "batch": r.batch, "micro": r.micro, "step": _step(r, batches_per_epoch),
                 "version": r.version, "s": r.s}})
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path, records, devices, batches_per_epoch, steps=None):
  """Writes `chrome_trace(...)` as JSON to `path`; returns the number of task events."""
  trace = chrome_trace(records, devices, batches_per_epoch, steps)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(trace, f)
  return sum(e["ph"] == "X" for e in trace["traceEvents"])


class StepTracer:
  """Runs `tf.profiler` over steps first..last and then writes the runtime's trace JSON.

  `on_step_end(step)` is called as each step's result arrives. The profiler
  starts before step `first` (at the end of step first-1, or at `begin()` for
  step 0) and stops at the end of step `last`; a pipeline has later steps in
  flight at both edges, so the profile can hold some of their ops.
  """

  def __init__(self, logdir, steps):
    self.logdir, self.steps = logdir, steps
    self.active, self.profiled = False, False

  def _start(self):
    try:
      tf.profiler.experimental.start(self.logdir)
      self.active = True
    except Exception as e:  # pylint: disable=broad-except
      warnings.warn(f"tfpipe: the TensorBoard profiler did not start ({e}); training goes on "
                    "without a device profile", RuntimeWarning)

  def _stop(self):
    if not self.active:
      return
    self.active = False
    try:
      tf.profiler.experimental.stop()
      self.profiled = True
    except Exception as e:  # pylint: disable=broad-except
      warnings.warn(f"tfpipe: the TensorBoard profiler did not stop cleanly ({e})",
                    RuntimeWarning)

  def begin(self, step):
    """Called before the first step of a `fit` (step: its global index)."""
    if step == self.steps[0]:
      self._start()

  def on_step_end(self, step):
    if step == self.steps[0] - 1:
      self._start()
    if step == self.steps[1]:
      self._stop()

  def end(self):
    """Stops a profile still running (training ended inside the window)."""
    self._stop()
