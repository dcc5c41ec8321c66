"""How a stage applies its weight gradients.

At once: the optimizer's step with the stage's rule (`tfpipe.rules.mitigations.StageRule`:
spike compensation, PipeMare's rescheduling and average weight change, Nesterov's look-ahead),
on gradients DC-ASGD first moves from the weights they were taken at to the current ones.
Or, with micro-batches, added into accumulators and applied once (`apply_accumulated`),
through a whole-model decision (`tfpipe.rules.joint`: global-norm clipping, loss scaling,
weights shared across stages) where one is set (`joint`).

An embedding's gradient comes as rows (IndexedSlices: one row per token read, a token read
twice twice). Keras's optimizer takes the whole batch's rows: Adam squares each row before
summing a token's, and SGD subtracts only the rows. Summed into a dense accumulator, a
token's rows would be squared once, summed: Adam's second moment, and with it the update,
differs from Keras's. So for a synchronous schedule an embedding's accumulator keeps the
micro-batches' rows (`rows`) and the update hands the optimizer all of them, as Keras
would see the batch. Where Keras makes the gradient dense itself (global-norm clipping and
loss scaling multiply it by a tensor), or the replicas keep their own copies (the ring sums
dense chunks), it stays dense.
"""

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from tfpipe import compat
from tfpipe.rules import mitigations
from tfpipe.stage.weights import WeightSources

if TYPE_CHECKING:
  from tfpipe.rules.joint import JointDecision
  from tfpipe.stage.mirrors import Mirrors

__all__ = ["Updates"]


