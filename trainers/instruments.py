"""The trainer's instruments: trace, breakdown, throughput window, prediction error.

Each is switched by a flag (see trainers/flags.py); `Instruments(config)`
gives the Pipeline options and Keras callbacks they need, and `finish`
writes their TensorBoard scalars and plots and returns the text to print.
"""

import os
import time

__all__ = ["Instruments", "TRACE_DONE_VARIABLE"]

# A file the first worker makes once its host trace has ended (`run_workers` names one in a
# folder every emulated host shares): the other workers wait for it before anything else runs.
TRACE_DONE_VARIABLE = "TFPIPE_TRACE_DONE"

class Instruments:
  TRACE_EPOCHS = 1.5   # --transfer_share traces this many of the last epoch's seconds

  def __init__(self, config):
    from tfpipe import methods
    from tfpipe.instruments import trace
    self.config = config
    self.trace_steps = trace.parse_steps(config.trace_steps or None)
    self.window = trace.parse_steps(config.throughput_window or None)
    if self.window is not None and self.window[0] == self.window[1]:
      raise ValueError(f"--throughput_window needs FIRST < LAST. Received: {config.throughput_window!r}")
    if config.prediction_error and config.method != "spectrain":
      raise ValueError("--prediction_error measures SpecTrain's weight prediction: use it with "
                       f"--method=spectrain. Received: --method={config.method}")
    if self.trace_steps is not None and not (config.trace_dir or config.logdir):
      raise ValueError("--trace_steps needs --trace_dir or --logdir to write the trace to")
    self.pipeline = methods.kind(config.method).pipeline
    self.meter = None
    self.traffic = None   # a tfpipe.instruments.traffic.LinkTraffic on emulated hosts
    self.hosts = None     # {(job, task): "ip:port"} of the emulated hosts' servers
    self.transfers = None   # --transfer_share: {(job, task): transfers.Shares} once traced
    self._began = self._epoch_seconds = self._trace_error = None
    if config.transfer_share and not (config.cluster or "").startswith(("emulated:",
                                                                         "tf_config")):
      raise ValueError("--transfer_share traces the TF servers of emulated hosts: give "
                       f"--cluster=emulated:R,K,LINK. Received: --cluster={config.cluster}")

  def trace_one_more_epoch(self, fit, barrier=None):
    """--transfer_share: `fit(callbacks)` trains one more epoch while every host's server is
    traced over it (`transfers.HostTrace`, for `TRACE_EPOCHS` times the last epoch's seconds;
    `self.transfers`). A worker that traces nothing (`hosts` None: not the first of several)
    trains the epoch, then keeps its server up and runs no op until the first worker's trace
    has ended (`_wait_for_trace`): a server gone before it ends fails the trace, and a worker
    whose profiler ended its trace while the worker ran an op (a collective waiting for the
    others) or shut down crashed (SIGSEGV, measured). Then every worker meets the others,
    `barrier()` (data parallelism's workers), so that none ends before the first is done."""
    import keras
    from tfpipe.instruments import transfers
    seconds = self.TRACE_EPOCHS * self._epoch_seconds
    if self.hosts is None:
      began = []
      fit([keras.callbacks.LambdaCallback(
          on_epoch_begin=lambda epoch, logs: began.append(time.monotonic()))])
      start = began[0] if began else time.monotonic()
      self._wait_for_trace(start + transfers.HostTrace.LEAD + seconds)
    else:
      tracer = transfers.HostTrace(self.hosts, seconds)
      fit([tracer])
      self.transfers = tracer.result
      self._trace_error = tracer.error
      done = os.environ.get(TRACE_DONE_VARIABLE)
      if done:
        with open(done, "w"):
          pass
    if barrier is not None:
      barrier()

  WAIT_MARGIN = 5.0   # seconds past a trace's own end, where no word of its end comes
  WORD_WAIT = 120.0   # seconds past that, at most, where a word is to come

  def _wait_for_trace(self, ends):
    """Returns once the first worker's trace has ended: its word (a file, where
    `TRACE_DONE_VARIABLE` names one), or else `WAIT_MARGIN` seconds past the trace's end as
    this worker reckons it (`ends`, on `time.monotonic`'s clock; its epoch began within a
    step of the first worker's, whose trace began before its first step)."""
    done = os.environ.get(TRACE_DONE_VARIABLE)
    deadline = ends + self.WAIT_MARGIN + (self.WORD_WAIT if done else 0.0)
    while time.monotonic() < deadline and not (done and os.path.exists(done)):
      time.sleep(0.05)

  @property
  def trace_dir(self):
    return self.config.trace_dir or os.path.join(self.config.logdir, self.config.method, "trace")

  def pipeline_options(self):
    """Keyword arguments for `tfpipe.Pipeline`."""
    if not self.pipeline:
      return {}
    return dict(record=self.config.breakdown,
                trace_steps=self.trace_steps,
                trace_dir=self.trace_dir if self.trace_steps is not None else None,
                prediction_error=bool(self.config.prediction_error))

  def callbacks(self):
    import keras
    from tfpipe.instruments.throughput import ThroughputMeter
    cbs = []
    if self.window is not None:
      self.meter = ThroughputMeter(self.config.batch_size, self.window)
      cbs.append(self.meter)
    if self.config.transfer_share:   # the last epoch's seconds: how long to trace one more
      cbs.append(keras.callbacks.LambdaCallback(
          on_epoch_begin=lambda epoch, logs: setattr(self, "_began", time.monotonic()),
          on_epoch_end=lambda epoch, logs: setattr(self, "_epoch_seconds",
                                                   time.monotonic() - self._began)))
    if self.trace_steps is not None and not self.pipeline:  # Keras profiles the baselines
      cbs.append(keras.callbacks.TensorBoard(self.trace_dir, profile_batch=self.trace_steps,
                                             write_graph=False))
    return cbs

  def finish(self, trainer):
    """Writes scalars and plots; returns the lines to print at the end of training."""
    import tensorflow as tf
    from tfpipe import methods
    from tfpipe.instruments import breakdown
    lines, scalars = [], {}
    if self.meter is not None and methods.kind(self.config.method).parameter_servers:
      lines.append("throughput over a window of steps: not measured (asgd runs its steps "
                   "asynchronously on the workers; samples/s per epoch is in the logs)")
    elif self.meter is not None and len(self.meter.ends) > self.window[0]:
      # A run too short to reach the window (a smoke test, a few steps) has nothing to say.
      a, b = self.window
      try:
        rate = self.meter.samples_per_second()
        scalars["throughput/samples_per_second"] = rate
        lines.append(f"throughput over steps {a}..{b}: {rate:.1f} samples/s (steady state; "
                     "'samples/s, whole last epoch' above includes pipeline fill and drain)")
      except ValueError as e:
        lines.append(f"throughput over steps {a}..{b}: not measured ({e})")
    if self.pipeline and self.config.breakdown:
      result = trainer.breakdown()
      scalars.update(result.scalars())
      lines.append(breakdown.format_breakdown(result))
    recorder = getattr(trainer, "prediction_error", None)
    if recorder is not None:
      summary = recorder.summary()
      lines.append("weight prediction error (mean RMSE to the weights reached s updates later)")
      lines += [f"  s={s}: predicted {p:.3e}   stale {q:.3e}" for s, (p, q) in summary.items()]
    if self.trace_steps is not None:
      lines.append(f"trace of steps {self.trace_steps[0]}..{self.trace_steps[1]}: {self.trace_dir}")
    if self.config.logdir:
      logdir = os.path.join(self.config.logdir, self.config.method)
      with tf.summary.create_file_writer(logdir).as_default():
        for key, value in scalars.items():
          tf.summary.scalar(key, value, step=0)
      if recorder is not None:
        recorder.write_summaries(logdir)
        path = recorder.plot(os.path.join(logdir, "prediction_error.png"))
        lines.append(f"prediction error plot: {path}")
    if self.traffic is not None and self.traffic.end is not None:
      from tfpipe.instruments import traffic
      lines.append(traffic.describe(self.traffic))
    if self.transfers is not None:
      from tfpipe.instruments import transfers
      lines.append(transfers.describe(self.transfers))
    elif self._trace_error is not None:
      lines.append(f"time on each host: not traced ({self._trace_error})")
    return lines
