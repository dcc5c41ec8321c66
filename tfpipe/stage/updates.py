"""How a stage applies its weight gradients.

At once: the optimizer's step with the stage's rule (`tfpipe.rules.mitigations.StageRule`:
spike compensation, PipeMare's rescheduling and average weight change, Nesterov's look-ahead),
on gradients DC-ASGD first moves from the weights they were taken at to the current ones.
Or, with micro-batches, added into accumulators and applied once (`apply_accumulated`),
through a whole-model decision (`tfpipe.rules.joint`: global-norm clipping, loss scaling,
weights shared across stages) where one is set (`joint`).
"""

import tensorflow as tf

from tfpipe import compat
from tfpipe.rules import mitigations

__all__ = ["Updates"]


class Updates:
  """Stage `index`'s updates of the variables of `sources` (`tfpipe.stage.weights`) on
  `device` with `optimizer` and `rule`."""

  def __init__(self, index, device, optimizer, rule, sources):
    self.index, self.device, self.optimizer, self.rule = index, device, optimizer, rule
    self.sources, self.trainable = sources, sources.trainable
    self.accumulators = None
    self.joint = None   # a `tfpipe.rules.joint.JointDecision` the stages share, or None
    self.mirrors = None   # the other replicas' copies (`tfpipe.stage.mirrors`), or None
    # The optimizer step, traced once per signature wherever an update is traced. Not marked
    # NOT_INLINED: TensorFlow inlines the call when it runs the graph, so an inlined window
    # holds one call op per update rather than a Python trace of the optimizer each time
    # (measured, 8 x Dense(32), K=4, 8 mini-batches: first epoch 5.1 s, then 3.5 s).
    self._apply_step = compat.own_function(self._step, reduce_retracing=True,
                                             autograph=False)

  def build_accumulators(self):
    """Creates the gradient accumulators (once) for schedules with micro-batch backwards."""
    if self.accumulators is not None:
      return
    index, values = self.index, [v.value for v in self.trainable]
    with tf.device(self.device):
      self.accumulators = [tf.Variable(tf.zeros_like(v), trainable=False,
                                       name=f"s{index}_accumulator{j}")
                           for j, v in enumerate(values)]
      # DC-ASGD with micro-batches: the sum and count of the weights their gradients read.
      self.read_sums = ([tf.Variable(tf.zeros_like(v), trainable=False,
                                     name=f"s{index}_read_sum{j}")
                         for j, v in enumerate(values)] if self.rule.delay_compensation else [])
      self.reads = tf.Variable(0.0, trainable=False, name=f"s{index}_reads")
      self.slice_squares = [tf.Variable(0.0, trainable=False, name=f"s{index}_slices{j}")
                            for j in range(len(values))]
      self.sliced = set()   # the variables whose gradients came as IndexedSlices
      self.joint_updates = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                       name=f"s{index}_joint_updates")

  def state(self):
    """Every variable of this stage an update changes besides the weights: the optimizer's
    (its step count, its slots), the accumulators and what they keep, the stage's derived
    weights, as of now (the whole-model decision's: `joint.state()`, shared)."""
    own = [] if self.accumulators is None else (
        self.accumulators + self.read_sums + [self.reads] + self.slice_squares
        + [self.joint_updates])
    mirrored = self.mirrors.state() if self.mirrors is not None else []
    return (list(self.optimizer.variables) + own + self.sources.deltas + self.sources.previous
            + mirrored)

  def read(self, weights):
    """The weights a gradient was taken at, where the update needs them (DC-ASGD), else None."""
    return list(weights) if self.rule.delay_compensation and weights is not None else None

  def update(self, grads, accumulate, read=None):
    """One update with `grads` taken at the weights `read` (DC-ASGD moves them to the
    current ones), or their addition to the accumulators (with `read`, to the mean of the
    reads: the accumulated gradient is compensated from there at the update)."""
    with tf.device(self.device):
      if not accumulate:
        self._apply_step(list(grads), read)
        return
      for a, g in zip(self.accumulators, grads):
        a.assign_add(tf.cast(g, a.dtype))
      if self.joint is not None:
        self._add_slice_squares(grads)
      if read is not None:
        for r, w in zip(self.read_sums, read):
          r.assign_add(w)
        self.reads.assign_add(1.0)

  def update_after(self, outputs, grads, accumulate, read=None):
    """The update with `grads`, run only once a task's `outputs` (its input gradients) are
    computed. Without the order TensorFlow may run the update first and the input gradients
    then read the updated weights (measured: 1 whole backward in 12 gave other input
    gradients than its two halves)."""
    with tf.control_dependencies([g for g in outputs if g is not None]):
      self.update([tf.identity(g) for g in grads], accumulate, self.read(read))

  def apply_accumulated(self):
    """One update with the accumulated gradients, which it clears."""
    with tf.device(self.device):
      self.sources.keep_previous()
      grads = [tf.convert_to_tensor(a) for a in self.accumulators]
      if self.joint is not None:   # a whole-model decision
        self._apply_joint(grads)
        return
      if self.rule.delay_compensation:
        n = tf.maximum(tf.convert_to_tensor(self.reads), 1.0)
        grads = self._compensated(grads, [tf.convert_to_tensor(r) / tf.cast(n, r.dtype)
                                          for r in self.read_sums])
        for r in self.read_sums:
          r.assign(tf.zeros_like(r))
        self.reads.assign(0.0)
      grads, applied = self._replicas_reduced(grads)
      with tf.control_dependencies(applied):
        self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas)
      self._clear()

  def squared_norms(self, scale):
    """The squares of the accumulated gradient divided by `scale` (the loss scale) as
    Keras's `global_clipnorm` counts them: a dense gradient's sum of squares, an
    IndexedSlices gradient's per row."""
    return [self.slice_squares[j] / (scale * scale) if j in self.sliced
            else tf.reduce_sum(tf.square(tf.cast(a, tf.float32) / scale))
            for j, a in enumerate(self.accumulators)]

  def _clear(self):
    for a in self.accumulators:
      a.assign(tf.zeros_like(a))
    for j in self.sliced:
      self.slice_squares[j].assign(0.0)

  def _apply_joint(self, grads):
    """The update of a whole-model decision: the accumulated gradients times the mini-batch's
    factor (unscaled, clipped), or no step where a gradient was not finite; the accumulators
    cleared either way."""
    factor, finite = self.joint.decide(self.joint_updates)
    with tf.control_dependencies([factor, finite]):
      self.joint_updates.assign_add(1)
      # A weight other stages hold too steps with the sum of every copy's gradient.
      shared = [self.joint.shared_gradient(self.index, j) for j in range(len(grads))]
      if self.mirrors is not None and any(s is not None for s in shared):
        raise ValueError(f"stage {self.index} shares weights with another stage (tied): its "
                         "replicas' own copies (cross_device_ops='ring') cannot take the other "
                         "stage's gradient; pass cross_device_ops='reduce_to_one_device'")
      grads = [g if s is None else s for g, s in zip(grads, shared)]
    grads = [g * tf.cast(factor, g.dtype) for g in grads]
    applied = self._mirrors_applied(factor, None if self.joint.scaling is None else finite)
    with tf.control_dependencies(applied):
      self._apply_joint_step(grads, finite)
    self._clear()

  def _apply_joint_step(self, grads, finite):
    if self.joint.scaling is None:
      self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas)
    else:
      def step():
        self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas)
        return tf.constant(True)
      tf.cond(finite, step, lambda: tf.constant(False))

  def _replicas_reduced(self, grads):
    """(this stage's gradients summed over its replicas, what its update waits for): the
    replicas' own updates (`tfpipe.stage.mirrors`) first, with the ring's sums where each
    replica kept its own part; `grads` and [] without replicas of their own."""
    if self.mirrors is None:
      return list(grads), []
    if self.mirrors.summing():   # each backward summed them already
      return list(grads), self.mirrors.apply()
    grads, sums = self.mirrors.reduce(grads)
    return grads, self.mirrors.apply(sums=sums)

  def _mirrors_applied(self, factor=None, finite=None):
    """The other replicas' update (`tfpipe.stage.mirrors`) first: what the stage's own update
    then waits for ([] without replicas of their own)."""
    return [] if self.mirrors is None else self.mirrors.apply(factor, finite)

  def _add_slice_squares(self, grads):
    """For the global norm: the squares of an embedding's gradient rows as Keras sums them,
    each row of its IndexedSlices apart (a token seen twice counts twice; the dense sum of
    those rows, which the accumulator holds, would count it once, squared)."""
    for j, g in enumerate(grads):
      if isinstance(g, tf.IndexedSlices):
        self.sliced.add(j)
        self.slice_squares[j].assign_add(tf.reduce_sum(tf.square(tf.cast(g.values, tf.float32))))

  def _step(self, grads, read):
    """The optimizer's step (with the stage's rule) on gradients taken at `read`."""
    self.sources.keep_previous()
    grads, applied = self._replicas_reduced(grads)
    with tf.control_dependencies(applied):
      self.rule.apply(self.optimizer, self._compensated(grads, read), self.trainable,
                      self.sources.deltas)

  def _compensated(self, grads, read):
    """DC-ASGD: weight gradients taken at `read`, moved to the current weights; as they are
    without `delay_compensation`."""
    if read is None:
      return grads
    lam = self.rule.delay_compensation
    return [mitigations.compensate(tf.cast(lam, g.dtype), g, tf.convert_to_tensor(v), w)
            for g, v, w in zip(grads, self.trainable, read)]