class Updates:
  """Stage `index`'s updates of the variables of `sources` (`tfpipe.stage.weights`) on
  `device` with `optimizer` and `rule`."""

  def __init__(self, index: int, device: str, optimizer: Any, rule: mitigations.StageRule,
               sources: WeightSources, rows: Sequence[int] = ()) -> None:
    self.index, self.device, self.optimizer, self.rule = index, device, optimizer, rule
    self.sources, self.trainable = sources, sources.trainable
    self.accumulators: Optional[List[Any]] = None   # `build_accumulators`
    self.row_weights = tuple(rows)   # indices of weights whose gradient may come as rows
    # A whole-model decision the stages share (`tfpipe.rules.joint`), or None.
    self.joint: Optional["JointDecision"] = None
    # The other replicas' copies (`tfpipe.stage.mirrors`), or None.
    self.mirrors: Optional["Mirrors"] = None
    # The weights the loss does not depend on (their gradient unconnected, noted while the
    # backward traces: `StageProgram`): Keras's optimizer steps only the others.
    self.unused: Set[int] = set()
    # The optimizer step, traced once per signature wherever an update is traced. Not marked
    # NOT_INLINED: TensorFlow inlines the call when it runs the graph, so an inlined window
    # holds one call op per update rather than a Python trace of the optimizer each time
    # (a shorter first epoch, measured: `bench/results/history.md`, "Figures the code cited").
    self._apply_step = compat.own_function(self._step, reduce_retracing=True,
                                             autograph=False)

  def build_accumulators(self) -> None:
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
      self.sliced: Set[int] = set()   # the variables whose gradients came as IndexedSlices
      self.joint_updates = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                       name=f"s{index}_joint_updates")
      # The rows (values, indices) of an embedding's micro-batch gradients, empty between
      # updates; and which weights' gradients were seen as rows, which dense (traces).
      self.rows = {j: (tf.Variable(tf.zeros([0] + values[j].shape[1:], values[j].dtype),
                                   shape=tf.TensorShape([None] + values[j].shape[1:]),
                                   trainable=False, name=f"s{index}_rows{j}"),
                       tf.Variable(tf.zeros([0], tf.int64), shape=tf.TensorShape([None]),
                                   trainable=False, name=f"s{index}_row_indices{j}"))
                   for j in self.row_weights}
      self.seen_rows: Set[int] = set()
      self.seen_dense: Set[int] = set()

  def _accumulated(self) -> List[Any]:
    """The accumulators (`build_accumulators` made them)."""
    assert self.accumulators is not None
    return self.accumulators

  def _joint(self) -> "JointDecision":
    """The whole-model decision (where the update reads it, there is one)."""
    assert self.joint is not None
    return self.joint

  def state(self) -> List[Any]:
    """Every variable of this stage an update changes besides the weights: the optimizer's
    (its step count, its slots), the accumulators and what they keep, the stage's derived
    weights, as of now (the whole-model decision's: `joint.state()`, shared)."""
    own = [] if self.accumulators is None else (
        self.accumulators + self.read_sums + [self.reads] + self.slice_squares
        + [self.joint_updates] + [v for pair in self.rows.values() for v in pair])
    mirrored = self.mirrors.state() if self.mirrors is not None else []
    return (list(self.optimizer.variables) + own + self.sources.deltas + self.sources.previous
            + mirrored)

  def read(self, weights: Optional[Sequence[Any]]) -> Optional[List[Any]]:
    """The weights a gradient was taken at, where the update needs them (DC-ASGD), else None."""
    return list(weights) if self.rule.delay_compensation and weights is not None else None

  def update(self, grads: Sequence[Any], accumulate: bool,
             read: Optional[Sequence[Any]] = None) -> None:
    """One update with `grads` taken at the weights `read` (DC-ASGD moves them to the
    current ones), or their addition to the accumulators (with `read`, to the mean of the
    reads: the accumulated gradient is compensated from there at the update)."""
    with tf.device(self.device):
      if not accumulate:
        self._apply_step(list(grads), read)
        return
      for j, (a, g) in enumerate(zip(self._accumulated(), grads)):
        if self._keeps_rows(j, g):
          values, indices = self.rows[j]
          values.assign(tf.concat([values, tf.cast(g.values, values.dtype)], 0))
          indices.assign(tf.concat([indices, tf.cast(g.indices, tf.int64)], 0))
          continue
        if j in self.rows:
          self.seen_dense.add(j)
        a.assign_add(tf.cast(g, a.dtype))
      if self.joint is not None:
        self._add_slice_squares(grads)
      if read is not None:
        for r, w in zip(self.read_sums, read):
          r.assign_add(w)
        self.reads.assign_add(1.0)

  def update_after(self, outputs: Sequence[Any], grads: Sequence[Any], accumulate: bool,
                   read: Optional[Sequence[Any]] = None) -> None:
    """The update with `grads`, run only once a task's `outputs` (its input gradients) are
    computed. Without the order TensorFlow may run the update first and the input gradients
    then read the updated weights (measured: 1 whole backward in 12 gave other input
    gradients than its two halves)."""
    with tf.control_dependencies([g for g in outputs if g is not None]):
      self.update([tf.identity(g) for g in grads], accumulate, self.read(read))

  def apply_accumulated(self) -> None:
    """One update with the accumulated gradients, which it clears."""
    with tf.device(self.device):
      self.sources.keep_previous()
      grads = [tf.convert_to_tensor(a) for a in self._accumulated()]
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
      grads = self._with_rows(grads)
      grads, applied = self._replicas_reduced(grads)
      with tf.control_dependencies(applied):
        self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas,
                        self.unused)
      self._clear()

  def squared_norms(self, scale: Any) -> List[Any]:
    """The squares of the accumulated gradient divided by `scale` (the loss scale) as
    Keras's `global_clipnorm` counts them: a dense gradient's sum of squares, an
    IndexedSlices gradient's per row."""
    return [self.slice_squares[j] / (scale * scale) if j in self.sliced
            else tf.reduce_sum(tf.square(tf.cast(a, tf.float32) / scale))
            for j, a in enumerate(self._accumulated())]

  def rows_kept(self) -> bool:
    """Whether embeddings' rows are kept: no whole-model decision and no replicas' own
    copies (either makes the gradient dense). Where the stage keeps rows at all, see
    `row_weights` (a synchronous schedule's: `tfpipe.stage.program`)."""
    return self.joint is None and self.mirrors is None

  def _keeps_rows(self, j: int, g: Any) -> bool:
    """Whether weight j's gradient `g` joins its rows (`rows`): an embedding's rows, where
    `rows_kept`."""
    keep = isinstance(g, tf.IndexedSlices) and j in self.rows and self.rows_kept()
    if keep:
      self.seen_rows.add(j)
    return keep

  def _with_rows(self, grads: Sequence[Any]) -> List[Any]:
    """`grads` (the dense accumulators read) with each embedding's rows as IndexedSlices: its
    rows alone where only rows were traced; followed by the dense accumulator's, one row per
    vocabulary entry, where a dense gradient was seen too or none was traced yet (a zero row
    adds nothing to any optimizer's sums of squares, signs or rows)."""
    grads = list(grads)
    if not self.rows_kept():
      return grads
    for j, (values, indices) in self.rows.items():
      if j in self.seen_dense and j not in self.seen_rows:
        continue
      rows = tf.IndexedSlices(tf.convert_to_tensor(values), tf.convert_to_tensor(indices),
                              tf.shape(grads[j], out_type=tf.int64))
      if j in self.seen_dense or j not in self.seen_rows:
        dense = grads[j]
        n = tf.shape(dense, out_type=tf.int64)[0]
        rows = tf.IndexedSlices(tf.concat([rows.values, dense], 0),
                                tf.concat([rows.indices, tf.range(n)], 0), rows.dense_shape)
      grads[j] = rows
    return grads

  def _clear(self) -> None:
    for a in self._accumulated():
      a.assign(tf.zeros_like(a))
    for values, indices in self.rows.values():
      values.assign(values[:0])
      indices.assign(indices[:0])
    for j in self.sliced:
      self.slice_squares[j].assign(0.0)

  def _apply_joint(self, grads: Sequence[Any]) -> None:
    """The update of a whole-model decision: the accumulated gradients times the mini-batch's
    factor (unscaled, clipped), or no step where a gradient was not finite; the accumulators
    cleared either way."""
    factor, finite = self._joint().decide(self.joint_updates)
    with tf.control_dependencies([factor, finite]):
      self.joint_updates.assign_add(1)
      # A weight other stages hold too steps with the sum of every copy's gradient.
      shared = [self._joint().shared_gradient(self.index, j) for j in range(len(grads))]
      if self.mirrors is not None and any(s is not None for s in shared):
        raise ValueError(f"stage {self.index} shares weights with another stage (tied): its "
                         "replicas' own copies (cross_device_ops='ring') cannot take the other "
                         "stage's gradient; pass cross_device_ops='reduce_to_one_device'")
      grads = [g if s is None else s for g, s in zip(grads, shared)]
    grads = [g * tf.cast(factor, g.dtype) for g in grads]
    # A shared weight this stage does not read still steps with its other copies' sum.
    unused = {j for j in self.unused if shared[j] is None}
    applied = self._mirrors_applied(factor, None if self._joint().scaling is None else finite)
    with tf.control_dependencies(applied):
      self._apply_joint_step(grads, finite, unused)
    self._clear()

  def _apply_joint_step(self, grads: Sequence[Any], finite: Any, unused: Set[int]) -> None:
    if self._joint().scaling is None:
      self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas, unused)
    else:
      def step() -> tf.Tensor:
        self.rule.apply(self.optimizer, grads, self.trainable, self.sources.deltas, unused)
        return tf.constant(True)
      tf.cond(finite, step, lambda: tf.constant(False))

  def _replicas_reduced(self, grads: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
    """(this stage's gradients summed over its replicas, what its update waits for): the
    replicas' own updates (`tfpipe.stage.mirrors`) first, with the ring's sums where each
    replica kept its own part; `grads` and [] without replicas of their own."""
    if self.mirrors is None:
      return list(grads), []
    if self.mirrors.summing():   # each backward summed them already
      return list(grads), self.mirrors.apply()
    grads, sums = self.mirrors.reduce(grads)
    return grads, self.mirrors.apply(sums=sums)

  def _mirrors_applied(self, factor: Any = None, finite: Any = None) -> List[Any]:
    """The other replicas' update (`tfpipe.stage.mirrors`) first: what the stage's own update
    then waits for ([] without replicas of their own)."""
    return [] if self.mirrors is None else self.mirrors.apply(factor, finite)

  def _add_slice_squares(self, grads: Sequence[Any]) -> None:
    """For the global norm: the squares of an embedding's gradient rows as Keras sums them,
    each row of its IndexedSlices apart (a token seen twice counts twice; the dense sum of
    those rows, which the accumulator holds, would count it once, squared). Replicas with
    their own copies sum their gradients dense: they add the rows' squares themselves
    (`Mirrors.gradients`)."""
    for j, g in enumerate(grads):
      if isinstance(g, tf.IndexedSlices):
        self.sliced.add(j)
        self.slice_squares[j].assign_add(tf.reduce_sum(tf.square(tf.cast(g.values, tf.float32))))

  def _step(self, grads: Sequence[Any], read: Optional[Sequence[Any]]) -> None:
    """The optimizer's step (with the stage's rule) on gradients taken at `read`."""
    self.sources.keep_previous()
    grads, applied = self._replicas_reduced(grads)
    with tf.control_dependencies(applied):
      self.rule.apply(self.optimizer, self._compensated(grads, read), self.trainable,
                      self.sources.deltas, self.unused)

  def _compensated(self, grads: Sequence[Any], read: Optional[Sequence[Any]]) -> List[Any]:
    """DC-ASGD: weight gradients taken at `read`, moved to the current weights; as they are
    without `delay_compensation`."""
    if read is None:
      return list(grads)
    lam = self.rule.delay_compensation
    return [mitigations.compensate(tf.cast(lam, g.dtype), g, tf.convert_to_tensor(v), w)
            for g, v, w in zip(grads, self.trainable, read)]
