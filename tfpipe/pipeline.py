"""Pipeline: train one Keras model split into stages over several devices, Keras-style.

K: stages. `Pipeline(model, ...)` cuts the model, `compile` gives every stage
its own optimizer (built from the user's config) on its device, and
`fit`/`evaluate`/`predict` run the schedule of the chosen method. After
`fit` the trained weights are in the user's model.
"""

import os
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfpipe import checkpoint as checkpoint_lib, cluster
from tfpipe import compat, compile_utils, data, devices as devices_lib, input_checks
from tfpipe import layer_profile, learning_rate, mitigations, partition as partition_lib
from tfpipe import runtime, stage
from tfpipe.plan import names, policies, schedules
from tfpipe.instruments import breakdown as breakdown_lib
from tfpipe.instruments import prediction_error as prediction_error_lib, trace

__all__ = ["Pipeline"]


_BATCH_HOOKS = {"train": ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin",
                           "on_batch_end"),
                "test": ("on_test_batch_begin", "on_test_batch_end"),
                "predict": ("on_predict_batch_begin", "on_predict_batch_end")}


def _has_batch_hooks(callback, mode="train"):
  """True when the callback overrides a `mode` batch hook of `keras.callbacks.Callback`: in
  its class, or on the instance (`keras.callbacks.LambdaCallback` sets the hooks it is given)."""
  base = keras.callbacks.Callback
  for name in _BATCH_HOOKS[mode]:
    hook = getattr(callback, name, None)
    if getattr(hook, "__func__", hook) is not getattr(base, name):
      return True
  return False


def _reads_batches(cbs, mode):
  """True when a callback besides the progress bar has `mode` batch hooks."""
  return any(_has_batch_hooks(cb, mode) and not isinstance(cb, keras.callbacks.ProgbarLogger)
             for cb in cbs.callbacks)


def _all_layers(model):
  """Every layer of `model`, nested models' layers included."""
  for layer in model.layers:
    yield layer
    if hasattr(layer, "layers"):
      yield from _all_layers(layer)


