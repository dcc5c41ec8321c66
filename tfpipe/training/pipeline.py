"""Pipeline: train one Keras model split into stages over several devices, Keras-style.

K: stages. `Pipeline(model, ...)` cuts the model, `compile` gives every stage
its own optimizer (built from the user's config) on its device, and
`fit`/`evaluate`/`predict` run the schedule of the chosen method. After
`fit` the trained weights are in the user's model. This module is the face:
the options live in `tfpipe.training.options`, `compile`'s work in `tfpipe.training.assemble`,
the data in `tfpipe.training.fit_data`, a fit's set-up in `tfpipe.training.fitting`, the
epoch loop in `tfpipe.training.fit_loop`, `method="auto"` in `tfpipe.training.chooser`.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import keras
import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe.instruments import prediction_error as prediction_error_lib
from tfpipe.plan import policies
from tfpipe.plan.auto import AUTO
from tfpipe.stage import keras_step as compile_utils, partition as partition_lib, reduction
from tfpipe.training import assemble, auto as auto_lib, chooser, fit_loop, fitting, footprint
from tfpipe.training import layer_profile, memory_budget as memory_budget_lib
from tfpipe.training import options as options_lib, placement, restarts, summary as summary_lib

__all__ = ["Pipeline"]


_UNSET = object()   # a `compile` argument left out


class Pipeline:
  """A Keras model trained with pipelined model parallelism.

  AUTO_WINDOW: mini-batches per compiled window when `steps_per_execution` is "auto" and
  nothing reads every batch; AUTO_REMOTE_WINDOW when a stage is on a TF server, where each
  window call pays remote calls.

  Args:
    model: a built Sequential or functional Keras model.
    devices: one device string per stage (local or remote); or None with `num_stages` to take the
      first K local GPUs (else logical CPUs).
    num_stages: K, when `devices` is None.
    stage_replicas: {stage: R} (or ["0:2"]): hybrid parallelism: stage k runs data parallel on
      the next R of `devices`, its batch split over them and their gradients summed (as the
      SpecTrain paper does for VGG16's slow first stage). Works with every method.
    cross_device_ops: how a replicated stage sums its replicas' gradients: "ring" (each replica
      keeps its own copy of the weights and optimizer state; a ring all-reduce of the gradients;
      synchronous schedules), a tf.distribute.CrossDeviceOps, or "reduce_to_one_device",
      "hierarchical_copy", "nccl". None: "ring" where a synchronous stage's replicas are on
      different hosts and hold no tied weight, else MirroredStrategy's choice.
    virtual_stages: V for "interleaved" (default 2; "zbv": 2 only): the model is cut into V x K
      stages (interleaved: stage s on device s mod K, micro_batches a multiple of K); `num_stages`
      and `devices` count devices.
    data_parallel: R replicas of the whole pipeline (as Megatron and DeepSpeed run them) on R x K
      devices, given replica by replica: each takes 1/R of every (micro-)batch, and each stage's
      gradients are summed over its replicas by `cross_device_ops` before its one update. Equals
      the method at the global batch; not with stage_replicas, "timeprest" or "i_timeprest".
    method: one of `tfpipe.PIPELINE_METHODS`: "sequential", "gpipe", "1f1b" (1F1B with a flush:
      GPipe's result and bubble, at most K-k micro-batches kept at stage k), "interleaved"
      (interleaved 1F1B: `virtual_stages` V model chunks per device, K x V stages, the bubble V
      times smaller), "zbv" (zero-bubble ZB-V: two stages per device in a V, device d holding
      stages d and 2K-1-d, backwards split as "zb"'s), "zb" (zero-bubble ZB-H1: backwards split
      into input and weight halves, the weight halves filling the bubble), "vanilla", "pipedream",
      "spectrain", "ddg", "feature_replay", "timeprest" (docs/methods.md), "pipemare" (vanilla's
      schedule, the backward on weights corrected back to the forward's, PipeMare) or
      "i_timeprest" (TiMePReSt's schedule, the backward on a blend of the forward's and the
      current weights); see `tfpipe.rules.mitigations`. "auto": chosen at the first `fit` for this
      model, these devices, batch size and optimizer, by the least predicted time to accuracy
      over that fit's epochs, from a profile of its first batch or, where only the synchronous
      schedules can win, a probe (1f1b, M=2) training from the first batch
      (`tfpipe.training.chooser`; docs/which-method.md): `fit` prints the choice in a line,
      `plan_report()` lists the candidates. It chooses `micro_batches`, `virtual_stages`,
      `nesterov`, `version_difference` and `advice`, so those must be left unset. "spectrain"
      predicts with the step of the optimizer it is compiled with (`tfpipe.rules.prediction`).
    partition: "uniform", "params", "profile", explicit cut positions [0, ..., number of layers]
      (the layer calls in the order the model runs them; a mask Keras adds is not counted), or the
      names of the layers that start stages 1..K-1 (layers of a nested backbone count; see
      `tfpipe.stage.partition.partition`). A nested functional model (a KerasHub task's backbone)
      is cut through; a layer called on several stages (a tied embedding) trains as one weight on
      the synchronous schedules and is refused on the asynchronous ones.
    spectrain_backward: "reuse" (the backward reads the forward's predicted weights, no
      recomputation) or "repredict" (a new prediction with the backward's version difference; in
      TensorFlow this recomputes the stage from its saved input: one extra forward per backward).
    version_difference: "paper" (the SpecTrain paper's eq. 5-6) or "exact" (counted from the
      schedule). None: "paper" ("exact" with micro-batches).
    micro_batches: M, micro-batches per mini-batch: for "gpipe", "1f1b", "zb" and "timeprest"
      (default 4), and for "vanilla", "pipedream" and "spectrain" (default 1), whose stages then
      accumulate the M gradients and update once per mini-batch (SpecTrain needs
      version_difference="exact").
    advice: False (default): the method runs its paper's rule with the options passed and nothing
      else. True: the options left None (`micro_batches`, `version_difference`,
      `spike_compensation`, `nesterov`, `delay_compensation`) take, at `compile`, what
      `tfpipe.rules.advice` measured best for the optimizer (for "spectrain": from 4 stages M = K
      micro-batches with Adam, 2K with momentum SGD, so a prediction spans at most one update,
      plus Nesterov's step; at K=2 Nesterov's step). It trades speed for accuracy (more, smaller
      micro-batches); `summary()` names what was advised. A value passed is always kept.
    memory_budget: each device's memory, in bytes or as "3g", "512MiB". At the first fit (batch
      size and input shapes known) every stage's peak is predicted (`memory()`); where a device's
      stages are over the budget, the partition strategy's fastest cuts among those that fit are
      taken and the pipeline is compiled on them (a line says so), or the fit is refused in one
      line naming the stage and its predicted peak (also for cuts you named, which never move).
    recompute: keep only stage inputs and recompute the forward before the backward (the
      synchronous methods); None takes the method's rule.
    lockstep: "ddg" and "feature_replay" only: every step ends with a barrier on all stages, as
      the DDG paper runs them (same weights, other timing).
    profile_batch_size: the batch size at which "profile" measures layers.
    record: keep a `TaskRecord` of every task and transfer in `self.records` (what `breakdown()`
      reads; the compiled executor reads them from a `tf.profiler` profile of each epoch of this
      process's devices, which slows the run).
    trace_dir: where `trace_steps` writes its traces.
    trace_steps: (first, last) or "first,last": steps of each `fit` (counted from 0 over its
      epochs) to trace into `trace_dir`: a TensorBoard profile of the device ops (`tf.profiler`;
      with the compiled executor, of the whole epochs holding those steps) and
      `tfpipe_trace.json`, the runtime's tasks as Chrome trace events (Perfetto). Turns `record`
      on.
    prediction_error: a `tfpipe.instruments.prediction_error.PredictionError` (or True for one
      with s = 1, 2, 3) fed after every stage update: the RMSE of the predicted and of the stale
      weights to the weights reached s updates later (SpecTrain fig. 8), predicting along the
      optimizer's own step (`tfpipe.rules.prediction`: SpecTrain, momentum SGD, Adam, AdamW);
      costs a copy of the stage's weights per update. Kept in `self.prediction_error`.
    jit_compile: compile each stage task with XLA. None: on when every stage is on a GPU (as
      Keras's `jit_compile="auto"`), off otherwise.
    spike_compensation: Kosson et al.'s spike compensation: each stage's update gives its delayed
      gradient the momentum it missed at once (`tfpipe.rules.mitigations`; momentum SGD or
      SpecTrain).
    delay_momentum: each stage runs with momentum max(0, gamma - D/(D+1)) for its delay D
      (asynchrony acts as momentum, Mitliagkas et al. 2016).
    lr_rescheduling: PipeMare's learning-rate rescheduling over this many updates (a stage with
      delay D starts at 1/D); None: 500 for "pipemare" with momentum SGD or SpecTrain, else off
      (0). `summary()` says which is in force.
    nesterov: every stage's update looks ahead along its momentum (Nesterov's step; with
      "pipedream", Ajanthan et al. 2025's method; momentum SGD, SpecTrain, or Adam without
      amsgrad: NAdam's step).
    delay_compensation: DC-ASGD's lambda (0: off): a gradient taken at the forward's weights is
      moved to the current ones, g + lam*g*g*(W - W_read) (methods whose backward reads the
      forward's weights).
    batch_statistics: BatchNormalization with micro_batches > 1 normalises each micro-batch by its
      own statistics (as GPipe does), where Keras uses the mini-batch's: "warn" (default),
      "refuse", or "micro_batch" (accept silently). With micro_batches=1 it is Keras's.
    discrepancy_decay: "pipemare" only: the decay of the average weight change its backward
      corrects with, in [0, 1).
    executor: "compiled" (one `tf.function` per window of mini-batches runs every stage:
      TensorFlow overlaps the stages; `tfpipe.runtime.compiled`) or "threaded" (a Python thread
      per stage runs the schedule task by task: the reference, for debugging). The weights are the
      same. None: "compiled".
  """

  AUTO_WINDOW = 16
  AUTO_REMOTE_WINDOW = 64

  def __init__(
      self, model: keras.Model, devices: Optional[Sequence[str]] = None,
      num_stages: Optional[int] = None, method: str = "spectrain",
      partition: Union[str, Sequence[int], Sequence[str]] = "uniform",
      spectrain_backward: str = "reuse", version_difference: Optional[str] = None,
      micro_batches: Optional[int] = None, recompute: Optional[bool] = None,
      lockstep: bool = False, profile_batch_size: int = 32, record: bool = False,
      trace_steps: Union[Tuple[int, int], str, None] = None, trace_dir: Optional[str] = None,
      prediction_error: Union[prediction_error_lib.PredictionError, bool, None] = None,
      stage_replicas: Union[Mapping[int, int], Sequence[str], None] = None,
      jit_compile: Optional[bool] = None, executor: Optional[str] = None,
      spike_compensation: Optional[bool] = None, delay_momentum: bool = False,
      lr_rescheduling: Optional[int] = None, discrepancy_decay: Optional[float] = None,
      batch_statistics: str = "warn", data_parallel: int = 1,
      virtual_stages: Optional[int] = None, nesterov: Optional[bool] = None,
      delay_compensation: Optional[float] = None,
      cross_device_ops: Union[tf.distribute.CrossDeviceOps, str, None] = None,
      advice: bool = False, memory_budget: Union[int, str, None] = None):
    self.model = assemble.checked_model(model)
    asked = options_lib.Asked(
        method=method, spectrain_backward=spectrain_backward,
        version_difference=version_difference, micro_batches=micro_batches, recompute=recompute,
        lockstep=lockstep, record=record, trace_steps=trace_steps, trace_dir=trace_dir,
        prediction_error=prediction_error, executor=executor,
        spike_compensation=spike_compensation, delay_momentum=delay_momentum,
        lr_rescheduling=lr_rescheduling, discrepancy_decay=discrepancy_decay,
        batch_statistics=batch_statistics, virtual_stages=virtual_stages, nesterov=nesterov,
        delay_compensation=delay_compensation, advice=advice)
    # method="auto": the chooser (`auto.Chooser`), the pipeline built as its probe until then
    self.auto = chooser.Chooser(asked) if method == AUTO else None
    self.asked = self.auto.probe_options if self.auto is not None else asked
    policy = options_lib.policy_of(self.asked)
    reduction.check(cross_device_ops)
    self.cross_device_ops = cross_device_ops
    where = placement.place(devices, num_stages, policy, stage_replicas, data_parallel)
    self.stage_devices, self.stage_replicas, self.data_parallel = where
    self.devices = [d[0] for d in self.stage_devices]   # where each stage's variables live
    self.num_stages = len(self.devices)
    self.options = options_lib.checked(self.asked, model, self.num_stages)
    profiler = None
    if partition == "profile":
      profiler = layer_profile.Profiler(profile_batch_size, self.devices[0])
    self.partition = partition_lib.partition(
        model, self.num_stages, partition, profile=profiler, recompute=self.policy.recompute)
    self.memory_budget = memory_budget_lib.parse(memory_budget)
    self._cuts_asked = not isinstance(partition, str)   # the user's own cuts: never moved
    self._budget_checked = None   # (batch size, input shapes) the budget was checked at
    partition_lib.check_shared(model, self.partition, self.method, policies.SYNCHRONOUS_METHODS)
    self.jit_compile = placement.default_jit_compile(where) if jit_compile is None else jit_compile
    self.fit_epochs = None   # the last fit's first runtime epoch, batches an epoch, initial_epoch
    self.batch_size = None   # the last fit's mini-batch size, where known (`describe`)
    self.input_shapes = None   # the last fit's input shapes (`memory`)
    self.runtime = None

  policy = property(lambda self: self.options.policy, doc="The method's weight policy.")
  method = property(lambda self: self.options.method, doc="The pipeline method.")
  micro_batches = property(lambda self: self.options.micro_batches, doc="M.")
  executor = property(lambda self: self.options.executor, doc='"compiled" or "threaded".')
  record = property(lambda self: self.options.record, doc="Whether tasks are recorded.")
  prediction_error = property(lambda self: self.options.prediction_error,
                              doc="The `PredictionError` fed after updates, or None.")

  def remote_stages(self) -> List[str]:
    """The devices of stages on TF servers (empty: every stage in this process)."""
    return devices_lib.remote(self.stage_devices)

  @property
  def stage_models(self):
    return self.partition.stages

  @property
  def schedule_report(self):
    """The verifier's report on the last schedule run (`tfpipe.plan.verify.Report`), or None."""
    return self.runtime.report if self.runtime else None

  @property
  def loss_scale(self):
    """The dynamic loss scale (float) where training scales the loss (a LossScaleOptimizer,
    or a mixed_float16 model: `tfpipe.rules.joint`), else None."""
    decision = self.programs[0].updates.joint if getattr(self, "programs", None) else None
    if decision is None or decision.scaling is None:
      return None
    return float(decision.scale.numpy())

  @property
  def records(self):
    return self.runtime.records if self.runtime else []

  def breakdown(self, steps=None):
    """Per-stage shares of wall time training the last `fit`'s epochs (validation left out), or
    its `steps` ("first,last"): compute, transfer, idle_transfer, idle_imbalance
    (`tfpipe.instruments.breakdown`). Needs record=True."""
    return fit_loop.breakdown(self, steps)

  @property
  def num_devices(self) -> int:
    """The devices the stages' variables live on (fewer than the stages with V > 1)."""
    return len(set(self.devices))

  @property
  def choosing(self) -> bool:
    """Whether method="auto" has yet to choose (at the first fit)."""
    return self.auto is not None and self.auto.choosing

  @property
  def chosen(self) -> Optional[auto_lib.Choice]:
    """What method="auto" chose (`tfpipe.training.auto.Choice`), or None."""
    return self.auto.chosen if self.auto is not None else None

  def describe(self) -> str:
    """The summary's first line: the method, stages, devices and options in force."""
    if self.choosing:
      return (f"method=auto (chosen at the first fit, from its probe's speed or a profile of "
              f"its first batch: the least predicted time to accuracy), {self.num_stages} stages")
    line = self.options.describe(self.num_stages, self.num_devices, self.batch_size)
    return line + ("; chosen by method='auto'" if self.chosen is not None else "")

  def plan_report(self, print_fn: Optional[Callable[[str], Any]] = None) -> None:
    """Prints what `method="auto"` weighed at the first fit: each candidate's predicted
    samples/s, its epochs to accuracy relative to synchronous training, its predicted time
    to accuracy against the chosen one's, and why a candidate is out; then the chosen
    pipeline's predicted peak memory per stage (`memory`)."""
    for line in summary_lib.plan_lines(self):
      (print_fn or print)(line)

  def check_memory_budget(self, verbose: Union[str, int] = 0) -> None:
    """With a `memory_budget`, at the last fit's batch size and input shapes (`fit` checks
    before it trains): cuts whose every device's predicted peak fits, compiled again where
    they move (`tfpipe.training.memory_budget.recut`)."""
    key = (self.batch_size, tuple(self.input_shapes or ()))
    if self.memory_budget is None or self.batch_size is None or key == self._budget_checked:
      return
    kept = ("these cuts are yours" if self._cuts_asked else
            "the pipeline has trained on these cuts" if self.fit_epochs is not None else None)
    memory_budget_lib.recut(self, kept, verbose)
    self._budget_checked = key

  def memory(self, batch_size: Optional[int] = None,
             input_shapes: Optional[Sequence[Sequence[Optional[int]]]] = None) -> List[dict]:
    """Each stage's memory predicted before training at `batch_size` (default: the last
    fit's), as a list of {field: bytes} with its "total" (`tfpipe.training.footprint.predict`:
    weights, optimizer slots, gradient accumulators, kept weight versions, kept activations,
    a step's gradients and temporaries, the runtime). `input_shapes`: the inputs' shapes,
    batch axis first, where the model leaves a dimension unknown (default: the last fit's).
    Needs `compile`."""
    batch_size = self.batch_size if batch_size is None else batch_size
    return footprint.predict(self, batch_size, input_shapes or self.input_shapes)

  def summary(self, print_fn: Optional[Callable[[str], Any]] = None) -> None:
    """Prints a table of the stages as `keras.Model.summary()` prints the layers: each
    stage's devices, layers and parameters, then the model's totals. `print_fn`: called with
    each line (default `print`). Its first line says what runs in plain words; the size of
    a micro-batch once the batch size is known (`batch_size`: the last `fit`'s, or set)."""
    for line in summary_lib.lines(self):
      (print_fn or print)(line)

  def compile(self, optimizer: Any = _UNSET, loss: Any = _UNSET, loss_weights: Any = _UNSET,
              metrics: Any = _UNSET, weighted_metrics: Any = _UNSET, run_eagerly: bool = False,
              steps_per_execution: Union[int, str] = "auto",
              jit_compile: Union[bool, str] = "auto", auto_scale_loss: bool = True,
              **model_arguments: Any) -> None:
    """`keras.Model.compile` for the pipeline: each stage gets its own copy of `optimizer` (same
    config, and its `exclude_from_weight_decay`), the last stage Keras's own loss and metric
    containers (`tfpipe.stage.keras_step.KerasStep`: `loss_weights`, `metrics` unweighted,
    `weighted_metrics` weighted, names and "accuracy" as Keras resolves them).

    `steps_per_execution` (the compiled executor): mini-batches per window, one `tf.function` call
    each, as in Keras: batch hooks run after each window, once per batch, and a stop takes effect
    at the window's end. "auto": one when a callback besides the progress bar has batch hooks, or
    the prediction error is recorded (hooks then see every batch as Keras's default does), else
    `AUTO_WINDOW` (`AUTO_REMOTE_WINDOW` with stages on TF servers). Training windows end on
    multiples of the window when a callback besides the progress bar reads batch hooks.
    `run_eagerly=True` is refused (use
    `executor="threaded"` to step through tasks); `jit_compile` belongs to the Pipeline
    (`Pipeline(jit_compile=...)`). Optimizer options that decide over the whole model at once:
    `global_clipnorm` is decided once per mini-batch over every stage's gradient on the
    synchronous schedules (`tfpipe.rules.joint`) and refused by name on the asynchronous ones; so
    is loss scaling (`LossScaleOptimizer`, or a mixed_float16 model with `auto_scale_loss`, which
    Keras wraps in one): one scale for the whole pipeline, a step skipped on every stage when any
    stage's gradient is not finite (`loss_scale` reads the scale). The optimizer, loss and metrics
    left out are Keras's defaults ("rmsprop", none), or where the model's class has a `compile` of
    its own (a KerasHub task) its defaults: the model's own `compile` resolves the arguments, as
    `model.compile` would; arguments of its own (a causal LM's `sampler`) go to it.
    """
    given = {name: value for name, value in (
        ("optimizer", optimizer), ("loss", loss), ("loss_weights", loss_weights),
        ("metrics", metrics), ("weighted_metrics", weighted_metrics)) if value is not _UNSET}
    resolved = assemble.compile_arguments(self.model, given, model_arguments)
    optimizer, loss, loss_weights = (resolved[n] for n in ("optimizer", "loss", "loss_weights"))
    metrics, weighted_metrics = resolved["metrics"], resolved["weighted_metrics"]
    assemble.check_compile_arguments(self.model, loss_weights, run_eagerly, steps_per_execution,
                                     jit_compile, auto_scale_loss)
    self.steps_per_execution = steps_per_execution
    optimizer, inner, scaling = assemble.optimizers(self.model, optimizer, auto_scale_loss,
                                                    self.method)
    self.optimizer = optimizer   # `model.optimizer` during fit, as Keras's compile leaves it
    self.inner_optimizer = inner   # the optimizer without loss scaling
    self._compile_arguments = dict(given, run_eagerly=run_eagerly,
                                   steps_per_execution=steps_per_execution,
                                   jit_compile=jit_compile, auto_scale_loss=auto_scale_loss,
                                   **model_arguments)
    self.step = compile_utils.KerasStep(self.model, loss, metrics, weighted_metrics, loss_weights,
                                        self.devices[-1])
    self.metrics = [self.step.metrics] if self.step.metrics is not None else []
    self.options, _, rules = options_lib.resolved(self.options, self.asked, self.model, inner,
                                                  self.num_stages)
    self.programs = assemble.programs(self, self.options, rules, inner, self.step,
                                      scaling and scaling[1:])
    self.runtime = assemble.executor(self, self.programs, self.AUTO_WINDOW)

  def _check_compiled(self):
    if self.runtime is None:
      raise RuntimeError("call `compile(optimizer, loss, metrics)` before fit/evaluate/predict")

  def _load_weights(self):
    """Takes the user model's current weights (it may have changed since the last call)."""
    fitting.load_weights(self)

  def fit(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None, epochs: int = 1,
          verbose: Union[str, int] = "auto",
          callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
          validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
          class_weight: Optional[Mapping[int, float]] = None, sample_weight: Any = None,
          initial_epoch: int = 0, steps_per_epoch: Optional[int] = None,
          validation_steps: Optional[int] = None, validation_batch_size: Optional[int] = None,
          validation_freq: int = 1, seed: Optional[int] = None, max_restarts: int = 0,
          restart_timeout: float = 120.0) -> keras.callbacks.History:
    """Trains epochs `initial_epoch` .. `epochs`-1; returns a `keras.callbacks.History`.

    Takes `keras.Model.fit`'s arguments with their meaning (plus `seed`, the shuffle seed of array
    data). Each epoch runs the method's schedule over its batches and drains at the end, so every
    batch's update lands in the epoch that drew it. Callbacks see Keras's hooks in Keras's order,
    in the caller's thread: `on_train_batch_begin(b)` when the caller starts waiting for batch b
    (with K stages up to K batches are in flight, so b may already be running),
    `on_train_batch_end(b, logs)` with the running loss and metrics once b's update is done;
    validation and `evaluate` send the `on_test_*` hooks. `model.optimizer` is the compiled
    optimizer, whose learning rate drives every stage (`tfpipe.training.learning_rate`).
    `model.stop_training = True` in a hook stops after that batch: exactly the L-1 batches already
    due finish their updates (`schedules.lead`: none for sequential and gpipe, K-1 for 1F1B and
    DDG; they count in the epoch's metrics and get no batch hooks). A
    `tfpipe.checkpoint.BackupAndRestore` among the callbacks saves the pipeline at epoch ends and,
    when it finds a checkpoint, resumes from it. `max_restarts`: with stages on TF servers, a lost
    task (`cluster.WorkerLost`) is brought back up to this many times
    (`tfpipe.training.restarts`): a server this process started starts again, another is waited
    for up to `restart_timeout` seconds; the stages are built again and `fit` resumes from the
    newest checkpoint. Each restart is logged in one line and listed in the History's `restarts`.
    `x` may also be a function that builds the data (`y` None): it is called for each attempt, so
    a dataset that reshuffles each iteration replays an uninterrupted run's order after a restart.
    """
    self._check_compiled()
    restarts.check(max_restarts, restart_timeout, callbacks, x, y)
    return restarts.fit(self, lambda: fitting.fit_once(
        self, restarts.made(x), y, batch_size, epochs, verbose, callbacks, validation_split,
        validation_data, shuffle, class_weight, sample_weight, initial_epoch, steps_per_epoch,
        validation_steps, validation_batch_size, validation_freq, seed), max_restarts,
        restart_timeout, callbacks)

  def recompile(self) -> None:
    """Builds the stages again as last compiled (new variables on their devices: after a lost
    task's server started again), the user's model's weights loaded at the next fit."""
    self.compile(**self._compile_arguments)

  def evaluate(self, x: Any = None, y: Any = None, batch_size: Optional[int] = None,
               verbose: Union[str, int] = "auto", sample_weight: Any = None,
               steps: Optional[int] = None,
               callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
               return_dict: bool = False) -> Union[float, List[float], Dict[str, float]]:
    """Loss and metrics over the data with the current weights, pipelined forward only
    (`keras.Model.evaluate`'s arguments and return value)."""
    self._check_compiled()
    logs = fitting.evaluate(self, x, y, batch_size, verbose, sample_weight, steps, callbacks)
    return logs if return_dict else (list(logs.values()) if len(logs) > 1 else logs["loss"])

  def predict(self, x: Any, batch_size: Optional[int] = None, verbose: Union[str, int] = "auto",
              steps: Optional[int] = None,
              callbacks: Optional[Sequence[keras.callbacks.Callback]] = None) -> Any:
    """The model's outputs for `x` (arrays or a dataset of inputs), as a numpy array, with the
    `on_predict_*` hooks (`keras.Model.predict`'s arguments)."""
    self._check_compiled()
    return fitting.predict(self, x, batch_size, verbose, steps, callbacks)
