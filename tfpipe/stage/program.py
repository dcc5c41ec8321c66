"""Stage programs: one stage's weights, optimizer and compiled task functions.

k: stage index, K: stages, s: version difference. Each stage owns copies of
its sub-model's variables placed on its device, and its own optimizer. Task
functions read the weights explicitly through `keras.Model.stateless_call`,
so current, stashed and predicted weights all run the same compiled code.
"""

import collections
import contextlib

import keras
import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import policies, tasks
from tfpipe.rules import mitigations, prediction
from tfpipe.stage import keras_step as compile_utils, logs as logs_lib, reduction, tracing
from tfpipe.stage import mirrors as mirrors_lib, placement, updates as updates_lib
from tfpipe.stage import weights as weights_lib

__all__ = ["StageProgram", "Kept", "Backward", "embeds"]

_NONE = tf.UnconnectedGradients.NONE
# The traced task functions (`StageProgram.task`).
Kept = collections.namedtuple(
    "Kept", ["xs", "state", "weights", "tape", "ys", "reg", "labels", "grads", "residuals"],
    defaults=(None, None, None, None, None, None, None, None))
Kept.__doc__ = """What a forward keeps for its backward (`tfpipe.plan.tasks` `keeps`): its
inputs `xs` and the non-trainable `state` it read (its random draws, which a recompute
replays); the `weights` it read (for "tape" and "weights"); for "tape" also the gradient
`tape` (persistent when the backward runs as two halves) with its outputs `ys` and
regularisation `reg`, or, for a forward called from a compiled window's graph, its
`residuals`: the forward's tensors its gradient reads, which the call output
(`compat.ResidualCall`), so the backward needs no tape and may run in a later window.
`StageProgram.carried` is what a compiled window carries across its boundary: the residuals
packed into one tensor, or without a tape the inputs, state and weights, from which the
backward then recomputes the forward (the same values). The last stage's forward keeps its inputs and `labels`
((labels, sample weights)) for its step. After a split backward's input half traced into
one graph with its weight half (`inline`), `grads`: the weight gradients it took in the same
walk of the tape, which the weight half applies."""

Backward = collections.namedtuple("Backward", ["dxs", "loss", "logs", "kept"],
                                  defaults=(None, None, None))
Backward.__doc__ = """What a backward returns: the input gradients `dxs`; at the last stage
also the step's `loss` and the running `logs`, and after a split step's input half the
`kept` tape its weight half reads."""


def _scaled(grad, scale):
  """`grad` (a tensor or IndexedSlices) times `scale`, in the gradient's dtype."""
  if isinstance(scale, (int, float)) and scale == 1:
    return grad
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                            grad.dense_shape)
  return grad * tf.cast(scale, grad.dtype)


def _summed(grads):
  """The sum of one weight's gradients from several parts; IndexedSlices (an embedding's)
  join as the tape joins them (their rows concatenated)."""
  if all(isinstance(g, tf.IndexedSlices) for g in grads):
    return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                            tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def _is_float(t):
  return tf.as_dtype(t.dtype).is_floating


def _embeddings(model):
  """The trainable `Embedding` layers of `model`, nested ones too."""
  return [layer for layer in compat.all_layers(model)
          if isinstance(layer, keras.layers.Embedding) and layer.trainable]


def embeds(model):
  """Whether `model` (a stage) has a trainable embedding, whose gradient comes as rows."""
  return bool(_embeddings(model))