class Pipeline:
  """A Keras model trained with pipelined model parallelism.

  AUTO_WINDOW: mini-batches per compiled window when `steps_per_execution` is
  "auto" and nothing reads every batch; AUTO_REMOTE_WINDOW when a stage is on
  a TF server, where each window call pays remote calls (measured, tiny
  model on 2 servers: 1.52 ms per mini-batch with 16 per window, 1.26 with 64).

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
      "timeprest" (DESIGN.md section 3), "pipemare" (vanilla's schedule, the
      backward on weights corrected back to the forward's, PipeMare) or
      "i_timeprest" (TiMePReSt's schedule, the backward on a blend of the
      forward's and the current weights); see `tfpipe.mitigations`.
      "spectrain" predicts with the step of the optimizer it is compiled
      with (`tfpipe.prediction`: SpecTrain, momentum SGD, Adam, AdamW).
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
      (what `breakdown()` reads). The threaded executor times each task in
      Python; the compiled one profiles each epoch with `tf.profiler` and
      reads the tasks from its timeline (`tfpipe.runtime.timeline`: this
      process's devices only; it slows the run while it profiles).
    trace_steps: (first, last) or "first,last": steps of each `fit` (counted
      from 0 over its epochs) to trace into `trace_dir`: a TensorBoard profile
      of the device ops (`tf.profiler`; with the compiled executor, of the
      whole epochs holding those steps) and `tfpipe_trace.json`, the
      runtime's tasks as Chrome trace events (Perfetto). Turns `record` on.
    prediction_error: a `tfpipe.instruments.prediction_error.PredictionError` (or True
      for one with s = 1, 2, 3) fed after every stage update: the RMSE of the
      predicted and of the stale weights to the weights reached s updates
      later (SpecTrain fig. 8), predicting along the optimizer's own step
      (`tfpipe.prediction`: SpecTrain, momentum SGD, Adam, AdamW); costs a copy
      of the stage's weights per update. Kept in `self.prediction_error`.
    jit_compile: compile each stage task with XLA. One XLA call runs on one
      thread (with 1 intra-op thread), so stages on logical CPU devices never
      compete for the shared inter-op pool. None: on when every stage is on a
      GPU (as Keras's `jit_compile="auto"`), off otherwise.
    spike_compensation: Kosson et al.'s spike compensation: each stage's
      update gives its delayed gradient the momentum it missed at once
      (`tfpipe.mitigations`; momentum SGD or SpecTrain).
    delay_momentum: each stage runs with momentum max(0, gamma - D/(D+1)) for
      its delay D (asynchrony acts as momentum, Mitliagkas et al. 2016).
    lr_rescheduling: PipeMare's learning-rate rescheduling over this many
      updates (the gradients of a stage with delay D start scaled by 1/D);
      None: for "pipemare" 500 with an optimizer the rule is written for
      (momentum SGD, SpecTrain) and off with any other (Adam, ...: PipeMare's
      discrepancy correction still acts); else off (0). `summary()` says
      which is in force.
    batch_statistics: BatchNormalization with micro_batches > 1 normalises
      each micro-batch by its own statistics (as GPipe does), where Keras
      uses the mini-batch's: "warn" (default), "refuse", or "micro_batch"
      (accept silently). With micro_batches=1 it is Keras's.
    discrepancy_decay: "pipemare" only: the decay of the average weight
      change its backward corrects with, in [0, 1).
    executor: "compiled" (one `tf.function` per window of mini-batches runs
      every stage: TensorFlow overlaps the stages; `tfpipe.runtime.compiled`)
      or "threaded" (a Python thread per stage runs the schedule task by
      task: the reference, for debugging). The weights are the same. None:
      "compiled".
  """

  AUTO_WINDOW = 16
  AUTO_REMOTE_WINDOW = 64

  def __init__(self, model, devices=None, num_stages=None, method="spectrain",
               partition="uniform", spectrain_backward="reuse", version_difference="paper",
               micro_batches=None, recompute=None, lockstep=False, profile_batch_size=32,
               record=False, trace_steps=None, trace_dir=None, prediction_error=None,
               stage_replicas=None, jit_compile=None, executor=None, spike_compensation=False,
               delay_momentum=False, lr_rescheduling=None, discrepancy_decay=None,
               batch_statistics="warn"):
    if not isinstance(model, keras.Model):
      raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    overrides = compat.trainer_overrides(model)
    if overrides:
      raise ValueError(
          f"{type(model).__name__} overrides {', '.join(overrides)}: a pipeline runs Keras's "
          "own train step split over its stages, so it cannot run yours. Put the custom "
          "computation in a loss, a metric or a layer, or train with model.fit")
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
    self._set_mitigations(spike_compensation, delay_momentum, lr_rescheduling, discrepancy_decay)
    self._check_batch_statistics(batch_statistics)
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
    self.executor = names.lookup("executor", executor or "compiled", runtime.EXECUTORS)
    if jit_compile is None:
      jit_compile = all(tf.DeviceSpec.from_string(d).device_type == "GPU"
                        for d in self.devices) and not self.stage_replicas
    self.jit_compile = jit_compile
    if prediction_error is True:
      prediction_error = prediction_error_lib.PredictionError()
    if prediction_error not in (None, False) and not isinstance(
        prediction_error, prediction_error_lib.PredictionError):
      raise ValueError("`prediction_error` must be True or a tfpipe.instruments.prediction_error."
                       f"PredictionError. Received: {prediction_error!r}")
    self.prediction_error = prediction_error or None
    self._fit_epochs = None   # the last fit's (first runtime epoch, batches per epoch, initial_epoch)
    self.runtime = None

  def _set_mitigations(self, spike_compensation, delay_momentum, lr_rescheduling,
                       discrepancy_decay):
    for name, value in (("spike_compensation", spike_compensation),
                        ("delay_momentum", delay_momentum)):
      if value not in (True, False):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    self._default_rescheduling = lr_rescheduling is None and self.method == "pipemare"
    if lr_rescheduling is None:
      lr_rescheduling = mitigations.DEFAULT_LR_RESCHEDULING if self.method == "pipemare" else 0
    if (not isinstance(lr_rescheduling, int) or isinstance(lr_rescheduling, bool)
        or lr_rescheduling < 0):
      raise ValueError("`lr_rescheduling` must be a number of updates >= 0. Received: "
                       f"lr_rescheduling={lr_rescheduling!r}")
    if discrepancy_decay is not None and self.method != "pipemare":
      raise ValueError("`discrepancy_decay` is PipeMare's discrepancy correction (method="
                       f"'pipemare'). Received: method={self.method!r}")
    if discrepancy_decay is None:
      discrepancy_decay = mitigations.DEFAULT_DISCREPANCY_DECAY
    if (not isinstance(discrepancy_decay, (int, float)) or isinstance(discrepancy_decay, bool)
        or not 0 <= discrepancy_decay < 1):
      raise ValueError("`discrepancy_decay` must be in [0, 1). Received: "
                       f"discrepancy_decay={discrepancy_decay!r}")
    self.spike_compensation, self.delay_momentum = spike_compensation, delay_momentum
    self.lr_rescheduling, self.discrepancy_decay = lr_rescheduling, float(discrepancy_decay)

  def _check_batch_statistics(self, batch_statistics):
    """BatchNormalization with micro-batches normalises each micro-batch by its own statistics
    (as GPipe does), where Keras uses the mini-batch's: "warn" (default) says so, "refuse"
    refuses, "micro_batch" accepts it silently."""
    choice = names.lookup("batch_statistics", batch_statistics, ("warn", "refuse", "micro_batch"))
    found = [l.name for l in _all_layers(self.model)
             if isinstance(l, keras.layers.BatchNormalization)]
    if self.micro_batches == 1 or not found or choice == "micro_batch":
      return
    message = (f"BatchNormalization ({', '.join(found)}) with micro_batches={self.micro_batches} "
               "normalises per micro-batch (as GPipe does), not over the mini-batch as Keras "
               "does: training differs from Keras's. Pass batch_statistics='micro_batch' to "
               "accept it, or micro_batches=1")
    if choice == "refuse":
      raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)

  def _update_options(self):
    """The options in force that change a stage's update: [(name, value)]."""
    return [(n, v) for n, v in (("spike_compensation", self.spike_compensation),
                                ("delay_momentum", self.delay_momentum),
                                ("lr_rescheduling", self.lr_rescheduling)) if v]

  def _stage_rules(self, optimizer):
    """Per stage: the delay D_k of the schedule and the `mitigations.StageRule` of its updates;
    refuses options that cannot act (no delay, an optimizer their rule is not written for)."""
    delays = mitigations.delays_for(self.policy.schedule, self.num_stages, self.micro_batches)
    if self._default_rescheduling:   # pipemare's default: on where its rule is written
      try:
        mitigations.check_optimizer(optimizer, "lr_rescheduling")
        self.lr_rescheduling = mitigations.DEFAULT_LR_RESCHEDULING
      except ValueError:
        self.lr_rescheduling = 0
    chosen = [n for n, _ in self._update_options()]
    for name in chosen:
      mitigations.check_optimizer(optimizer, name)
    if chosen and not any(delays):
      raise ValueError(f"{chosen[0]} acts on delayed updates, and method {self.method!r} at "
                       f"{self.num_stages} stages delays none")
    decay = self.discrepancy_decay if self.policy.backward == "corrected" else None
    return delays, [mitigations.StageRule(d, self.spike_compensation, self.lr_rescheduling, decay)
                    for d in delays]

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
    """The verifier's report on the last schedule run (`tfpipe.plan.verify.Report`), or None."""
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
    (`tfpipe.instruments.breakdown`). Needs record=True."""
    if not self.record:
      raise RuntimeError("the breakdown reads the recorded timeline: build the Pipeline with "
                         "record=True")
    steps = trace.parse_steps(steps)
    records = self._fit_records()
    if not records and self.executor == "compiled" and self._remote():
      raise ValueError(
          "no recorded task: the compiled executor reads its timeline from this process's "
          f"profiler, and stages on TF servers ({', '.join(self._remote())}) run in other "
          "processes. Use executor='threaded' for their timeline")
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
    on = [n if v is True else f"{n}={v}" for n, v in self._update_options()]
    on += [f"discrepancy_decay={self.discrepancy_decay}"] if self.method == "pipemare" else []
    micro += f", {', '.join(on)}" if on else ""
    lines = [f"tfpipe.Pipeline: method={self.method}, {self.num_stages} stages{micro}"]
    for k, (devices, layers) in enumerate(zip(self.stage_devices, self.partition.layer_names)):
      where = devices[0] if len(devices) == 1 else f"{len(devices)} replicas on {', '.join(devices)}"
      lines.append(f"  stage {k} on {where}: {', '.join(layers)}")
    return "\n".join(lines)

  def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None,
              weighted_metrics=None, run_eagerly=False, steps_per_execution="auto",
              jit_compile="auto", auto_scale_loss=True):
    """`keras.Model.compile` for the pipeline: each stage gets its own copy of `optimizer`
    (same config, and its `exclude_from_weight_decay`), the last stage Keras's own loss and
    metric containers (`tfpipe.compile_utils.KerasStep`: `loss_weights`, `metrics` unweighted,
    `weighted_metrics` weighted, names and "accuracy" as Keras resolves them).

    `steps_per_execution` (the compiled executor): mini-batches per window, one
    `tf.function` call each, as in Keras: batch hooks run after each window,
    once per batch, and a stop takes effect at the window's end. "auto": one
    when a callback besides the progress bar has batch hooks, or the
    prediction error is recorded (hooks then see every batch as Keras's
    default does), else `AUTO_WINDOW` (`AUTO_REMOTE_WINDOW` with stages on TF servers).
    `run_eagerly=True` is refused (use `executor="threaded"` to step through tasks);
    `jit_compile` belongs to the Pipeline (`Pipeline(jit_compile=...)`). Optimizer options
    that decide over the whole model at once (`global_clipnorm`, `LossScaleOptimizer`) and
    a mixed_float16 model (Keras scales its loss) are refused by name.
    """
    if steps_per_execution != "auto" and (
        not isinstance(steps_per_execution, int) or isinstance(steps_per_execution, bool)
        or steps_per_execution < 1):
      raise ValueError("`steps_per_execution` must be a positive integer or 'auto'. Received: "
                       f"steps_per_execution={steps_per_execution!r}")
    if isinstance(loss_weights, (list, tuple)) and any(
        isinstance(w, (str, keras.metrics.Metric)) for w in loss_weights):
      raise ValueError(
          f"loss_weights={loss_weights!r} looks like metrics: compile's third argument is "
          "loss_weights, as in keras.Model.compile; pass metrics=[...] by name")
    if run_eagerly:
      raise ValueError("run_eagerly=True is not supported: a pipeline runs traced stage tasks. "
                       "To step through them in Python use Pipeline(executor='threaded')")
    if jit_compile != "auto":
      raise ValueError(f"jit_compile={jit_compile!r}: XLA is a Pipeline option "
                       "(Pipeline(..., jit_compile=True)), not a compile argument")
    if len(self.model.outputs) != 1:
      raise ValueError(
          f"tfpipe trains models with one output; {self.model.name!r} has "
          f"{len(self.model.outputs)} ({', '.join(self.model.output_names)}): multi-output "
          "models (and their lists or dicts of losses and metrics) are not supported")
    if auto_scale_loss and self.model.dtype_policy.name == "mixed_float16":
      raise ValueError(
          "a mixed_float16 model trains with loss scaling (Keras wraps its optimizer in a "
          "LossScaleOptimizer), which skips updates on an overflow anywhere in the model: not "
          "supported in a pipeline. Use the mixed_bfloat16 policy (no loss scaling) or float32")
    self.steps_per_execution = steps_per_execution
    optimizer = compile_utils.resolve_optimizer(optimizer)
    compile_utils.check_optimizer(optimizer)
    self.optimizer = optimizer
    self.step = compile_utils.KerasStep(self.model, loss, metrics, weighted_metrics, loss_weights,
                                        self.devices[-1])
    self.metrics = [self.step.metrics] if self.step.metrics is not None else []
    delays, rules = self._stage_rules(optimizer)
    programs = []
    for k, (sub, device) in enumerate(zip(self.partition.stages, self.devices)):
      last = k == self.num_stages - 1
      with tf.device(device):  # the optimizer's step counter and slots live with the stage
        stage_optimizer = compile_utils.clone_optimizer(optimizer)
      if self.delay_momentum:
        stage_optimizer.momentum = mitigations.delay_momentum(stage_optimizer.momentum, delays[k])
      programs.append(stage.StageProgram(
          k, self.num_stages, sub, device, stage_optimizer, self.policy,
          loss=self.step.loss if last else None, metrics=self.metrics if last else (),
          loss_tracker=self.step.loss_tracker if last else None, jit_compile=self.jit_compile,
          replica_devices=self.stage_devices[k], rule=rules[k],
          reg_trackers=[p.reg_tracker for p in programs if p.reg_tracker] if last else None,
          optimizer_source=optimizer))
    for p in programs:
      p.check_kept_tapes()
    self.programs = programs
    maxsize = max(self.num_stages, self.micro_batches)
    if self.executor == "compiled":
      self.runtime = runtime.CompiledRuntime(programs, window=self.AUTO_WINDOW,
                                             record=self.record, maxsize=maxsize)
    else:
      self.runtime = runtime.Runtime(programs, record=self.record, maxsize=maxsize)
    if self.prediction_error is not None:
      for p in programs:
        prediction_error_lib.check(p.optimizer)
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
    self.step.reset()
    for p in self.programs[:-1]:
      if p.reg_tracker is not None:
        p.reg_tracker.reset_state()

  def _metric_logs(self, prefix=""):
    return {prefix + k: float(v) for k, v in self.programs[-1].logs().items()}

  def _dataset(self, x, y=None, batch_size=None, steps=None, shuffle=False, seed=None,
               labels=True, sample_weight=None, class_weight=None):
    """(dataset, batch count) for `x`, checked against the model before any work."""
    names = data.input_names(self.model)
    dataset, num_batches = data.as_dataset(
        x, y, batch_size, steps, shuffle, seed, labels=labels, sample_weight=sample_weight,
        class_weight=class_weight, names=names)
    input_checks.check_inputs(dataset, self.model, names, labelled=labels)
    if labels:
      input_checks.check_labels(y, self.model, self.step.user_loss, dataset.element_spec[1])
      self.step.build(dataset.element_spec[1])
    return dataset, num_batches

  def _validation(self, validation_data, batch_size, validation_batch_size, validation_steps):
    """The validation dataset and its batch count, checked before training starts."""
    if isinstance(validation_data, (tuple, list)):
      val_x, val_y, val_w = keras.utils.unpack_x_y_sample_weight(tuple(validation_data))
    else:
      val_x, val_y, val_w = validation_data, None, None
    if isinstance(val_x, tf.data.Dataset):
      if validation_batch_size is not None:
        raise ValueError("`validation_batch_size` must be None when `validation_data` is a "
                         f"tf.data.Dataset (batch the dataset). Received: {validation_batch_size}")
      size = None
    else:
      size = validation_batch_size or batch_size
    return self._dataset(val_x, val_y, size, validation_steps, sample_weight=val_w)

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
          validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
          sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
          validation_batch_size=None, validation_freq=1, seed=None):
    """Trains epochs `initial_epoch` .. `epochs`-1; returns a `keras.callbacks.History`.

    Takes `keras.Model.fit`'s arguments with their meaning (plus `seed`, the
    shuffle seed of array data). Each epoch runs the method's schedule over
    its batches and drains at the end, so every batch's update lands in the
    epoch that drew it. Callbacks see Keras's hooks in Keras's order, in the
    caller's thread: `on_train_batch_begin(b)` when the caller starts waiting
    for batch b (with K stages up to K batches are in flight, so b may
    already be running), `on_train_batch_end(b, logs)` with the running loss
    and metrics once b's update is done; validation and `evaluate` send the
    `on_test_*` hooks. `model.optimizer` is the compiled optimizer, whose
    learning rate drives every stage (`tfpipe.learning_rate`).
    `model.stop_training = True` in a hook stops after that batch: exactly
    the L-1 batches already due finish their updates (`schedules.lead`: none
    for sequential and gpipe, K-1 for 1F1B and DDG; they count in the
    epoch's metrics and get no batch hooks).
    A `tfpipe.checkpoint.BackupAndRestore` among the callbacks saves the
    pipeline at epoch ends and, when it finds a checkpoint, resumes from it.
    """
    self._check_compiled()
    changed = [name for p in self.programs for name in p.trainable_changed()]
    if changed:
      raise ValueError(
          f"layer {changed[0]!r} changed `trainable` since `compile`"
          + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
          + ": call `compile` again so the stages train the new set of weights (Keras, too, "
          "takes a change of `trainable` at compile)")
    if not isinstance(epochs, int) or epochs < 1:
      raise ValueError(f"`epochs` must be a positive integer. Received: epochs={epochs!r}")
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch:
      raise ValueError(f"`initial_epoch` must be an integer >= 0. Received: {initial_epoch!r}")
    if not (isinstance(validation_freq, int) and validation_freq >= 1) and not isinstance(
        validation_freq, list):
      raise ValueError("`validation_freq` must be a positive integer or a list of epochs "
                       f"(1-based). Received: validation_freq={validation_freq!r}")
    if isinstance(batch_size, int) and batch_size < self.micro_batches:
      raise ValueError(
          f"`batch_size` must be at least micro_batches={self.micro_batches}. Received: "
          f"batch_size={batch_size}")
    most = max(self.stage_replicas.values(), default=1)
    if isinstance(batch_size, int) and batch_size // self.micro_batches < most:
      raise ValueError(
          f"a replicated stage splits each (micro-)batch over {most} devices: `batch_size` must "
          f"be at least {most * self.micro_batches}. Received: batch_size={batch_size}")
    if validation_split and validation_data is None:
      (x, y, sample_weight), validation_data = data.validation_split(
          x, y, sample_weight, validation_split)
    dataset, num_batches = self._dataset(x, y, batch_size, steps_per_epoch, shuffle, seed,
                                         sample_weight=sample_weight, class_weight=class_weight)
    validation = (self._validation(validation_data, batch_size, validation_batch_size,
                                   validation_steps) if validation_data is not None else None)
    schedule = schedules.build(self.policy.schedule, self.num_stages, num_batches,
                               self.micro_batches)
    diffs = policies.version_differences(self.policy, schedule, self.version_difference)
    verbose = 1 if verbose == "auto" else verbose
    callbacks = [checkpoint_lib.BackupAndRestore.from_keras(cb)
                 if isinstance(cb, keras.callbacks.BackupAndRestore) else cb
                 for cb in callbacks or []]
    with learning_rate.driving(self.model, self.optimizer, self.metrics):
      cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                         model=self.model, verbose=verbose, epochs=epochs,
                                         steps=num_batches)
      self._load_weights()
      initial_epoch = max(initial_epoch, self._restore(callbacks))
      link = learning_rate.LearningRateLink(self.optimizer, [p.optimizer for p in self.programs],
                                            lambda: self.runtime.updates[-1])
      try:
        with link:
          return self._fit_epochs_loop(
              dataset, num_batches, schedule, diffs, cbs, link, epochs, initial_epoch,
              steps_per_epoch, validation, validation_freq)
      except tf.errors.OpError as e:   # a stage's task died: name it when it is a lost server
        lost = cluster.describe_lost(e, self._remote()) if self._remote() else None
        if lost is None:
          raise
        raise lost from e

  @staticmethod
  def _should_validate(epoch, validation_freq):
    if isinstance(validation_freq, int):
      return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq

  def _fit_epochs_loop(self, dataset, num_batches, schedule, diffs, cbs, link, epochs,
                       initial_epoch, steps_per_epoch, validation, validation_freq):
    def hook(name, *args):
      link.sync()
      getattr(cbs, name)(*args)
      link.push()

    # Batch hooks: the learning-rate link runs around them only when a callback besides the
    # progress bar has batch hooks (that eager work in the caller thread slows the stage
    # threads: 7% of a tiny model's throughput, measured); logs become floats only if read.
    batch_readers = [cb for cb in cbs.callbacks if _has_batch_hooks(cb)]
    linked = any(not isinstance(cb, keras.callbacks.ProgbarLogger) for cb in batch_readers)
    self._choose_window(linked or _reads_batches(cbs, "test"))

    def batch_hook(name, *args):
      if linked:
        hook(name, *args)
      elif batch_readers:
        getattr(cbs, name)(*args)

    self.model.stop_training = False
    self._fit_epochs = (self.runtime.epoch + 1, num_batches, initial_epoch)
    profiled = isinstance(self.runtime, runtime.CompiledRuntime)  # the runtime runs the profiler
    tracer = (trace.StepTracer(self.trace_dir, self.trace_steps)
              if self.trace_steps is not None and not profiled else None)
    if tracer:
      tracer.begin(initial_epoch * num_batches)
    hook("on_train_begin")
    logs = {}
    try:
      iterator = self._replay_data(dataset, initial_epoch, steps_per_epoch, num_batches)
      for epoch in range(initial_epoch, epochs):
        if steps_per_epoch is None or iterator is None:
          iterator = iter(dataset)
        self._reset_metrics()
        if profiled and self.trace_steps is not None:   # its profile of the traced epochs
          first, last = self.trace_steps
          traced = epoch * num_batches <= last and (epoch + 1) * num_batches > first
          self.runtime.profile_dir = self.trace_dir if traced else None
        hook("on_epoch_begin", epoch)
        start = time.perf_counter()
        stopping = []

        def before(b):
          if not stopping:
            batch_hook("on_train_batch_begin", b)

        def on_result(b, loss, batch_logs, epoch=epoch):
          if tracer:
            tracer.on_step_end(epoch * num_batches + b)
          if stopping:
            return True   # drained after a stop: trained, no hooks
          if batch_readers:
            batch_hook("on_train_batch_end", b, {k: float(v) for k, v in batch_logs.items()})
          if self.model.stop_training:
            stopping.append(b)
          return bool(stopping)

        try:
          self.runtime.train_epoch(schedule, diffs, iterator, num_batches, on_result, before)
        except runtime.OutOfData:
          raise ValueError(
              f"the data ran out before {num_batches} batches in epoch {epoch}; give a "
              "`steps_per_epoch` the data can fill, or repeat the dataset") from None
        seconds = time.perf_counter() - start
        logs = self._metric_logs()
        samples = float(self.step.loss_tracker.count.numpy())
        logs["samples_per_second"] = samples / seconds if seconds > 0 else 0.0
        for p in self.programs:
          p.write_to_model()
        if validation is not None and self._should_validate(epoch, validation_freq):
          logs.update(self._evaluate(*validation, cbs, prefix="val_"))
        hook("on_epoch_end", epoch, logs)
        if self.model.stop_training:
          break
    finally:
      if tracer:
        tracer.end()
    self._finalize_weights()
    if self.trace_steps is not None:
      trace.write_chrome_trace(os.path.join(self.trace_dir, trace.TRACE_FILE),
                               self._fit_records(), self.devices, num_batches, self.trace_steps)
    hook("on_train_end", logs)
    return self.model.history

  def _finalize_weights(self):
    """What Keras's `fit` does at its end: each optimizer's `finalize_variable_values`
    (with `use_ema`, the weights become their moving average), then into the model."""
    if any(p.optimizer.use_ema for p in self.programs):
      for p in self.programs:
        p.finalize()
        p.write_to_model()

  def _choose_window(self, batch_hooks):
    """The compiled executor's window for this call (see `compile`)."""
    if isinstance(self.runtime, runtime.CompiledRuntime):
      window = self.steps_per_execution
      if window == "auto":
        window = (1 if batch_hooks or self.prediction_error is not None else
                  self.AUTO_REMOTE_WINDOW if self._remote() else self.AUTO_WINDOW)
      elif window > 1 and self.prediction_error is not None:
        raise ValueError(
            "the prediction error compares weights update by update, and a compiled window of "
            f"{window} mini-batches updates several times per call: use steps_per_execution=1 "
            "(or 'auto') with prediction_error")
      self.runtime.set_window(window)

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

  def _evaluate(self, dataset, num_batches, cbs, prefix=""):
    """Loss and metrics over `dataset`, with the `on_test_*` hooks (validation, evaluate)."""
    self._reset_metrics()
    cbs.on_test_begin()
    self.runtime.infer_epoch(
        iter(dataset), num_batches,
        lambda b, logs: cbs.on_test_batch_end(b, {k: float(v) for k, v in logs.items()}),
        with_labels=True, before=cbs.on_test_batch_begin)
    logs = self._metric_logs()
    cbs.on_test_end(logs)
    return {prefix + k: v for k, v in logs.items()}

  def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
               steps=None, callbacks=None, return_dict=False):
    """Loss and metrics over the data with the current weights, pipelined forward only
    (`keras.Model.evaluate`'s arguments and return value)."""
    self._check_compiled()
    dataset, num_batches = self._dataset(x, y, batch_size, steps, sample_weight=sample_weight)
    self._load_weights()
    verbose = 1 if verbose == "auto" else verbose
    with learning_rate.driving(self.model, self.optimizer, self.metrics):
      cbs = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, model=self.model,
                                         verbose=verbose, epochs=1, steps=num_batches)
      self._choose_window(_reads_batches(cbs, "test"))
      logs = self._evaluate(dataset, num_batches, cbs)
    return logs if return_dict else (list(logs.values()) if len(logs) > 1 else logs["loss"])

  def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """The model's outputs for `x` (arrays or a dataset of inputs), as a numpy array, with the
    `on_predict_*` hooks (`keras.Model.predict`'s arguments)."""
    self._check_compiled()
    if isinstance(x, tf.data.Dataset) and isinstance(x.element_spec, tuple):
      x = x.map(lambda *element: element[0])   # Keras: a tuple element is (x, y, sample_weight)
    dataset, num_batches = self._dataset(x, None, batch_size, steps, labels=False)
    self._load_weights()
    verbose = 1 if verbose == "auto" else verbose
    outputs = {}
    with learning_rate.driving(self.model, self.optimizer, self.metrics):
      cbs = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, model=self.model,
                                         verbose=verbose, epochs=1, steps=num_batches)
      cbs.on_predict_begin()
      self._choose_window(_reads_batches(cbs, "predict"))

      def on_result(b, ys):
        outputs[b] = ys[0].numpy()
        cbs.on_predict_batch_end(b, {"outputs": outputs[b]})

      self.runtime.infer_epoch(iter(dataset), num_batches, on_result, with_labels=False,
                               before=cbs.on_predict_batch_begin)
      cbs.on_predict_end()
    return np.concatenate([outputs[b] for b in range(num_batches)], axis=0)
