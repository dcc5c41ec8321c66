"""Whole-model decisions across stages, made once per mini-batch: global-norm clipping,
dynamic loss scaling, and the gradients of weights that several stages hold.

Keras decides some things over the whole model's gradient: `global_clipnorm` clips every
gradient by the norm of all of them, and `LossScaleOptimizer` (what `compile` wraps the
optimizer in for a mixed_float16 model) skips the step when any gradient is not finite. A
synchronous schedule (`tfpipe.SYNCHRONOUS_METHODS`) has every stage's gradient of mini-batch
b accumulated before any stage applies it, when the schedule is built with joint updates
(`schedules.jointly_updated`: the verifier, the compiled windows and the threaded executor
then let no stage's update U(b) run before every stage's backwards of b). The first stage to
reach its update of b decides for all, from every stage's accumulated gradient A_k (already
summed over its replicas):

    loss scaling (scale S, the last stage's loss multiplied by S before its backward):
      finite_b = every A_k finite
      finite:  the step runs on A_k / S; after `growth_steps` finite steps in a row S doubles
      else:    every stage skips the step; S halves
    clipping (Keras's `clip_by_global_norm`, on the unscaled gradient):
      n = sqrt(sum over k of ||A_k / S||^2)   (an embedding's IndexedSlices rows counted one
                                               by one, as Keras counts them)
      c_b = clip * min(1 / n, 1 / clip)       (NaN when n is not finite, as in Keras)

    weights held by several stages (a layer called on each, as a causal LM's head calls the
    token embedding again; `partition.shared_weights`), as Megatron-LM trains a tied
    embedding: each stage holds a copy, and every copy steps with the sum of the copies'
    gradients, so the copies stay equal (and count once in n)

It records the factor c_b / S and finite_b with a ticket (the updates every stage has run:
equal on a synchronous schedule), so each later update of b reads the same decision, across
the compiled executor's windows too; in the threaded executor the updates take a lock while
they decide (`JointDecision.lock`). Every stage's update then applies c_b / S * A_k, or skips
when not finite_b.

An asynchronous method updates its stages from different mini-batches at different times:
there is no one gradient to decide over, and `compile` refuses both there, naming the
schedules that take them.
"""

import threading
from typing import Any, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

__all__ = ["JointDecision", "check", "loss_scaling"]

# Keras's LossScaleOptimizer defaults, for the optimizer `compile` wraps for mixed_float16.
INITIAL_SCALE, GROWTH_STEPS = 2.0 ** 15, 2000


