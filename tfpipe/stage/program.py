"""Stage programs: one stage's weights, optimizer and compiled task functions.

k: stage index, K: stages, s: version difference. Each stage owns copies of
its sub-model's variables placed on its device, and its own optimizer. Task
functions read the weights explicitly through `keras.Model.stateless_call`,
so current, stashed and predicted weights all run the same compiled code.
"""

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfpipe import compat, devices as devices_lib
from tfpipe.plan import policies, tasks
from tfpipe.rules import mitigations, prediction
from tfpipe.stage import keras_step as compile_utils, logs as logs_lib, reduction, tracing
from tfpipe.stage import mirrors as mirrors_lib, updates as updates_lib
from tfpipe.stage import weights as weights_lib
from tfpipe.stage.bodies import TaskBodies
from tfpipe.stage.kept import Backward, Kept, embedding_layers, embeds, is_float, joined, scaled
from tfpipe.stage.residuals import KeptResiduals

__all__ = ["StageProgram", "Kept", "Backward", "embeds"]


class StageProgram(TaskBodies, KeptResiduals):
  """Stage k of a pipeline: its variables on `device` and its task functions.

  Its operations (`forward`, `backward` or its halves `backward_input` and
  `backward_weights`, and `update`) run what
  `tfpipe.plan.tasks` says for its policy (`self.ops`): a forward whose
  backward reads its weights keeps its tape (`Kept`), so the backward
  recomputes nothing and reads the forward's weights exactly (the stash);
  other backwards recompute the stage from its kept input. The executors
  call these operations and nothing else while training. What they read
  and do is delegated: `sources` (`tfpipe.stage.weights`: the weights a task
  reads), `updates` (`tfpipe.stage.updates`: the step with the stage's rule,
  accumulation, whole-model decisions), `reports` (`tfpipe.stage.logs`: the
  last stage's loss and metrics) and `functions` (`tfpipe.stage.tracing`). Its task bodies
  are written in `tfpipe.stage.bodies` (`TaskBodies`), what a called forward keeps in
  `tfpipe.stage.residuals` (`KeptResiduals`), and `Kept` in `tfpipe.stage.kept`.

  Backwards of micro-batches add their weight gradients into accumulators
  (`accumulate=True`); `update` then updates once. `scale` (a
  scalar tensor) weights a micro-batch's loss and regularisation by its share
  of the mini-batch, so the accumulated gradient is the mini-batch's.

  `replica_devices` (hybrid parallelism): every call splits its batch over
  these devices and runs the stage on each part in parallel (in-graph
  replication). The variables live on `device`, the first of them:
  each replica reads its copy of the weights (`tfpipe.stage.reduction.replicate`),
  and on the way back `cross_device_ops` (a `tf.distribute.CrossDeviceOps`)
  sums the parts' gradients there, so the update is the one of the whole batch.
  Non-trainable state (BatchNorm statistics) becomes the replicas' mean;
  regularisation losses are the first replica's (weight penalties count once).
  `grouped` (data-parallel replicas of the whole pipeline): the batch is split
  once, at stage 0; between stages each replica's part travels on its own
  (a stage's inputs and outputs are the replicas' lists one after another, so
  replica r of stage k feeds replica r of stage k+1 directly), and the last
  stage joins them for the loss. The gradients are summed as above: the
  update is the whole batch's.

  `rule` (`tfpipe.rules.mitigations.StageRule`): what an update does beyond the
  optimizer's step (spike compensation, PipeMare's rescheduling and its
  average weight change `deltas`, kept when the policy reads "corrected").

  Regularisation losses (`model.losses` of the stage's layers) count in the
  reported loss as in Keras: a stage before the last adds each forward's to
  its `reg_tracker` (a mean over samples, as the loss tracker's), and the
  last stage's logs add those `reg_trackers` to its loss.

  `optimizer_source`: the compiled optimizer `optimizer` was cloned from; its
  `exclude_from_weight_decay` choices carry over to this stage's variables. `unread`: the
  indices of trainable weights the stage holds but does not read (`Partition.unread`).
  """

  def __init__(self, index: int, num_stages: int, model: Any, device: str, optimizer: Any,
               policy: policies.WeightPolicy, loss: Any = None, metrics: Sequence[Any] = (),
               loss_tracker: Any = None, jit_compile: Optional[bool] = None,
               replica_devices: Optional[Sequence[str]] = None,
               rule: Optional[mitigations.StageRule] = None,
               reg_trackers: Optional[Sequence[Any]] = None, optimizer_source: Any = None,
               grouped: bool = False, cross_device_ops: Any = None,
               output_structure: Any = None, unread: Iterable[int] = ()) -> None:
    self.index, self.num_stages, self.model, self.device = index, num_stages, model, device
    # Indices of trainable weights the stage holds but another stage reads and steps
    # (`Partition.unread`): the model and checkpoints take that stage's copy.
    self.unread = frozenset(unread)
    self.replica_devices = list(replica_devices or [device])
    self.remote = bool(devices_lib.remote([self.replica_devices]))   # on TF servers
    synchronous = policy.method in policies.SYNCHRONOUS_METHODS
    if cross_device_ops == reduction.RING and not synchronous:
      raise ValueError(f"cross_device_ops='ring' keeps each replica's weights equal through "
                       f"its update, which needs a synchronous schedule; {policy.method!r} is "
                       "not one")
    ring = cross_device_ops == reduction.RING and len(self.replica_devices) > 1
    self.cross_device_ops = (None if len(self.replica_devices) == 1 or ring else
                             reduction.choose(self.replica_devices, cross_device_ops))
    if self.replica_devices[0] != device:
      raise ValueError(f"the first replica device must be the stage's device {device!r}. "
                       f"Received: {self.replica_devices}")
    if jit_compile and len(self.replica_devices) > 1:
      raise ValueError("jit_compile=True compiles a stage for one device; a replicated stage "
                       f"(stage {index} on {self.replica_devices}) runs on several")
    self.policy, self.optimizer, self.loss = policy, optimizer, loss
    self.ops = tasks.ops(policy, last=index == num_stages - 1)   # kind -> what the stage runs
    self.is_first, self.is_last = index == 0, index == num_stages - 1
    if policy.predicts:
      prediction.check(optimizer)
    self.rule = rule or mitigations.StageRule()
    if self.is_last and loss is None:
      raise ValueError("the last stage needs a loss")
    R = len(self.replica_devices)
    self.groups_in = R if grouped and not self.is_first else 1   # input lists, one per replica
    self.groups_out = R if grouped and not self.is_last else 1
    self.grouped_in, self.grouped_out = self.groups_in > 1, self.groups_out > 1
    self._float_in = [is_float(t) for t in model.inputs] * self.groups_in
    self._float_out = [is_float(t) for t in model.outputs] * self.groups_out
    self._outputs_dtype = tf.as_dtype(model.outputs[0].dtype)   # the step's scaling reads it
    # The model's outputs (the last stage's, in this order) as Keras's loss and metrics take
    # them: one tensor, or a list or dict of several (their labels arrive as a tuple).
    self.reports = logs_lib.Logs(loss, metrics, loss_tracker, reg_trackers, output_structure,
                                 bool(jit_compile))
    with tf.device(device):
      self.trainable = [keras.Variable(v.numpy(), trainable=True, name=f"s{index}_{v.name}")
                        for v in model.trainable_variables]
      self.non_trainable = [keras.Variable(v.numpy(), trainable=False, name=f"s{index}_{v.name}")
                            for v in model.non_trainable_variables]
      # (model variable, own copy), fixed at compile: a later `layer.trainable = False` moves
      # model variables between Keras's lists, never between these pairs.
      self._pairs = list(zip(model.trainable_variables + model.non_trainable_variables,
                             self.trainable + self.non_trainable))
      self._split = self._model_split()
      if optimizer_source is not None:
        compat.copy_weight_decay_exclusions(optimizer_source, optimizer,
                                                  self._pairs[:len(self.trainable)])
      optimizer.build(self.trainable)
      self.reg_tracker = (keras.metrics.Mean(name=f"s{index}_reg")
                          if not self.is_last and self._has_losses() else None)
      self.sources = weights_lib.WeightSources(index, self.trainable, optimizer, policy,
                                               self.ops)
    # Whether an embedding's micro-batch gradients may be kept as rows (`_row_weights`).
    self.embedding_rows = bool(synchronous and not jit_compile)
    self.updates = updates_lib.Updates(index, device, optimizer, self.rule, self.sources,
                                       rows=self._row_weights())
    self.mirrors = self._ring_mirrors(optimizer, optimizer_source) if ring else None
    self.jit_compile = jit_compile
    self.functions = tracing.TaskFunctions(self._bodies(), device, jit_compile,
                                           placed=self.remote)
    # A concrete forward's name -> its `compat.ResidualCall`.
    self._residual_calls: Dict[str, compat.ResidualCall] = {}
    self._inlined_residuals = False   # `residuals_inlined`
    self._inline = False   # `inlined`: the operations trace their tasks' bodies in place

  def _ring_mirrors(self, optimizer: Any, optimizer_source: Any) -> mirrors_lib.Mirrors:
    """With `cross_device_ops="ring"`: the other replicas' own copies (`tfpipe.stage.mirrors`),
    which both sum the gradients over the replicas and update with the stage."""
    mirrors = mirrors_lib.Mirrors(self.index, self.trainable, optimizer, self.rule,
                                  self.replica_devices[1:], optimizer_source,
                                  self._pairs[:len(self.trainable)],
                                  summing=lambda: self.updates.joint is not None,
                                  first_device=self.device)
    self.cross_device_ops = self.updates.mirrors = mirrors
    mirrors.updates = self.updates
    return mirrors

  def _row_weights(self) -> Tuple[int, ...]:
    """The indices of this stage's weights an `Embedding` reads by rows: with a synchronous
    schedule their micro-batch gradients are kept as rows (`tfpipe.stage.updates`). The
    asynchronous methods' rules are written for dense gradients; XLA wants static shapes."""
    if not self.embedding_rows:
      return ()
    embedded = {id(layer.embeddings) for layer in embedding_layers(self.model)}
    return tuple(j for j, (src, _) in enumerate(self._pairs[:len(self.trainable)])
                 if id(src) in embedded)

  def _has_losses(self) -> bool:
    """Whether the stage's forward adds losses (regularisers, `add_loss`): one probe call."""
    xs = [tf.zeros(compile_utils.example_shape(t.shape), t.dtype) for t in self.model.inputs]
    _, _, losses = self.model.stateless_call(
        [tf.convert_to_tensor(v) for v in self.trainable],
        [tf.convert_to_tensor(v) for v in self.non_trainable], xs[0] if len(xs) == 1 else xs,
        training=True, return_losses=True)
    return bool(losses)

  def task(self, name: str, inline: bool = False) -> Callable[..., Any]:
    """Task function `name` (`tfpipe.stage.tracing.TaskFunctions.get`)."""
    return self.functions.get(name, inline)

  def forward_ops(self) -> int:
    """Ops in one traced forward of the stage (`tfpipe.stage.tracing.forward_ops`)."""
    return tracing.forward_ops(self)

  def forward_loops(self) -> bool:
    """Whether the stage's forward runs a while loop (`tfpipe.stage.tracing.forward_loops`)."""
    return tracing.forward_loops(self)

  def _bodies(self) -> Dict[str, Callable[..., Any]]:
    """The tasks' Python bodies by name: what `task` traces or inlines."""
    return {"read_weights": self._read_weights, "forward": self._forward,
            "forward_on": self._forward_on, "backward_on": self._backward_on,
            "part_grads": self._part_grads, "update": self.updates.update,
            "apply_accumulated": self.updates.apply_accumulated, "last_step": self._last_step,
            "step_on": self._step_on, "infer": self._infer, "evaluate_last": self._evaluate_last}

  # The stage's operations (`tfpipe.plan.tasks`): what every executor calls, eagerly (the
  # threaded executor) or while tracing a window (the compiled one, `inlined` or not).

  @contextlib.contextmanager
  def inlined(self, on: bool = True) -> Iterator[None]:
    """While on, the operations trace their tasks' bodies into the caller's graph (the
    compiled executor's small stages, and a profile of them) rather than call the stage's
    own traced functions: the tracing mode a window is traced in."""
    before, self._inline = self._inline, bool(on)
    try:
      yield
    finally:
      self._inline = before

  def forward(self, xs: Any, s: int = 0, labels: Any = None, training: bool = True,
              split: bool = False) -> Any:
    """Task F: the forward on the weights it reads (s: its version difference).

    Training: returns (outputs, `Kept`: what its backward needs, as the table's `keeps`
    says). The last stage's forward includes its loss: it keeps its inputs with `labels`
    ((labels, sample weights)), and its backward runs forward, loss and backward as one
    step on the weights the table says (so a stash or a prediction is read once, and the
    units of a joined step are one batch); its outputs are None.

    `split`: its backward will run as two halves (`backward_input`, then
    `backward_weights`: a zero-bubble schedule, where the table says so), so a
    kept tape is persistent when the halves run eagerly (the threaded executor) or
    under XLA; traced into a window (inline, or a call that outputs its residuals)
    the input half takes both gradients at once and the weight half applies them.
    Only then: under a persistent tape TensorFlow builds higher-order gradient
    functions for every stage call (measured: 4x the ops, twice the start-up), and each
    half of a call's backward runs the call's whole backward.

    `training=False` (inference, current weights): the outputs; at the last stage with
    `labels`, the loss and metrics of the batch added to the running logs, which it returns.
    """
    inline = self._inline
    if not training:
      if labels is None:
        return self.task("infer", inline)(xs)
      return self.reports.completed(self.task("evaluate_last", inline)(xs, *labels))
    # Traced inline (one graph with its halves), a split backward takes both gradients in one
    # walk of the tape (`backward_input`): the tape need not persist.
    split = (split or self.ops["B"].op == "backward_input") and not inline
    keeps = self.ops["F"].keeps
    if self.remote:   # what it keeps stays here, not where it came from (this program)
      with tf.device(self.device):
        xs = tf.nest.map_structure(tf.identity, xs)
    if self.is_last:   # its inputs and labels, for its backward's step
      return None, Kept(xs, labels=labels)
    if keeps == "inputs":
      ys, _, state = self.task("forward", inline)(xs, s)
      return ys, Kept(xs, state)
    weights = self.task("read_weights", inline)(s)
    if keeps == "weights" or (not inline and self._replicated_loops()):
      ys, _, state = self.task("forward_on", inline)(weights, xs)
      return ys, Kept(xs, state, weights)
    called = not inline or self._inlined_residuals   # a call that outputs its residuals
    call = self._residual_call(weights, xs, inline) if called else None
    if call is not None:   # its outputs and what its gradient reads: no tape
      with tf.device(self.device):
        (ys, reg, state), residuals = call.call((weights, xs))
      return ys, Kept(xs, state, list(weights), residuals=residuals)
    with tf.device(self.device), tf.GradientTape(persistent=split) as tape:
      tape.watch(list(weights) + self._float_inputs(xs))
      ys, reg, state = self.task("forward_on", inline)(weights, xs)
    return ys, Kept(xs, state, list(weights), tape, ys, reg)

  def _replicated_loops(self) -> bool:
    """Whether this stage's replicas are on TF servers and its forward runs a while loop: a
    called forward then keeps the weights it read, not its tape or residuals, and its backward
    recomputes it on them. The gradient from a called forward's residuals is TensorFlow's
    gradient function of the call, whose ops have no device: a replica's loop control nodes
    landed on the call's device, the first replica's, and every time step crossed between the
    hosts (a residual LSTM at a quarter of its width, 2 replicas of 2 stages: 1.2 GB a step
    each way between stage 0's hosts). The recompute builds each replica's gradient on its
    own device (`tfpipe.stage.reduction`)."""
    return self.remote and len(self.replica_devices) > 1 and self.forward_loops()

  def backward(self, parts: Sequence[Kept], dys: Any, s: int, scale: Any,
               accumulate: bool) -> Backward:
    """Task B: the gradients of the forwards `parts` (`Kept`s; several for a TiMePReSt
    mini-batch) given their outputs' gradients `dys`, on the weights the table's `reads`
    says (`s`: the task's version difference); updates with the weight gradients (adds
    them to the accumulators with `accumulate`). Returns `Backward`: the input gradients,
    and at the last stage (its forwards' inputs and labels, joined; `dys` None) the loss and
    the running logs."""
    inline = self._inline
    if self.is_last:
      with tf.device(self.device):
        part = joined(parts)
      y, sample_weight = part.labels
      loss, dxs, logs = self.task("last_step", inline)(part.xs, y, sample_weight, s, scale,
                                                       accumulate)
      return Backward(dxs, loss, self.reports.completed(logs))
    return Backward(self._backward(self._opened(parts), dys, s, scale, accumulate, "both",
                                   inline))

  def backward_input(self, parts: Sequence[Kept], dys: Any, s: int, scale: Any) -> Backward:
    """The input-gradient half of `backward` (a zero-bubble schedule's B): no update. A kept
    tape must be persistent (`forward(..., split=True)`) unless traced `inlined`, or the
    forward kept its residuals: then it takes the weight gradients too, in the same walk (one
    call of the forward's backward), and `Backward.kept` holds them (`Kept.grads`) for the
    weight half.
    At the last stage, `Backward.kept` holds the persistent tape its weight half takes the
    weight gradients from (eagerly), or (in a window's graph) the weight gradients."""
    inline = self._inline
    if self.is_last:
      return self._step_input(parts, s, scale, inline)
    parts = self._opened(parts)
    if len(parts) == 1 and (inline and parts[0].tape is not None or
                            self._replays(parts[0], dys)):
      # One graph holds both halves: the input and weight gradients in one walk of the tape
      # (two walks trace the backward twice: start-up; of a call's tape, each runs the call's
      # whole backward); `Backward.kept` holds the weight gradients the weight half applies.
      # Inlined, the dataflow, not the trace, orders their ops.
      kept = parts[0]
      with tf.device(self.device):
        float_xs = self._float_inputs(kept.xs)
        grads = self._walk(kept, dys, scale, kept.weights + float_xs, len(kept.weights), inline)
      n = len(kept.weights)
      return Backward(self._shaped_input_grads(grads[n:], float_xs),
                      kept=kept._replace(tape=None, grads=grads[:n], residuals=None))
    return Backward(self._backward(parts, dys, s, scale, False, "inputs", inline))

  def backward_weights(self, parts: Sequence[Kept], dys: Any, s: int, scale: Any,
                       accumulate: bool) -> None:
    """The weight-gradient half of `backward` (a zero-bubble schedule's W): the update (at
    the last stage, `parts` is its input half's `Backward.kept` and `dys` None)."""
    inline = self._inline
    if len(parts) == 1 and parts[0].grads is not None:   # taken by the input half
      (kept,) = parts
      with tf.device(self.device):
        self.task("update", inline)(kept.grads, accumulate, self.updates.read(kept.weights))
      return
    if self.is_last:
      (kept,) = parts
      with tf.device(self.device):
        in_tape = self._scales_loss(kept.ys[0].dtype)
        with self._replicas_scaled(None if in_tape else scale):
          grads = self._gradient(kept.tape, kept.ys[0], kept.weights, len(kept.weights))
        if not in_tape:
          grads = [scaled(g, scale) for g in grads]
        self.task("update", inline)(grads, accumulate, self.updates.read(kept.weights))
      return
    self._backward(self._opened(parts), dys, s, scale, accumulate, "weights", inline)

  def update(self) -> Any:
    """Task U: one update with the accumulated gradients, which it clears."""
    return self.task("apply_accumulated", self._inline)()

  def _step_input(self, parts: Sequence[Kept], s: int, scale: Any, inline: bool) -> Backward:
    """A split step's input half: the last stage's forward, loss, metrics and input
    gradients, no update, under a persistent tape its weight half reads when they run
    eagerly (in a window's graph: the weight gradients taken in the same walk)."""
    with tf.device(self.device):
      part = joined(parts)
    together = inline or not tf.executing_eagerly()
    y, sample_weight = part.labels
    weights = list(self.task("read_weights", inline)(s))
    float_xs = self._float_inputs(part.xs)
    with tf.device(self.device), tf.GradientTape(persistent=not together) as tape:
      tape.watch(weights + float_xs)
      target, loss, logs = self.task("step_on", inline)(weights, part.xs, y, sample_weight,
                                                        scale)
    with tf.device(self.device):
      # In one graph with the weight half: both gradients in one walk of the tape.
      in_tape = self._scales_loss(target.dtype)
      with self._replicas_scaled(None if in_tape else scale):
        grads = self._gradient(tape, target, (weights if together else []) + float_xs,
                               len(weights) if together else 0)
      if not in_tape:
        grads = [scaled(g, scale) for g in grads]
    n = len(weights) if together else 0
    kept = (Kept(part.xs, None, weights, grads=grads[:n]) if together else
            Kept(part.xs, None, weights, tape, [target], None))
    return Backward(self._input_grads(grads[n:]), loss, self.reports.completed(logs), kept)

  def _backward(self, parts: Sequence[Kept], dys: Any, s: int, scale: Any, accumulate: bool,
                wrt: str, inline: bool) -> List[Any]:
    if len(parts) == 1 and (parts[0].tape is not None or self._replays(parts[0], dys)):
      return self._through_tape(parts[0], dys, scale, accumulate, wrt, inline)
    weights = parts[0].weights if parts[0].weights is not None else []
    if self.ops["B"].reads in ("corrected", "blend"):
      # s: the updates since the forward, which vary over warm-up, steady state and drain; as
      # a tensor the backward traces once for all of them.
      with tf.device(self.device):
        s = tf.constant(float(s), tf.float64)
    return list(self.task("backward_on", inline)(weights, [(p.xs, p.state) for p in parts],
                                                 dys, s, scale, accumulate, wrt, inline))

  def _through_tape(self, kept: Kept, dys: Any, scale: Any, accumulate: bool, wrt: str,
                    inline: bool) -> List[Any]:
    """The gradient through a kept forward's tape (its own weights), then the update."""
    with tf.device(self.device):
      float_xs = self._float_inputs(kept.xs)
      weights = kept.weights if wrt != "inputs" else []
      grads = self._walk(kept, dys, scale, weights + (float_xs if wrt != "weights" else []),
                         len(weights), inline)
      if wrt != "inputs":   # after the input gradients, as `_update_after` says
        with tf.control_dependencies([g for g in grads[len(weights):] if g is not None]):
          self.task("update", inline)(grads[:len(weights)], accumulate,
                                      self.updates.read(weights))
      if wrt == "weights":
        return []
      return self._shaped_input_grads(grads[len(weights):], float_xs)

  def _walk(self, kept: Kept, dys: Any, scale: Any, sources: Sequence[Any], n_weights: int,
            inline: bool = False) -> List[Any]:
    """The gradients of `sources` through a kept forward's tape, given its outputs' `dys`
    (or from its residuals: the same functions TensorFlow's gradient of the call runs; those
    of a forward called `inline`, `residuals_inlined`)."""
    if kept.tape is None:
      return self._from_residuals(kept, dys, scale, sources, n_weights, inline)
    targets, out_grads = self._targets(kept.ys, dys, kept.reg, scale)
    return self._gradient(kept.tape, targets, sources, n_weights, out_grads)

  def _shaped_input_grads(self, grads: Sequence[Any], float_xs: Sequence[Any]) -> List[Any]:
    """The input gradients `grads` of `float_xs`, each given its input's shape: through a
    call of the forward traced for any batch size (`_forward_trace`) TensorFlow does not
    know it, and the backward of the stage before, called with them, would trace again."""
    for g, x in zip(grads, float_xs):
      if isinstance(g, tf.Tensor) and not tf.executing_eagerly():
        g.set_shape(x.shape)
    return self._input_grads(grads)

  # Moving weights between the stage and the user's model.

  def load_from_model(self) -> None:
    for src, own in self._pairs:
      own.assign(src.numpy())
    self.sources.keep_previous()   # 2BW: no update yet, so the 2nd buffer holds the same weights
    self.sync_replicas()

  @property
  def model_pairs(self) -> List[Tuple[Any, Any]]:
    """[(the user's model variable, this stage's own copy)]: the trainable ones first, in the
    order the stage's optimizer was built over them."""
    return list(self._pairs)

  def sync_replicas(self) -> None:
    """The other replicas' own copies (`cross_device_ops="ring"`) := this stage's weights and
    optimizer state (after they were loaded or restored)."""
    if self.mirrors is not None:
      self.mirrors.sync()

  def write_to_model(self) -> None:
    for j, (dst, own) in enumerate(self._pairs):
      if j not in self.unread:
        dst.assign(own.numpy())

  def finalize(self) -> None:
    """The optimizer's end-of-fit step (`finalize_variable_values`: EMA weights swapped in)."""
    with tf.device(self.device):
      self.optimizer.finalize_variable_values(self.trainable)

  def trainable_changed(self) -> List[str]:
    """Names of this stage's layers whose `trainable` changed since compile."""
    now = set(id(v) for v in self.model.trainable_variables)
    then = set(self._split[0])
    return [l.name for l in self.model.layers
            if any((id(v) in now) != (id(v) in then) for v in l.weights)]