class StageProgram:
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
  last stage's loss and metrics) and `functions` (`tfpipe.stage.tracing`).

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

  def __init__(self, index, num_stages, model, device, optimizer, policy, loss=None,
               metrics=(), loss_tracker=None, jit_compile=None, replica_devices=None,
               rule=None, reg_trackers=None, optimizer_source=None, grouped=False,
               cross_device_ops=None, output_structure=None, unread=()):
    self.index, self.num_stages, self.model, self.device = index, num_stages, model, device
    # Indices of trainable weights the stage holds but another stage reads and steps
    # (`Partition.unread`): the model and checkpoints take that stage's copy.
    self.unread = frozenset(unread)
    self.replica_devices = list(replica_devices or [device])
    self.remote = bool(placement.remote([self.replica_devices]))   # on TF servers
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
    self._float_in = [_is_float(t) for t in model.inputs] * self.groups_in
    self._float_out = [_is_float(t) for t in model.outputs] * self.groups_out
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
    self.updates = updates_lib.Updates(index, device, optimizer, self.rule, self.sources,
                                       rows=self._row_weights(synchronous, jit_compile))
    self.mirrors = (mirrors_lib.Mirrors(index, self.trainable, optimizer, self.rule,
                                        self.replica_devices[1:], optimizer_source,
                                        self._pairs[:len(self.trainable)],
                                        summing=lambda: self.updates.joint is not None,
                                        first_device=device)
                    if ring else None)
    if ring:
      self.cross_device_ops = self.updates.mirrors = self.mirrors
      self.mirrors.updates = self.updates
    self.jit_compile = jit_compile
    self.functions = tracing.TaskFunctions(self._bodies(), device, jit_compile,
                                           placed=self.remote)
    self._residual_calls = {}   # concrete forward's name -> its `compat.ResidualCall`
    self._inlined_residuals = False   # `residuals_inlined`
    self._inline = False   # `inlined`: the operations trace their tasks' bodies in place

  def _row_weights(self, synchronous, jit_compile):
    """The indices of this stage's weights an `Embedding` reads by rows: with a synchronous
    schedule their micro-batch gradients are kept as rows (`tfpipe.stage.updates`). The
    asynchronous methods' rules are written for dense gradients; XLA wants static shapes."""
    if not synchronous or jit_compile:
      return ()
    embedded = {id(layer.embeddings) for layer in _embeddings(self.model)}
    return tuple(j for j, (src, _) in enumerate(self._pairs[:len(self.trainable)])
                 if id(src) in embedded)

  def _has_losses(self):
    """Whether the stage's forward adds losses (regularisers, `add_loss`): one probe call."""
    xs = [tf.zeros(compile_utils.example_shape(t.shape), t.dtype) for t in self.model.inputs]
    _, _, losses = self.model.stateless_call(
        [tf.convert_to_tensor(v) for v in self.trainable],
        [tf.convert_to_tensor(v) for v in self.non_trainable], xs[0] if len(xs) == 1 else xs,
        training=True, return_losses=True)
    return bool(losses)

  def task(self, name, inline=False):
    """Task function `name` (`tfpipe.stage.tracing.TaskFunctions.get`)."""
    return self.functions.get(name, inline)

  def forward_ops(self):
    """Ops in one traced forward of the stage (`tfpipe.stage.tracing.forward_ops`)."""
    return tracing.forward_ops(self)

  def forward_loops(self):
    """Whether the stage's forward runs a while loop (`tfpipe.stage.tracing.forward_loops`)."""
    return tracing.forward_loops(self)

  def _bodies(self):
    """The tasks' Python bodies by name: what `task` traces or inlines."""
    return {"read_weights": self._read_weights, "forward": self._forward,
            "forward_on": self._forward_on, "backward_on": self._backward_on,
            "part_grads": self._part_grads, "update": self.updates.update,
            "apply_accumulated": self.updates.apply_accumulated, "last_step": self._last_step,
            "step_on": self._step_on, "infer": self._infer, "evaluate_last": self._evaluate_last}

  # Weights and the stage call.

  def _call(self, weights, xs, training, update_state=True, state=None):
    """The stage on `xs` with `weights`; returns (outputs, regularisation, state read).

    `state`: the non-trainable values to read (None: the variables'). Random
    layers draw from their seed generators' state, which is part of it: a
    recomputation passes the state its forward read and so draws the same
    masks (docs/architecture.md).
    """
    if state is None:
      state = [tf.convert_to_tensor(v) for v in self.non_trainable]
    moved = self._model_split() != self._split   # a layer's `trainable` changed since compile
    call_weights, call_state = self._as_model_split(weights, state) if moved else (weights, state)
    if len(self.replica_devices) > 1:
      ys, new_state, losses = reduction.replicated_call(
          self.model, call_weights, call_state, xs, training, self.replica_devices,
          self.cross_device_ops, self.groups_in, self.groups_out)
    else:
      inputs = xs[0] if len(xs) == 1 else list(xs)
      ys, new_state, losses = self.model.stateless_call(
          call_weights, call_state, inputs, training=training, return_losses=True)
      ys = tf.nest.flatten(ys)
    if moved:
      new_state = self._from_model_split(new_state, state)
    if training and update_state:
      for v, value in zip(self.non_trainable, new_state):
        v.assign(value)
    # Keras adds each additional loss summed, in floatx (Trainer._aggregate_additional_loss).
    losses = [tf.reduce_sum(tf.cast(l, keras.backend.floatx()) if not l.dtype.is_floating else l)
              for l in losses]
    reg = tf.add_n(losses) if losses else tf.zeros((), dtype=tf.float32)
    if losses and update_state and self.reg_tracker is not None:
      size = len(xs) // self.groups_in   # the samples of every replica's inputs
      self.reg_tracker.update_state(
          reg, sample_weight=tf.add_n([tf.shape(x)[0] for x in xs[::size]]))
    return ys, reg, state

  def _model_split(self):
    """Which of this stage's variables Keras now lists as trainable (ids, in its order)."""
    return ([id(v) for v in self.model.trainable_variables],
            [id(v) for v in self.model.non_trainable_variables])

  def _as_model_split(self, weights, state):
    """`weights` and `state` (the compile-time split) as Keras's lists are after a layer's
    `trainable` changed: predict and evaluate still read every variable's own value
    (`Pipeline.fit` asks for a new compile)."""
    values = {id(src): value for (src, _), value in zip(self._pairs, list(weights) + list(state))}
    return ([values[id(v)] for v in self.model.trainable_variables],
            [values[id(v)] for v in self.model.non_trainable_variables])

  def _from_model_split(self, new_state, state):
    """The non-trainable values after a call, back in the compile-time order."""
    values = {id(v): value for v, value in zip(self.model.non_trainable_variables, new_state)}
    sources = [src for src, _ in self._pairs[len(self.trainable):]]
    return [values.get(id(src), old) for src, old in zip(sources, state)]

  def _float_inputs(self, xs):
    return [] if self.is_first else [x for x, f in zip(xs, self._float_in) if f]

  def _gradient(self, tape, targets, sources, n_weights, output_gradients=None):
    """`tape.gradient(targets, sources)`, where the first `n_weights` sources are the stage's
    weights (`_connected`)."""
    grads = tape.gradient(targets, sources, output_gradients=output_gradients,
                          unconnected_gradients=_NONE)
    return self._connected(grads, sources, n_weights)

  def _connected(self, grads, sources, n_weights):
    """`grads` of `sources` with zeros where a source is unconnected; a weight among the
    first `n_weights` that the loss does not depend on is noted (`Updates.unused`): Keras's
    optimizer gives it no step, not a step with a zero gradient (which moves it under Adam's
    momentum or AdamW's decay)."""
    out = []
    for j, (g, t) in enumerate(zip(grads, sources)):
      if g is None:
        if j < n_weights:
          self.updates.unused.add(j)
        g = tf.zeros_like(t)
      out.append(g)
    return out

  def _input_grads(self, grads):
    """Gradients for every stage input (None for integer inputs); none for stage 0."""
    if self.is_first:
      return []
    grads = iter(grads)
    return [next(grads) if f else None for f in self._float_in]

  def _targets(self, ys, dys, reg, scale):
    pairs = [(y, dy if dy is not None else tf.zeros_like(y))
             for y, dy, f in zip(ys, dys, self._float_out) if f]
    # The regularisation's gradient weighs as the loss's: the micro-batch's share, and the
    # loss scale where the loss is scaled (the output gradients `dys` carry it already).
    return ([y for y, _ in pairs] + [reg],
            [dy for _, dy in pairs] + [self._loss_scaled(tf.ones_like(reg)
                                                         * tf.cast(scale, reg.dtype))])

  # Task functions (traced once per signature; `task` gives them to the executors).

  def _read_weights(self, s):
    """The forward's weights as tensors of their own: what a kept forward or a blend reads
    (the last stage: its step's)."""
    with tf.device(self.device):
      return [tf.identity(w) for w in self.sources.forward(s)]

  def _forward(self, xs, s):
    """The training forward on the weights it reads: (outputs, regularisation, the
    non-trainable state read: kept for a recompute)."""
    with tf.device(self.device):
      return self._call(self.sources.read(s, self.ops["F"].reads), xs, training=True)

  def _forward_on(self, weights, xs):
    """The training forward on `weights` (tensors): (outputs, regularisation, state read)."""
    with tf.device(self.device):
      return self._call(weights, xs, training=True)

  def _backward_on(self, kept_weights, parts, dys, s, scale, accumulate, wrt, inline=False):
    """Recomputes the forwards of `parts` [(inputs, state read)] on the backward's weights
    (`_backward_read`) and takes their gradients `wrt` ("both", "inputs", "weights"); the
    weight gradients update (or accumulate); returns the input gradients ([] for "weights").

    Each part replays its own forward's random draws; outputs (and input gradients) of
    several parts (a TiMePReSt mini-batch) join along the batch axis. Regularisation losses
    are the first part's (weight penalties count once). Several parts run as calls of one
    traced `part_grads` (its body, `inline`), their weight gradients summed: one trace of the
    stage for all the parts, not one per part.
    """
    with tf.device(self.device):
      weights = self.sources.backward(kept_weights, s)
      if len(parts) > 1 and not (self.grouped_in or self.grouped_out):
        weight_grads, input_grads = self._summed_grads(weights, parts, dys, scale, wrt, inline)
      else:
        weight_grads, input_grads = self._joined_grads(weights, parts, dys, scale, wrt)
      if wrt == "weights":
        self.updates.update(weight_grads, accumulate, self.updates.read(weights))
        return []
      if wrt == "both":
        self.updates.update_after(input_grads, weight_grads, accumulate, weights)
      return self._input_grads(input_grads)

  def _joined_grads(self, weights, parts, dys, scale, wrt):
    """(weight gradients, input gradients) of the parts' forwards traced side by side, their
    outputs joined along the batch axis."""
    float_xs = [x for xs, _ in parts for x in self._float_inputs(xs)]
    with tf.GradientTape() as tape:
      tape.watch(list(weights) + float_xs)
      outs = [self._call(weights, xs, training=True, update_state=False, state=state)
              for xs, state in parts]
      ys = outs[0][0] if len(outs) == 1 else [tf.concat(list(y), 0)
                                              for y in zip(*[o[0] for o in outs])]
      targets, out_grads = self._targets(ys, dys, outs[0][1], scale)
    sources = ((list(weights) if wrt != "inputs" else []) +
               (float_xs if wrt != "weights" else []))
    n_weights = len(weights) if wrt != "inputs" else 0
    grads = self._gradient(tape, targets, sources, n_weights, out_grads)
    if wrt == "weights":
      return grads, []
    n = len(float_xs) // len(parts)
    per_part = [grads[n_weights + i * n:n_weights + (i + 1) * n] for i in range(len(parts))]
    joined = per_part[0] if len(parts) == 1 else [tf.concat(list(g), 0) for g in zip(*per_part)]
    return grads[:n_weights], joined

  def _summed_grads(self, weights, parts, dys, scale, wrt, inline):
    """(weight gradients, input gradients) of the parts' forwards, one `part_grads` call
    each: the weight gradients summed, the input gradients joined along the batch axis."""
    sizes = [tf.shape(xs[0])[0] for xs, _ in parts]
    dys = [[None] * len(parts) if dy is None else tf.split(dy, sizes) for dy in dys]
    call = self.task("part_grads", inline)
    zero = tf.zeros((), tf.float32)
    results = [call(weights, xs, state, [dy[i] for dy in dys],
                    tf.cast(scale, tf.float32) if i == 0 else zero, wrt)
               for i, (xs, state) in enumerate(parts)]
    weight_grads = [_summed(list(g)) for g in zip(*[r[0] for r in results])]
    input_grads = [tf.concat(list(g), 0) for g in zip(*[r[1] for r in results])]
    return weight_grads, input_grads

  def _part_grads(self, weights, xs, state, dys, reg_scale, wrt):
    """One part of a recomputing backward (`_joined_grads` of that part alone): its forward
    on `weights` replaying `state`, then (weight gradients, input gradients) `wrt`, its
    regularisation weighted by `reg_scale` (0: a later part's, counted by the first)."""
    with tf.device(self.device):
      return self._joined_grads(weights, [(xs, state)], dys, reg_scale, wrt)

  def _last_step(self, xs, y, sample_weight, s, scale, accumulate):
    """The last stage's forward, loss, backward and update: returns (loss, input gradients,
    the epoch's running loss and metrics after this batch, as Keras's batch logs)."""
    with tf.device(self.device):
      weights = self.sources.read(s, self.ops["B"].reads)
      float_xs = self._float_inputs(xs)
      with tf.GradientTape() as tape:
        tape.watch(weights + float_xs)
        ys, reg, _ = self._call(weights, xs, training=True)
        y_true, y_pred = self.reports.structured(ys, y)
        loss = self.loss(y_true, y_pred, sample_weight=sample_weight)
        total = loss + tf.cast(reg, loss.dtype)
        same = total.dtype == ys[0].dtype
        scaled = self._loss_scaled(total * tf.cast(scale, total.dtype) if same else total)
      with self._replicas_scaled(None if same else scale):
        grads = self._gradient(tape, scaled, weights + float_xs, len(weights))
      if not same:
        # Keras's CompileLoss returns floatx (float32): a float64 model's share (like 5/18)
        # scales its gradients in float64, not rounded to float32 (1e-8 relative).
        grads = [_scaled(g, scale) for g in grads]
      self.updates.update_after(grads[len(weights):], grads[:len(weights)], accumulate, weights)
      self.reports.update(y_true, y_pred, total, sample_weight)
      return total, self._input_grads(grads[len(weights):]), self.reports.results(in_task=True)

  def _step_on(self, weights, xs, y, sample_weight, scale):
    """The last stage's forward, loss and metrics on `weights` (tensors), for a split step
    (`last_step_input`): (the target of its gradients, the loss, the running logs)."""
    with tf.device(self.device):
      ys, reg, _ = self._call(weights, xs, training=True)
      y_true, y_pred = self.reports.structured(ys, y)
      loss = self.loss(y_true, y_pred, sample_weight=sample_weight)
      total = loss + tf.cast(reg, loss.dtype)
      # As `_last_step`: a loss of another dtype than the outputs scales the gradients.
      self._step_scales_loss = total.dtype == ys[0].dtype
      target = self._loss_scaled(total * tf.cast(scale, total.dtype) if self._step_scales_loss
                                 else total)
      self.reports.update(y_true, y_pred, total, sample_weight)
      return target, total, self.reports.results(in_task=True)

  def _replicas_scaled(self, scale):
    """The replicas' own gradients (`mirrors`) scaled as this stage's are after the tape."""
    if self.mirrors is None or scale is None:
      return contextlib.nullcontext()
    return self.mirrors.scaled(scale)

  def _loss_scaled(self, loss):
    """The backward's target: `loss` times the pipeline's loss scale (`tfpipe.rules.joint`), if any."""
    joint = self.updates.joint
    return joint.scaled_loss(loss) if joint is not None else loss

  def _infer(self, xs):
    with tf.device(self.device):
      return self._call(self.sources.read(0, "current"), xs, training=False)[0]

  def _evaluate_last(self, xs, y, sample_weight):
    """Loss and metrics of a batch with the current weights; returns the running logs."""
    with tf.device(self.device):
      ys, reg, _ = self._call(self.sources.read(0, "current"), xs, training=False)
      y_true, y_pred = self.reports.structured(ys, y)
      loss = self.loss(y_true, y_pred, sample_weight=sample_weight) + reg
      self.reports.update(y_true, y_pred, loss, sample_weight)
      return self.reports.results(in_task=True)

  # The stage's operations (`tfpipe.plan.tasks`): what every executor calls, eagerly (the
  # threaded executor) or while tracing a window (the compiled one; `inline`: see `task`).

  @contextlib.contextmanager
  def inlined(self, on=True):
    """While on, the operations trace their tasks' bodies into the caller's graph (the
    compiled executor's small stages, and a profile of them) rather than call the stage's
    own traced functions: the tracing mode a window is traced in."""
    before, self._inline = self._inline, bool(on)
    try:
      yield
    finally:
      self._inline = before

  def forward(self, xs, s=0, labels=None, training=True, split=False):
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
    if self.ops["F"].op == "hold":
      return None, Kept(xs, labels=labels)
    if keeps == "inputs":
      ys, _, state = self.task("forward", inline)(xs, s)
      return ys, Kept(xs, state)
    weights = self.task("read_weights", inline)(s)
    if keeps == "weights":
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

  @contextlib.contextmanager
  def residuals_inlined(self, on=True):
    """While on, a forward traced inline whose backward reads its tape is instead a call of
    the forward traced once per signature (`TaskFunctions.inlined_forward`) that outputs its
    residuals, which TensorFlow inlines when the graph runs, and its backward a call of that
    forward's backward (`compat.ResidualCall`): a window graph that holds M copies of the
    stage's tasks traces the forward and its gradient once, not M times. For the compiled
    executor's loop windows, where each forward's backward is in the same graph (a
    zero-bubble backward's input half takes both gradients from the residuals, as a
    window of calls does). Measured (`bench/startup.py`, 12-layer Llama, K=4, M=4,
    first-epoch extra / second epoch, s): 1f1b 16.7 / 1.67 traced inline, 11.3 / 1.67 so;
    gpipe 18.4 / 1.73, 11.3 / 1.68 (Keras's extra 9.4 s); zb (first epoch, 6 epochs'
    steady, alternating processes) 19.1, 19.3 / 1.64, 1.84, so 13.1, 12.9 / 1.85, 1.69
    (each process runs at one of two steady speeds, either way)."""
    before, self._inlined_residuals = self._inlined_residuals, on
    try:
      yield
    finally:
      self._inlined_residuals = before

  def _residual_call(self, weights, xs, inline=False):
    """The forward's `compat.ResidualCall` for these arguments, when a window's graph calls
    the traced forward (not eagerly, not under XLA); else None. `inline`: of the forward
    TensorFlow inlines when the graph runs (`residuals_inlined`), else of the one that stays
    a call. Under XLA on CPU, measured
    (`bench/steady_state.py --methods=spectrain --variants=xla`, two runs each): first-epoch
    extra 15.7-16.7 s against 19.9-20.5 s recomputing, but steady epochs 2.93-3.09 s against
    2.37-2.40 s (cores busy 1.15 against 1.41): recomputed there."""
    if tf.executing_eagerly() or self.jit_compile:
      return None
    forward = self.functions.inlined_forward if inline else self.functions.traced["forward_on"]
    concrete = forward.get_concrete_function(weights, xs)
    if concrete.name not in self._residual_calls:
      self._residual_calls[concrete.name] = compat.ResidualCall(concrete)
    return self._residual_calls[concrete.name]

  def backward(self, parts, dys, s, scale, accumulate):
    """Task B: the gradients of the forwards `parts` (`Kept`s; several for a TiMePReSt
    mini-batch) given their outputs' gradients `dys`, on the weights the table's `reads`
    says (`s`: the task's version difference); updates with the weight gradients (adds
    them to the accumulators with `accumulate`). Returns `Backward`: the input gradients,
    and at the last stage (one part: its inputs and labels; `dys` None) the loss and the
    running logs."""
    inline = self._inline
    if self._steps:
      (part,) = parts
      y, sample_weight = part.labels
      loss, dxs, logs = self.task("last_step", inline)(part.xs, y, sample_weight, s, scale,
                                                       accumulate)
      return Backward(dxs, loss, self.reports.completed(logs))
    return Backward(self._backward(self._opened(parts), dys, s, scale, accumulate, "both",
                                   inline))

  def backward_input(self, parts, dys, s, scale):
    """The input-gradient half of `backward` (a zero-bubble schedule's B): no update. A kept
    tape must be persistent (`forward(..., split=True)`) unless traced `inlined`, or the forward kept
    its residuals: then it takes the weight gradients too, in the same walk (one call of the
    forward's backward), and `Backward.kept` holds them (`Kept.grads`) for the weight half.
    At the last stage, `Backward.kept` holds the persistent tape its weight half takes the
    weight gradients from (eagerly), or (in a window's graph) the weight gradients."""
    inline = self._inline
    if self._steps:
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

  def backward_weights(self, parts, dys, s, scale, accumulate):
    """The weight-gradient half of `backward` (a zero-bubble schedule's W): the update (at
    the last stage, `parts` is its input half's `Backward.kept` and `dys` None)."""
    inline = self._inline
    if len(parts) == 1 and parts[0].grads is not None:   # taken by the input half
      (kept,) = parts
      with tf.device(self.device):
        self.task("update", inline)(kept.grads, accumulate, self.updates.read(kept.weights))
      return
    if self._steps:
      (kept,) = parts
      with tf.device(self.device):
        with self._replicas_scaled(None if self._step_scales_loss else scale):
          grads = self._gradient(kept.tape, kept.ys[0], kept.weights, len(kept.weights))
        if not self._step_scales_loss:
          grads = [_scaled(g, scale) for g in grads]
        self.task("update", inline)(grads, accumulate, self.updates.read(kept.weights))
      return
    self._backward(self._opened(parts), dys, s, scale, accumulate, "weights", inline)

  def update(self):
    """Task U: one update with the accumulated gradients, which it clears."""
    return self.task("apply_accumulated", self._inline)()

  @property
  def _steps(self):
    """Whether this stage's backward is the last stage's step (forward, loss, backward)."""
    return self.ops["B"].op in ("step", "step_input")

  def _step_input(self, parts, s, scale, inline):
    """A split step's input half: the last stage's forward, loss, metrics and input
    gradients, no update, under a persistent tape its weight half reads when they run
    eagerly (in a window's graph: the weight gradients taken in the same walk)."""
    (part,) = parts
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
      with self._replicas_scaled(None if self._step_scales_loss else scale):
        grads = self._gradient(tape, target, (weights if together else []) + float_xs,
                               len(weights) if together else 0)
      if not self._step_scales_loss:
        grads = [_scaled(g, scale) for g in grads]
    n = len(weights) if together else 0
    kept = (Kept(part.xs, None, weights, grads=grads[:n]) if together else
            Kept(part.xs, None, weights, tape, [target], None))
    return Backward(self._input_grads(grads[n:]), loss, self.reports.completed(logs), kept)

  def _backward(self, parts, dys, s, scale, accumulate, wrt, inline):
    if len(parts) == 1 and (parts[0].tape is not None or self._replays(parts[0], dys)):
      return self._through_tape(parts[0], dys, scale, accumulate, wrt, inline)
    weights = parts[0].weights if parts[0].weights is not None else []
    if self.ops["B"].reads in ("corrected", "blend"):
      # s: the updates since the forward, which vary over warm-up, steady state and drain; as
      # a tensor the backward traces once for all of them.
      with tf.device(self.device):
        s = tf.constant(float(s), tf.float64)
    return self.task("backward_on", inline)(weights, [(p.xs, p.state) for p in parts], dys, s,
                                            scale, accumulate, wrt, inline)

  def _through_tape(self, kept, dys, scale, accumulate, wrt, inline):
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

  def _walk(self, kept, dys, scale, sources, n_weights, inline=False):
    """The gradients of `sources` through a kept forward's tape, given its outputs' `dys`
    (or from its residuals: the same functions TensorFlow's gradient of the call runs; those
    of a forward called `inline`, `residuals_inlined`)."""
    if kept.tape is None:
      return self._from_residuals(kept, dys, scale, sources, n_weights, inline)
    targets, out_grads = self._targets(kept.ys, dys, kept.reg, scale)
    return self._gradient(kept.tape, targets, sources, n_weights, out_grads)

  def carried(self, kept):
    """`kept` as a compiled window carries it into the next: without its tape, and its
    residuals (if any) packed with the weights it read into one tensor (its `weights` then
    None, one per weight), which the backward unpacks (`_opened`). A window's carry passes
    each of its tensors through the window function, and each costs the call: measured, a
    12-layer Llama's stage kept about 300 residuals, and carrying them one by one cost more
    than the recompute they spare; with the weights packed too, spectrain's carry at K=4
    went from 228 tensors to 24. A stage on a TF server carries them one by one, each parked
    on its task (`tfpipe.runtime.parked`): a function's optional output came back to this
    program wherever it was made (measured)."""
    residuals, weights = kept.residuals, kept.weights
    if residuals is not None and not isinstance(residuals, tf.Tensor) and not self.remote:
      with tf.device(self.device):
        residuals = tf.raw_ops.OptionalFromValue(components=list(weights) + list(residuals))
      weights = [None] * len(weights)
    return Kept(kept.xs, kept.state, weights, labels=kept.labels, residuals=residuals)

  def _opened(self, parts):
    """`parts` with any residuals a window carried packed (`carried`) unpacked: the weights
    the forward read and its residuals, as tensors again."""
    return [self._opened_one(kept) for kept in parts]

  def _opened_one(self, kept):
    if not isinstance(kept.residuals, tf.Tensor):
      return kept
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in self.trainable]
    call = self._residual_call(specs, kept.xs)
    with tf.device(self.device):
      values = tf.raw_ops.OptionalGetValue(
          optional=kept.residuals, output_types=[s.dtype for s in specs] + call.residual_types,
          output_shapes=[s.shape for s in specs] + call.residual_shapes)
    n = len(specs)
    return kept._replace(weights=list(values[:n]), residuals=list(values[n:]))

  def _replays(self, kept, dys):
    """Whether the backward of `kept` takes its gradients from its residuals: it has them
    and every float output has its gradient (else the forward is recomputed)."""
    return kept.residuals is not None and all(
        dy is not None for dy, f in zip(dys, self._float_out) if f)

  def _from_residuals(self, kept, dys, scale, sources, n_weights, inline=False):
    """`_walk` for a forward that kept its residuals (`Kept.residuals`), not a tape."""
    call = self._residual_call(kept.weights, kept.xs, inline)
    residuals = kept.residuals
    _, reg, state = call.outputs
    reg_grad = self._loss_scaled(tf.ones([], reg.dtype) * tf.cast(scale, reg.dtype))
    zeros = [tf.zeros(t.shape, t.dtype) if call.trainable_output(t) else None
             for t in tf.nest.flatten(state)]
    out_grads = [dy if f else None for dy, f in zip(dys, self._float_out)]
    grads = call.gradients(residuals, (out_grads, reg_grad, zeros))
    by_id = {id(t): g for t, g in zip(list(kept.weights) + list(kept.xs), grads)}
    return self._connected([by_id[id(t)] for t in sources], sources, n_weights)

  def _shaped_input_grads(self, grads, float_xs):
    """The input gradients `grads` of `float_xs`, each given its input's shape: through a
    call of the forward traced for any batch size (`_forward_trace`) TensorFlow does not
    know it, and the backward of the stage before, called with them, would trace again."""
    for g, x in zip(grads, float_xs):
      if isinstance(g, tf.Tensor) and not tf.executing_eagerly():
        g.set_shape(x.shape)
    return self._input_grads(grads)

  # Moving weights between the stage and the user's model.

  def load_from_model(self):
    for src, own in self._pairs:
      own.assign(src.numpy())
    self.sources.keep_previous()   # 2BW: no update yet, so the 2nd buffer holds the same weights
    self.sync_replicas()

  @property
  def model_pairs(self):
    """[(the user's model variable, this stage's own copy)]: the trainable ones first, in the
    order the stage's optimizer was built over them."""
    return list(self._pairs)

  def sync_replicas(self):
    """The other replicas' own copies (`cross_device_ops="ring"`) := this stage's weights and
    optimizer state (after they were loaded or restored)."""
    if self.mirrors is not None:
      self.mirrors.sync()

  def write_to_model(self):
    for j, (dst, own) in enumerate(self._pairs):
      if j not in self.unread:
        dst.assign(own.numpy())

  def finalize(self):
    """The optimizer's end-of-fit step (`finalize_variable_values`: EMA weights swapped in)."""
    with tf.device(self.device):
      self.optimizer.finalize_variable_values(self.trainable)

  def trainable_changed(self):
    """Names of this stage's layers whose `trainable` changed since compile."""
    now = set(id(v) for v in self.model.trainable_variables)
    then = set(self._split[0])
    return [l.name for l in self.model.layers
            if any((id(v) in now) != (id(v) in then) for v in l.weights)]