def loss_scaling(model, optimizer, auto_scale_loss):
  """(inner optimizer, initial scale, growth steps) when training scales the loss: an explicit
  `keras.optimizers.LossScaleOptimizer`, or a mixed_float16 model with `auto_scale_loss` (as
  `keras.Model.compile` wraps it); None otherwise."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    return optimizer.inner_optimizer, optimizer.initial_scale, optimizer.dynamic_growth_steps
  if auto_scale_loss and model.dtype_policy.name == "mixed_float16":
    return optimizer, INITIAL_SCALE, GROWTH_STEPS
  return None


def check(optimizer, scaling, method, synchronous):
  """Refuses, in one line, a whole-model decision on a method whose updates are not joint."""
  if method in synchronous:
    return
  clip = getattr(optimizer, "global_clipnorm", None)
  if clip:
    what = f"global_clipnorm={clip}"
  elif scaling is not None:
    what = ("loss scaling (a LossScaleOptimizer, or a mixed_float16 model, which Keras trains "
            "with one)")
  else:
    return
  hint = ("clipnorm (per variable) or clipvalue" if clip else
          "the mixed_bfloat16 policy (no loss scaling) or float32")
  raise ValueError(
      f"{what} needs every stage's gradient of a mini-batch before any stage updates, which "
      f"method {method!r} (asynchronous) never has: use one of the synchronous schedules "
      f"({', '.join(synchronous)}), or {hint}")


class JointDecision:
  """Each mini-batch's decision, made once across `programs` (see the module).

  `clip`: Keras's `global_clipnorm`, or None. `scaling`: (initial scale, growth steps), or
  None. `device`: where the decision's variables live.
  """

  def __init__(self, clip: Optional[float], scaling: Optional[Tuple[float, int]], device: str,
               shared: Sequence[Sequence[Tuple[int, int]]] = ()) -> None:
    self.clip = float(clip) if clip else None
    self.scaling = scaling
    self.shared = tuple(shared)
    self.programs, self.sums, self._group_of = [], [], {}
    self.lock = threading.Lock()
    with tf.device(device):
      self.decided_for = tf.Variable(tf.constant(-1, tf.int64), trainable=False,
                                     name="joint_decided_for")
      self.factor = tf.Variable(1.0, trainable=False, name="joint_factor")
      self.finite = tf.Variable(True, trainable=False, name="joint_finite")
      initial, self.growth_steps = scaling or (1.0, 0)
      self.scale = tf.Variable(float(initial), trainable=False, name="loss_scale")
      self.step_counter = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                      name="loss_scale_step_counter")

  def state(self) -> List[Any]:
    """The decision's variables (what an update changes)."""
    return [self.decided_for, self.factor, self.finite, self.scale, self.step_counter] + self.sums

  def set_programs(self, programs: Sequence[Any]) -> None:
    """The stages deciding together (their `tfpipe.stage.updates.Updates`); for each shared
    weight, a variable on its first stage's device that holds the sum of its copies'
    gradients once decided."""
    self.programs = list(programs)
    self.sums = []
    for g, group in enumerate(self.shared):
      k, j = group[0]
      v = self.programs[k].trainable[j]
      with tf.device(self.programs[k].device):
        self.sums.append(tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                     name=f"joint_shared{g}"))
      for member in group:
        self._group_of[member] = g

  def shared_gradient(self, k: int, j: int) -> Any:
    """The summed gradient of stage k's trainable weight j where that weight is shared (read
    after `decide`), else None."""
    g = self._group_of.get((k, j))
    return None if g is None else self.sums[g].read_value()

  def _squares(self, scale: Any) -> List[Any]:
    """The squared norms of the whole model's (unscaled) gradient, each shared weight once;
    each stage's on its own device (one scalar crosses devices, not the gradient)."""
    out = []
    for p in self.programs:
      with tf.device(p.device):
        norms = [tf.identity(q) for q in p.squared_norms(scale)]
      for j, q in enumerate(norms):
        g = self._group_of.get((p.index, j))
        if g is None:
          out.append(q)
        elif self.shared[g][0] == (p.index, j):   # the group's first copy counts for all
          members = self.shared[g]
          with tf.device(p.device):
            if all(j2 in self.programs[k2].sliced for k2, j2 in members):
              out.append(tf.add_n([self.programs[k2].squared_norms(scale)[j2]
                                   for k2, j2 in members]))
            else:
              out.append(tf.reduce_sum(tf.square(tf.cast(self._sum(g), tf.float32) / scale)))
    return out

  def _sum(self, g: int) -> Any:
    """The summed gradient of shared weight g, on its first copy's device."""
    with tf.device(self.programs[self.shared[g][0][0]].device):
      return tf.add_n([tf.convert_to_tensor(self.programs[k].accumulators[j])
                       for k, j in self.shared[g]])

  def scaled_loss(self, loss: Any) -> Any:
    """`loss` times the loss scale (the last stage's target, before its backward)."""
    if self.scaling is None:
      return loss
    return loss * tf.cast(self.scale.read_value(), loss.dtype)

  def decide(self, ticket: Any) -> Tuple[Any, Any]:
    """(factor, finite) of the mini-batch whose updates hold `ticket` (an int64 tensor: the
    updates the stage has run), decided by the first update that asks."""
    ticket = tf.cast(ticket, tf.int64)

    def decide() -> Tuple[Any, Any]:
      scale = self.scale.read_value()
      finite = tf.constant(True)
      if self.scaling is not None:   # each stage's verdict on its own device
        verdicts = []
        for p in self.programs:
          with tf.device(p.device):
            verdicts.append(tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(a))
                                                    for a in p.accumulators])))
        finite = tf.reduce_all(tf.stack(verdicts))
      factor = 1.0 / scale
      if self.clip is not None:
        norm = tf.sqrt(tf.add_n(self._squares(scale)))
        factor = factor * (self.clip * tf.minimum(1.0 / norm, 1.0 / self.clip) + (norm - norm))
      updates = [self.factor.assign(factor), self.finite.assign(finite),
                 self.decided_for.assign(ticket)]
      updates += [total.assign(self._sum(g)) for g, total in enumerate(self.sums)]
      if self.scaling is not None:
        grow = tf.logical_and(finite, tf.equal(self.step_counter, self.growth_steps - 1))
        updates += [
            self.scale.assign(tf.where(finite, tf.where(grow, scale * 2.0, scale), scale * 0.5)),
            self.step_counter.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)),
                                              self.step_counter + 1, tf.zeros_like(ticket)))]
      with tf.control_dependencies(updates):
        return tf.identity(factor), tf.identity(finite)

    return tf.cond(tf.equal(self.decided_for.read_value(), ticket),
                   lambda: (tf.identity(self.factor.read_value()),
                            tf.identity(self.finite.read_value())), decide)
