"""Pipeline: train one Keras model split into stages over several devices, Keras-style.

K: stages. `Pipeline(model, ...)` cuts the model, `compile` gives every stage
its own optimizer (built from the user's config) on its device, and
`fit`/`evaluate`/`predict` run the schedule of the chosen method. After
`fit` the trained weights are in the user's model.
"""

import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfpipe import breakdown as breakdown_lib, checkpoint as checkpoint_lib, cluster
from tfpipe import compile_utils, data, devices as devices_lib
from tfpipe import layer_profile, names, partition as partition_lib, policies, runtime, schedules
from tfpipe import prediction_error as prediction_error_lib, stage, trace

__all__ = ["Pipeline"]


class Pipeline:
  """A Keras model trained with pipelined model parallelism.

  Args:
    model: a built Sequential or functional Keras model.
    devices: one device string per stage (local or remote); or None with
      `num_stages` to take the first K local GPUs (else logical CPUs).
    num_stages: K, when `devices` is None.
    stage_replicas: {stage: R} (or ["0:2"]): hybrid parallelism. Stage k runs
      data parallel on R devices (the next R of `devices`): each call splits
      its batch over them, the weights are shared and the gradients summed,
      as the SpecTrain paper does for VGG16's slow first stage. Works with
      every method; the weight rule is unchanged.
    method: one of `tfpipe.PIPELINE_METHODS`: "sequential", "gpipe",
      "vanilla", "pipedream", "spectrain", "ddg", "feature_replay",
      "timeprest" (DESIGN.md section 3).
    partition: "uniform", "params", "profile", or explicit cut positions
      [0, ..., number of layers] (see `tfpipe.partition.partition`).
    spectrain_backward: "reuse" (the backward reads the forward's predicted
      weights, no recomputation) or "repredict" (a new prediction with the
      backward's version difference; in TensorFlow this recomputes the
      stage from its saved input: one extra forward per backward).
    version_difference: "paper" (seed 000 eq. 5-6) or "exact" (counted from
      the schedule).
    micro_batches: M, micro-batches per mini-batch: for "gpipe" and
      "timeprest" (default 4), and for "vanilla", "pipedream" and
      "spectrain" (default 1), whose stages then accumulate the M gradients
      and update once per mini-batch (SpecTrain needs version_difference="exact").
    recompute: keep only stage inputs and recompute the forward before the
      backward ("sequential", "gpipe"); None takes the method's rule.
    lockstep: "ddg" and "feature_replay" only: every step ends with a barrier
      on all stages, as the DDG paper runs them (same weights, other timing).
    profile_batch_size: the batch size at which "profile" measures layers.
    record: keep a `TaskRecord` of every task and transfer in `self.records`
      (what `breakdown()` reads).
    trace_steps: (first, last) or "first,last": steps of each `fit` (counted
      from 0 over its epochs) to trace into `trace_dir`: a TensorBoard profile
      of the device ops (`tf.profiler`) and `tfpipe_trace.json`, the
      runtime's tasks as Chrome trace events (Perfetto). Turns `record` on.
    prediction_error: a `tfpipe.prediction_error.PredictionError` (or True
      for one with s = 1, 2, 3) fed after every stage update: the RMSE of the
      predicted and of the stale weights to the weights reached s updates
      later (SpecTrain fig. 8). Needs the SpecTrain optimizer; costs a copy of
      the stage's weights per update. Kept in `self.prediction_error`.
    jit_compile: compile each stage task with XLA. One XLA call runs on one
      thread (with 1 intra-op thread), so stages on logical CPU devices never
      compete for the shared inter-op pool.
  """

  def __init__(self, model, devices=None, num_stages=None, method="spectrain",
               partition="uniform", spectrain_backward="reuse", version_difference="paper",
               micro_batches=None, recompute=None, lockstep=False, profile_batch_size=32,
               record=False, trace_steps=None, trace_dir=None, prediction_error=None,
               stage_replicas=None, jit_compile=None):
    if not isinstance(model, keras.Model):
      raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    self.model = model
    self.policy = policies.policy_for(method, spectrain_backward, recompute, lockstep)
    self.method = self.policy.method
    self.micro_batches = policies.micro_batches_for(self.policy, micro_batches)
    self.version_difference = names.lookup(
        "version_difference", version_difference, policies.VERSION_DIFFERENCES)
    if self.policy.predicts and self.micro_batches > 1 and self.version_difference == "paper":
      raise ValueError(
          "version_difference='paper' counts one update per batch (seed 000 eq. 5-6); with "
          f"micro_batches={self.micro_batches} use version_difference='exact'")
    self.stage_devices, self.stage_replicas = devices_lib.resolve_stage_devices(
        devices, num_stages, stage_replicas)
    self.devices = [d[0] for d in self.stage_devices]   # where each stage's variables live
    self.num_stages = len(self.devices)
    self._check_cluster()
    profiler = None
    if partition == "profile":
      profiler = layer_profile.Profiler(profile_batch_size, self.devices[0])
    self.partition = partition_lib.partition(
        model, self.num_stages, partition, profile=profiler, recompute=self.policy.recompute)
    self.trace_steps = trace.parse_steps(trace_steps)
    if self.trace_steps is not None and not trace_dir:
      raise ValueError(f"`trace_steps={trace_steps!r}` needs a `trace_dir` to write the trace to")
    self.trace_dir = trace_dir
    self.record = bool(record) or self.trace_steps is not None
    self.jit_compile = jit_compile
    if prediction_error is True:
      prediction_error = prediction_error_lib.PredictionError()
    if prediction_error not in (None, False) and not isinstance(
        prediction_error, prediction_error_lib.PredictionError):
      raise ValueError("`prediction_error` must be True or a tfpipe.prediction_error."
                       f"PredictionError. Received: {prediction_error!r}")
    self.prediction_error = prediction_error or None
    self._fit_epochs = None   # the last fit's (first runtime epoch, batches per epoch, initial_epoch)
    self.runtime = None

  def _remote(self):
    return [d for ds in self.stage_devices for d in ds
            if tf.DeviceSpec.from_string(d).job not in (None, "localhost")]

  def _check_cluster(self):
    """Remote devices need a connected cluster that has their tasks (checked before training)."""
    remote = self._remote()
    if not remote:
      return
    spec = cluster.connected_spec()
    if spec is None:
      raise ValueError(f"device {remote[0]!r} is remote: connect to its cluster first "
                       "(tfpipe.cluster.connect(spec))")
    cluster.check_devices(remote, spec)

  @property
  def stage_models(self):
    return self.partition.stages

  @property
  def schedule_report(self):
    """The verifier's report on the last schedule run (`tfpipe.verify.Report`), or None."""
    return self.runtime.report if self.runtime else None

  @property
  def records(self):
    return self.runtime.records if self.runtime else []

  def _fit_records(self, steps=None):
    """Records of the last fit, with the fit's epoch index (from `initial_epoch`), within
    `steps` (epoch * batches per epoch + batch) if given."""
    if self._fit_epochs is None:
      raise RuntimeError("no timeline yet: call `fit` first")
    first, per_epoch, initial = self._fit_epochs
    chosen = [r._replace(epoch=r.epoch - first + initial) for r in self.records if r.epoch >= first]
    if steps is not None:
      chosen = [r for r in chosen if steps[0] <= r.epoch * per_epoch + r.batch <= steps[1]]
    return chosen

  def breakdown(self, steps=None):
    """Per-stage shares of wall time training the last `fit`'s epochs (validation left out), or
    its `steps` ("first,last"): compute, transfer, idle_transfer, idle_imbalance
    (`tfpipe.breakdown`). Needs record=True."""
    if not self.record:
      raise RuntimeError("the breakdown reads the recorded timeline: build the Pipeline with "
                         "record=True")
    steps = trace.parse_steps(steps)
    records = self._fit_records()
    chosen = self._fit_records(steps)
    if not chosen:
      raise ValueError(f"no recorded task in steps {steps}")
    windows = {}
    for r in chosen:
      lo, hi = windows.get(r.epoch, (r.start, r.end))
      windows[r.epoch] = (min(lo, r.start), max(hi, r.end))
    return breakdown_lib.combine(breakdown_lib.breakdown(records, self.num_stages, w)
                                 for w in windows.values())

  def summary(self):
    """One line per stage: its device and layers."""
    micro = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
    lines = [f"tfpipe.Pipeline: method={self.method}, {self.num_stages} stages{micro}"]
    for k, (devices, layers) in enumerate(zip(self.stage_devices, self.partition.layer_names)):
      where = devices[0] if len(devices) == 1 else f"{len(devices)} replicas on {', '.join(devices)}"
      lines.append(f"  stage {k} on {where}: {', '.join(layers)}")
    return "\n".join(lines)

  def compile(self, optimizer, loss, metrics=None):
    """Gives each stage its own copy of `optimizer` (same config) and the last stage the loss."""
    optimizer = compile_utils.resolve_optimizer(optimizer)
    self.optimizer = optimizer
    self.loss = compile_utils.resolve_loss(loss)
    if len(self.model.outputs) != 1:
      raise ValueError(
          f"tfpipe trains models with one output; {self.model.name!r} has {len(self.model.outputs)}")
    with tf.device(self.devices[-1]):  # metric state lives with the last stage
      self.metrics = compile_utils.resolve_metrics(metrics, self.loss)
      self.loss_tracker = keras.metrics.Mean(name="loss")
    programs = []
    for k, (sub, device) in enumerate(zip(self.partition.stages, self.devices)):
      last = k == self.num_stages - 1
      with tf.device(device):  # the optimizer's step counter and slots live with the stage
        stage_optimizer = compile_utils.clone_optimizer(optimizer)
      programs.append(stage.StageProgram(
          k, self.num_stages, sub, device, stage_optimizer, self.policy,
          loss=self.loss if last else None, metrics=self.metrics if last else (),
          loss_tracker=self.loss_tracker if last else None, jit_compile=self.jit_compile,
          replica_devices=self.stage_devices[k]))
    self.programs = programs
    self.runtime = runtime.Runtime(programs, record=self.record,
                                   maxsize=max(self.num_stages, self.micro_batches))
    if self.prediction_error is not None:
      for p in programs:
        if not hasattr(p.optimizer, "smoothed_gradient"):
          raise ValueError(
              "`prediction_error` needs the SpecTrain optimizer (tfpipe.optimizers.SpecTrain). "
              f"Received: {type(optimizer).__name__}")
      recorder = self.prediction_error
      self.runtime.update_hooks.append(
          lambda k, program: recorder.observe_optimizer(k, program.trainable, program.optimizer))

  def _check_compiled(self):
    if self.runtime is None:
      raise RuntimeError("call `compile(optimizer, loss, metrics)` before fit/evaluate/predict")

  def _load_weights(self):
    """Takes the user model's current weights (it may have changed since the last call)."""
    for p in self.programs:
      p.load_from_model()

  def _reset_metrics(self):
    self.loss_tracker.reset_state()
    for m in self.metrics:
      m.reset_state()

  def _metric_logs(self, prefix=""):
    logs = {prefix + "loss": float(self.loss_tracker.result())}
    for m in self.metrics:
      logs[prefix + m.name] = float(m.result())
    return logs

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
          validation_data=None, shuffle=True, steps_per_epoch=None, seed=None, initial_epoch=0):
    """Trains epochs `initial_epoch` .. `epochs`-1; returns a `keras.callbacks.History`.

    Each epoch runs the method's schedule over its batches and drains at the
    end, so every batch's update lands in the epoch that drew it. A
    `tfpipe.checkpoint.BackupAndRestore` among the callbacks saves the
    pipeline at epoch ends and, when it finds a checkpoint, resumes from it.
    """
    self._check_compiled()
    if not isinstance(epochs, int) or epochs < 1:
      raise ValueError(f"`epochs` must be a positive integer. Received: epochs={epochs!r}")
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch:
      raise ValueError(f"`initial_epoch` must be an integer >= 0. Received: {initial_epoch!r}")
    if isinstance(batch_size, int) and batch_size < self.micro_batches:
      raise ValueError(
          f"`batch_size` must be at least micro_batches={self.micro_batches}. Received: "
          f"batch_size={batch_size}")
    most = max(self.stage_replicas.values(), default=1)
    if isinstance(batch_size, int) and batch_size // self.micro_batches < most:
      raise ValueError(
          f"a replicated stage splits each (micro-)batch over {most} devices: `batch_size` must "
          f"be at least {most * self.micro_batches}. Received: batch_size={batch_size}")
    dataset, num_batches = data.as_dataset(x, y, batch_size, steps_per_epoch, shuffle, seed)
    schedule = schedules.build(self.policy.schedule, self.num_stages, num_batches,
                               self.micro_batches)
    diffs = policies.version_differences(self.policy, schedule, self.version_difference)
    verbose = 1 if verbose == "auto" else verbose
    cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                       model=self.model, verbose=verbose, epochs=epochs,
                                       steps=num_batches)
    self._load_weights()
    initial_epoch = max(initial_epoch, self._restore(callbacks))
    self.model.stop_training = False
    self._fit_epochs = (self.runtime.epoch + 1, num_batches, initial_epoch)
    tracer = (trace.StepTracer(self.trace_dir, self.trace_steps)
              if self.trace_steps is not None else None)
    if tracer:
      tracer.begin(initial_epoch * num_batches)
    cbs.on_train_begin()
    logs = {}
    try:
      iterator = self._replay_data(dataset, initial_epoch, steps_per_epoch, num_batches)
      for epoch in range(initial_epoch, epochs):
        if steps_per_epoch is None or iterator is None:
          iterator = iter(dataset)
        self._reset_metrics()
        cbs.on_epoch_begin(epoch)
        start = time.perf_counter()
        losses = []

        def on_result(b, loss, epoch=epoch):
          losses.append(float(loss))
          cbs.on_train_batch_end(b, {"loss": float(np.mean(losses))})
          if tracer:
            tracer.on_step_end(epoch * num_batches + b)

        try:
          self.runtime.train_epoch(schedule, diffs, iterator, num_batches, on_result)
        except runtime.OutOfData:
          raise ValueError(
              f"the data ran out before {num_batches} batches in epoch {epoch}; give a "
              "`steps_per_epoch` the data can fill, or repeat the dataset") from None
        except tf.errors.OpError as e:
          lost = cluster.describe_lost(e, self._remote()) if self._remote() else None
          if lost is None:
            raise
          raise lost from e
        seconds = time.perf_counter() - start
        logs = self._metric_logs()
        samples = float(self.loss_tracker.count.numpy())
        logs["samples_per_second"] = samples / seconds if seconds > 0 else 0.0
        for p in self.programs:
          p.write_to_model()
        if validation_data is not None:
          val_x, val_y = (validation_data if isinstance(validation_data, (tuple, list))
                          else (validation_data, None))
          logs.update(self._evaluate(val_x, val_y, batch_size, None, prefix="val_"))
        cbs.on_epoch_end(epoch, logs)
        if self.model.stop_training:
          break
    finally:
      if tracer:
        tracer.end()
    if tracer:
      trace.write_chrome_trace(os.path.join(self.trace_dir, trace.TRACE_FILE),
                               self._fit_records(), self.devices, num_batches, self.trace_steps)
    cbs.on_train_end(logs)
    return self.model.history

  def _restore(self, callbacks):
    """Resumes from the latest checkpoint of a BackupAndRestore callback; returns epochs done."""
    done = 0
    for cb in callbacks or []:
      if isinstance(cb, checkpoint_lib.BackupAndRestore):
        cb.attach(self)
        done = max(done, cb.restore())
    if done:
      for p in self.programs:
        p.write_to_model()
    return done

  @staticmethod
  def _replay_data(dataset, epochs_done, steps_per_epoch, num_batches):
    """Puts the data where an uninterrupted run would be after `epochs_done` epochs.

    Returns the persistent iterator (steps_per_epoch) advanced past the
    batches trained, or None after advancing a reshuffling dataset by one
    unread iterator per epoch done.
    """
    if not epochs_done:
      return None
    if steps_per_epoch is None:
      for _ in range(epochs_done):
        iter(dataset)
      return None
    iterator = iter(dataset)
    for _ in range(epochs_done * num_batches):
      next(iterator)
    return iterator

  def _evaluate(self, x, y, batch_size, steps, prefix=""):
    dataset, num_batches = data.as_dataset(x, y, batch_size, steps)
    self._reset_metrics()
    self.runtime.infer_epoch(iter(dataset), num_batches, lambda b, loss: None, with_labels=True)
    return self._metric_logs(prefix)

  def evaluate(self, x=None, y=None, batch_size=None, steps=None, return_dict=False, verbose=0):
    """Loss and metrics over the data with the current weights, pipelined forward only."""
    self._check_compiled()
    self._load_weights()
    logs = self._evaluate(x, y, batch_size, steps)
    if verbose:
      print(" - ".join(f"{k}: {v:.4f}" for k, v in logs.items()))
    return logs if return_dict else (list(logs.values()) if len(logs) > 1 else logs["loss"])

  def predict(self, x, batch_size=None, steps=None):
    """The model's outputs for `x` (arrays or a dataset of inputs), as a numpy array."""
    self._check_compiled()
    self._load_weights()
    if isinstance(x, tf.data.Dataset):
      spec = x.element_spec
      if isinstance(spec, tuple) and len(spec) == 2:
        x = x.map(lambda a, b: a)
    dataset, num_batches = data.as_dataset(x, None, batch_size, steps, labels=False)
    outputs = {}
    self.runtime.infer_epoch(iter(dataset), num_batches,
                             lambda b, ys: outputs.__setitem__(b, ys[0].numpy()), with_labels=False)
    return np.concatenate([outputs[b] for b in range(num_batches)], axis=0)
