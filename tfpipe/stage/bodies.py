"""A stage's task bodies: the stage call on the weights a task reads, its gradients, the last
stage's step, inference; what `StageProgram.task` traces (once per signature) or inlines.

`TaskBodies` is a part of `tfpipe.stage.program.StageProgram`, written apart: it reads the
program's state (`model`, `device`, `sources`, `updates`, `reports`, its split of the
model's variables) and is not built on its own.
"""

import contextlib
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Mapping, Optional,
                    Sequence, Tuple)

import keras
import tensorflow as tf

from tfpipe.plan import policies, tasks
from tfpipe.stage import reduction
from tfpipe.stage.logs import Logs
from tfpipe.stage.updates import Updates
from tfpipe.stage.weights import WeightSources

if TYPE_CHECKING:
  from tfpipe.stage.mirrors import Mirrors
from tfpipe.stage.kept import scaled, summed

__all__ = ["TaskBodies"]

Part = Tuple[Sequence[Any], Sequence[Any]]   # a recomputed forward's (inputs, state read)
Called = Tuple[List[Any], Any, Sequence[Any]]   # a stage call's (outputs, regularisation, state)

_NONE = tf.UnconnectedGradients.NONE


class TaskBodies:
  """The task bodies and the gradient arithmetic of a `StageProgram` (see the module)."""

  # What the bodies read of the program they are part of (`StageProgram` sets them).
  index: int
  model: Any
  device: str
  replica_devices: List[str]
  cross_device_ops: Any
  groups_in: int
  groups_out: int
  grouped_in: bool
  grouped_out: bool
  is_first: bool
  loss: Any
  ops: Mapping[str, tasks.StageOp]
  policy: policies.WeightPolicy
  reports: Logs
  reg_tracker: Any
  trainable: List[Any]
  non_trainable: List[Any]
  sources: WeightSources
  updates: Updates
  mirrors: Optional["Mirrors"]
  _pairs: List[Tuple[Any, Any]]
  _split: Tuple[List[int], List[int]]
  _inline: bool
  _float_in: List[bool]
  _float_out: List[bool]
  _outputs_dtype: Any
  task: Callable[..., Callable[..., Any]]

  # Weights and the stage call.

  def _call(self, weights: Sequence[Any], xs: Sequence[Any], training: bool,
            update_state: bool = True, state: Optional[Sequence[Any]] = None,
            recomputed: bool = False) -> Called:
    """The stage on `xs` with `weights`; returns (outputs, regularisation, state read).
    `recomputed`: a backward's recompute, whose gradient is taken once.

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
          self.cross_device_ops, self.groups_in, self.groups_out,
          # A kept forward of a split backward, whose halves take the gradient apart (but
          # inlined in one walk).
          persistent=(self.ops["B"].op == "backward_input" and not self._inline
                      and not recomputed))
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

  def _model_split(self) -> Tuple[List[int], List[int]]:
    """Which of this stage's variables Keras now lists as trainable (ids, in its order)."""
    return ([id(v) for v in self.model.trainable_variables],
            [id(v) for v in self.model.non_trainable_variables])

  def _as_model_split(self, weights: Sequence[Any],
                      state: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
    """`weights` and `state` (the compile-time split) as Keras's lists are after a layer's
    `trainable` changed: predict and evaluate still read every variable's own value
    (`Pipeline.fit` asks for a new compile)."""
    values = {id(src): value for (src, _), value in zip(self._pairs, list(weights) + list(state))}
    return ([values[id(v)] for v in self.model.trainable_variables],
            [values[id(v)] for v in self.model.non_trainable_variables])

  def _from_model_split(self, new_state: Sequence[Any], state: Sequence[Any]) -> List[Any]:
    """The non-trainable values after a call, back in the compile-time order."""
    values = {id(v): value for v, value in zip(self.model.non_trainable_variables, new_state)}
    sources = [src for src, _ in self._pairs[len(self.trainable):]]
    return [values.get(id(src), old) for src, old in zip(sources, state)]

  def _float_inputs(self, xs: Sequence[Any]) -> List[Any]:
    return [] if self.is_first else [x for x, f in zip(xs, self._float_in) if f]

  def _gradient(self, tape: tf.GradientTape, targets: Any, sources: Sequence[Any], n_weights: int,
                output_gradients: Any = None) -> List[Any]:
    """`tape.gradient(targets, sources)`, where the first `n_weights` sources are the stage's
    weights (`_connected`)."""
    grads = tape.gradient(targets, sources, output_gradients=output_gradients,
                          unconnected_gradients=_NONE)
    return self._connected(grads, sources, n_weights)

  def _connected(self, grads: Sequence[Any], sources: Sequence[Any], n_weights: int) -> List[Any]:
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

  def _input_grads(self, grads: Sequence[Any]) -> List[Any]:
    """Gradients for every stage input (None for integer inputs); none for stage 0."""
    if self.is_first:
      return []
    taken = iter(grads)
    return [next(taken) if f else None for f in self._float_in]

  def _targets(self, ys: Sequence[Any], dys: Sequence[Any], reg: Any,
               scale: Any) -> Tuple[List[Any], List[Any]]:
    pairs = [(y, dy if dy is not None else tf.zeros_like(y))
             for y, dy, f in zip(ys, dys, self._float_out) if f]
    # The regularisation's gradient weighs as the loss's: the micro-batch's share, and the
    # loss scale where the loss is scaled (the output gradients `dys` carry it already).
    return ([y for y, _ in pairs] + [reg],
            [dy for _, dy in pairs] + [self._loss_scaled(tf.ones_like(reg)
                                                         * tf.cast(scale, reg.dtype))])

  def _read_weights(self, s: Any) -> List[Any]:
    """The forward's weights as tensors of their own: what a kept forward or a blend reads
    (the last stage: its step's)."""
    with tf.device(self.device):
      return [tf.identity(w) for w in self.sources.forward(s)]

  def _forward(self, xs: Sequence[Any], s: Any) -> Called:
    """The training forward on the weights it reads: (outputs, regularisation, the
    non-trainable state read: kept for a recompute)."""
    with tf.device(self.device):
      return self._call(self.sources.read(s, self.ops["F"].reads), xs, training=True)

  def _forward_on(self, weights: Sequence[Any],
                  xs: Sequence[Any]) -> Called:
    """The training forward on `weights` (tensors): (outputs, regularisation, state read)."""
    with tf.device(self.device):
      return self._call(weights, xs, training=True)

  def _backward_on(self, kept_weights: Optional[Sequence[Any]], parts: Sequence[Part],
                   dys: Sequence[Any], s: Any, scale: Any, accumulate: bool, wrt: str,
                   inline: bool = False) -> List[Any]:
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

  def _joined_grads(self, weights: Sequence[Any], parts: Sequence[Part], dys: Sequence[Any],
                    scale: Any, wrt: str) -> Tuple[List[Any], List[Any]]:
    """(weight gradients, input gradients) of the parts' forwards traced side by side, their
    outputs joined along the batch axis."""
    float_xs = [x for xs, _ in parts for x in self._float_inputs(xs)]
    # Only what the gradient is taken of: an input half's tape that saw the weights would run
    # the replicas' own updates (`cross_device_ops="ring"`, their copies' gradient) as well.
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      tape.watch((list(weights) if wrt != "inputs" else []) + float_xs)
      outs = [self._call(weights, xs, training=True, update_state=False, state=state,
                         recomputed=True)
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

  def _summed_grads(self, weights: Sequence[Any], parts: Sequence[Part], dys: Sequence[Any],
                    scale: Any, wrt: str, inline: bool) -> Tuple[List[Any], List[Any]]:
    """(weight gradients, input gradients) of the parts' forwards, one `part_grads` call
    each: the weight gradients summed, the input gradients joined along the batch axis."""
    sizes = [tf.shape(xs[0])[0] for xs, _ in parts]
    dys = [[None] * len(parts) if dy is None else tf.split(dy, sizes) for dy in dys]
    call = self.task("part_grads", inline)
    zero = tf.zeros((), tf.float32)
    results = [call(weights, xs, state, [dy[i] for dy in dys],
                    tf.cast(scale, tf.float32) if i == 0 else zero, wrt)
               for i, (xs, state) in enumerate(parts)]
    weight_grads = [summed(list(g)) for g in zip(*[r[0] for r in results])]
    input_grads = [tf.concat(list(g), 0) for g in zip(*[r[1] for r in results])]
    return weight_grads, input_grads

  def _part_grads(self, weights: Sequence[Any], xs: Sequence[Any], state: Sequence[Any],
                  dys: Sequence[Any], reg_scale: Any, wrt: str) -> Tuple[List[Any], List[Any]]:
    """One part of a recomputing backward (`_joined_grads` of that part alone): its forward
    on `weights` replaying `state`, then (weight gradients, input gradients) `wrt`, its
    regularisation weighted by `reg_scale` (0: a later part's, counted by the first)."""
    with tf.device(self.device):
      return self._joined_grads(weights, [(xs, state)], dys, reg_scale, wrt)

  def _last_step(self, xs: Sequence[Any], y: Any, sample_weight: Any, s: Any, scale: Any,
                 accumulate: bool) -> Tuple[Any, List[Any], Dict[str, Any]]:
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
        in_tape = self._scales_loss(total.dtype, ys)
        target = self._loss_scaled(total * tf.cast(scale, total.dtype) if in_tape else total)
      with self._replicas_scaled(None if in_tape else scale):
        grads = self._gradient(tape, target, weights + float_xs, len(weights))
      if not in_tape:
        grads = [scaled(g, scale) for g in grads]
      self.updates.update_after(grads[len(weights):], grads[:len(weights)], accumulate, weights)
      self.reports.update(y_true, y_pred, total, sample_weight)
      return total, self._input_grads(grads[len(weights):]), self.reports.results(in_task=True)

  def _step_on(self, weights: Sequence[Any], xs: Sequence[Any], y: Any, sample_weight: Any,
               scale: Any) -> Tuple[Any, Any, Dict[str, Any]]:
    """The last stage's forward, loss and metrics on `weights` (tensors), for a split step
    (`last_step_input`): (the target of its gradients, the loss, the running logs)."""
    with tf.device(self.device):
      ys, reg, _ = self._call(weights, xs, training=True)
      y_true, y_pred = self.reports.structured(ys, y)
      loss = self.loss(y_true, y_pred, sample_weight=sample_weight)
      total = loss + tf.cast(reg, loss.dtype)
      # As `_last_step`: a loss of another dtype than the outputs scales the gradients.
      in_tape = self._scales_loss(total.dtype, ys)
      target = self._loss_scaled(total * tf.cast(scale, total.dtype) if in_tape else total)
      self.reports.update(y_true, y_pred, total, sample_weight)
      return target, total, self.reports.results(in_task=True)

  def _scales_loss(self, loss_dtype: Any, ys: Optional[Sequence[Any]] = None) -> bool:
    """Whether the last stage's step scales its loss by the micro-batch's share inside the
    tape (a loss in the outputs' dtype) or its gradients after it: Keras's CompileLoss
    returns floatx (float32), and a float64 model's share (like 5/18) then scales its
    gradients in float64, not rounded to float32 (1e-8 relative). Read from the stage's
    outputs as built, so a split step's halves decide alike; `ys`, the outputs traced, must
    agree."""
    if ys is not None and ys[0].dtype != self._outputs_dtype:
      raise AssertionError(f"stage {self.index} outputs {ys[0].dtype}, built as "
                           f"{self._outputs_dtype}")
    return bool(tf.as_dtype(loss_dtype) == self._outputs_dtype)

  def _replicas_scaled(self, scale: Any) -> ContextManager[Any]:
    """The replicas' own gradients (`mirrors`) scaled as this stage's are after the tape."""
    if self.mirrors is None or scale is None:
      return contextlib.nullcontext()
    return self.mirrors.scaled(scale)

  def _loss_scaled(self, loss: Any) -> Any:
    """The backward's target: `loss` times the pipeline's loss scale (`tfpipe.rules.joint`),
    if any."""
    joint = self.updates.joint
    return joint.scaled_loss(loss) if joint is not None else loss

  def _infer(self, xs: Sequence[Any]) -> List[Any]:
    with tf.device(self.device):
      return self._call(self.sources.read(0, "current"), xs, training=False)[0]

  def _evaluate_last(self, xs: Sequence[Any], y: Any, sample_weight: Any) -> Dict[str, Any]:
    """Loss and metrics of a batch with the current weights; returns the running logs."""
    with tf.device(self.device):
      ys, reg, _ = self._call(self.sources.read(0, "current"), xs, training=False)
      y_true, y_pred = self.reports.structured(ys, y)
      loss = self.loss(y_true, y_pred, sample_weight=sample_weight) + reg
      self.reports.update(y_true, y_pred, loss, sample_weight)
      return self.reports.results(in_task=True)
