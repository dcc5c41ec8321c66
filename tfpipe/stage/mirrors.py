"""A replicated stage's own copies of its weights: one per replica, kept equal by the update.

With `cross_device_ops="ring"` (synchronous schedules), replica r >= 1 of a
stage holds its weights on its own device, with an optimizer of its own (a
clone of the stage's, its slots there too) and a gradient accumulator. Each
replica keeps its own part of the mini-batch's gradient; the update sums the
parts once by a ring all-reduce (`ring_all_reduce`: every replica sends
2 (R-1)/R of the gradients, to its neighbour only) and every replica applies
the sum to its own copy (replica 0's is the stage's variables). Where a
whole-model decision (global-norm clipping, loss scaling) reads the gradients'
norm first, each backward sums them instead (`summing`), and every replica
applies the same factor.
The sums are the same on every replica (each chunk is reduced once and copied
round the ring), the update the same operations on the same values, so the
copies stay equal with no weights sent. `sync` copies the primary weights and
optimizer state to every replica (at `fit`'s start, after a restore).
"""

import contextlib
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Tuple)

import keras
import tensorflow as tf

from tfpipe import compat
from tfpipe.rules import mitigations

if TYPE_CHECKING:
  from tfpipe.stage.updates import Updates

__all__ = ["Mirrors", "ring_all_reduce"]


def _chunks(flat: tf.Tensor, parts: int) -> List[tf.Tensor]:
  n = flat.shape[0]
  sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
  return list(tf.split(flat, sizes))


def ring_all_reduce(per_replica: Sequence[Sequence[tf.Tensor]],
                    devices: Sequence[str]) -> List[List[tf.Tensor]]:
  """The sum over replicas of each tensor, on every replica's device: `per_replica[r]` is
  replica r's list of tensors (on `devices[r]`); returns [the sums, on devices[r]] per r.
  A reduce-scatter then an all-gather round the ring r -> r+1, each R-1 steps of one chunk
  (1/R of the tensors, flattened per dtype) per replica."""
  R = len(devices)
  shapes = [t.shape for t in per_replica[0]]
  dtypes = sorted({t.dtype for t in per_replica[0]}, key=lambda d: d.name)
  sums = [[None] * len(shapes) for _ in range(R)]
  for dtype in dtypes:
    members = [j for j, t in enumerate(per_replica[0]) if t.dtype == dtype]
    held = []
    for r, device in enumerate(devices):
      with tf.device(device):
        flat = tf.concat([tf.reshape(per_replica[r][j], [-1]) for j in members], 0)
        held.append(list(_chunks(flat, R)))
    for step in range(R - 1):   # reduce-scatter: r adds its chunk (r - step) into r + 1's
      sent = [(r, (r - step) % R, held[r][(r - step) % R]) for r in range(R)]
      for r, c, value in sent:
        with tf.device(devices[(r + 1) % R]):
          held[(r + 1) % R][c] = held[(r + 1) % R][c] + value
    for step in range(R - 1):   # all-gather: r passes its whole chunk (r + 1 - step) on
      sent = [(r, (r + 1 - step) % R, held[r][(r + 1 - step) % R]) for r in range(R)]
      for r, c, value in sent:
        with tf.device(devices[(r + 1) % R]):
          held[(r + 1) % R][c] = tf.identity(value)
    sizes = [shapes[j].num_elements() for j in members]
    for r, device in enumerate(devices):
      with tf.device(device):
        pieces = tf.split(tf.concat(held[r], 0), sizes)
        for j, piece in zip(members, pieces):
          sums[r][j] = tf.reshape(piece, shapes[j])
  return sums


class Mirrors:
  """Replicas 1..R-1's copies of stage `index`'s `trainable` on `devices` (the replicas' after
  the first), each with a clone of `optimizer` and an accumulator; `rule` applies the update.
  `pairs` [(model variable, stage variable)] carry weight-decay exclusions from
  `optimizer_source` (see `tfpipe.compat.copy_weight_decay_exclusions`)."""

  def __init__(self, index: int, trainable: Sequence[Any], optimizer: Any,
               rule: mitigations.StageRule, devices: Sequence[str], optimizer_source: Any = None,
               pairs: Sequence[Tuple[Any, Any]] = (),
               summing: Callable[[], bool] = lambda: False, *, first_device: str) -> None:
    self.first_device = first_device   # replica 0's: the stage's own
    self.devices, self.rule, self.primary = list(devices), rule, (list(trainable), optimizer)
    self.weights: List[List[Any]] = []
    self.optimizers: List[Any] = []
    self.accumulators: List[List[Any]] = []
    self._scale: Any = None
    self.summing = summing   # whether each backward sums over replicas (else: the update)
    self._pending: Dict[int, Tuple[Sequence[Any], List[Any]]] = {}   # replica: (grads, squares)
    # The stage's `Updates`: its weights with no gradient (`unused`), and summing, where the
    # replicas' rows' squares go (its slice squares).
    self.updates: Optional["Updates"] = None
    for r, device in enumerate(self.devices, 1):
      with tf.device(device):
        weights = [keras.Variable(v.numpy(), trainable=True, name=f"s{index}_r{r}_{v.name}")
                   for v in trainable]
        clone = optimizer.__class__.from_config(optimizer.get_config())
        if optimizer_source is not None:
          by_stage = {id(own): src for src, own in pairs}
          compat.copy_weight_decay_exclusions(
              optimizer_source, clone, [(by_stage[id(v)], w) for v, w in zip(trainable, weights)
                                        if id(v) in by_stage])
        clone.build(weights)
        self.accumulators.append([tf.Variable(tf.zeros_like(v.value), trainable=False,
                                              name=f"s{index}_r{r}_accumulator{j}")
                                  for j, v in enumerate(weights)])
      self.weights.append(weights)
      self.optimizers.append(clone)

  def _stage(self) -> "Updates":
    """The stage's `Updates` (set once the stage has made them)."""
    assert self.updates is not None
    return self.updates

  def values(self, after: Sequence[tf.Tensor] = ()) -> List[List[tf.Tensor]]:
    """[replica r's weights as tensors, read on its device] for r = 1..R-1, read only once
    `after` (the stage's own weights, read by the task: the executor orders that read after
    the update, which updates the replicas first) are computed."""
    out = []
    with tf.control_dependencies(list(after)):
      for device, weights in zip(self.devices, self.weights):
        with tf.device(device):
          out.append([tf.identity(tf.convert_to_tensor(w)) for w in weights])
    return out

  def gradients(self, r: int, grads: Sequence[Any],
                squares: Optional[Sequence[Any]] = None) -> Tuple[Sequence[Any], List[Any]]:
    """What replica r's copy returns for the gradient `grads` of its weights, as (gradient of
    its inputs, what its anchor's gradient waits for). Replica 0's runs last. `summing()`
    (a whole-model decision reads the gradients' norms before any update): replica 0 sums
    every replica's by a ring, the others' sums go to their accumulators, its own to the
    stage (its accumulator or update). Else each replica keeps its own part; the update sums
    them once per mini-batch (`reduce`). `squares`: per sparse gradient its rows' sum of
    squares (else None); summing, their sum over replicas is added to the stage's
    (`Updates.slice_squares`: Keras's global norm counts an embedding's rows apart, and the
    sums the stage gets are dense)."""
    squares = list(squares or [None] * len(grads))
    if r > 0:
      if self.summing():
        self._pending[r] = (grads, squares)
        return [None] * len(grads), []
      return [None] * len(grads), self.accumulate([grads], replicas=[r])
    if not self.summing():
      return grads, []
    pending = [self._pending.pop(k) for k in range(1, len(self.devices) + 1)]
    factor = 1.0 if self._scale is None else tf.square(tf.cast(self._scale, tf.float32))
    added = []
    for j, own in enumerate(squares):
      if own is not None:
        with tf.device(self.first_device):
          self._stage().sliced.add(j)
          added.append(self._stage().slice_squares[j].assign_add(
              tf.add_n([own] + [q[j] for _, q in pending]) * factor))
    per_replica = [grads] + [g for g, _ in pending]
    sums = ring_all_reduce(per_replica, [self.first_device] + self.devices)
    with tf.control_dependencies(self.accumulate(sums[1:]) + added):
      return [tf.identity(g) for g in sums[0]], []

  def reduce(self, grads: Sequence[Any]) -> Tuple[List[Any], List[List[Any]]]:
    """Replica 0's gradients `grads` (its own part: its accumulator, or one backward's) and
    every other replica's accumulated part summed by a ring: (replica 0's sum, [replica r's
    sum] for r = 1..R-1). The replicas' accumulators are cleared after."""
    per_replica = [list(grads)]
    for device, accumulators in zip(self.devices, self.accumulators):
      with tf.device(device):
        per_replica.append([tf.convert_to_tensor(a) for a in accumulators])
    sums = ring_all_reduce(per_replica, [self.first_device] + self.devices)
    return sums[0], sums[1:]

  def accumulate(self, sums: Sequence[Sequence[Any]],
                 replicas: Optional[Iterable[int]] = None) -> List[Any]:
    """Adds `sums[r-1]` (replica r's all-reduced gradients, on its device) to its
    accumulator; returns the additions (what the stage's own gradient must wait for: a task
    whose graph is pruned to its outputs keeps them so)."""
    added = []
    replicas = range(1, len(self.devices) + 1) if replicas is None else replicas
    for r, grads in zip(replicas, sums):
      device, accumulators = self.devices[r - 1], self.accumulators[r - 1]
      with tf.device(device):
        for a, g in zip(accumulators, grads):
          g = g if self._scale is None else g * tf.cast(self._scale, g.dtype)
          added.append(a.assign_add(tf.cast(g, a.dtype)))
    return added

  @contextlib.contextmanager
  def scaled(self, scale: Any) -> Iterator[None]:
    """While a tape's gradient is taken (traced): the replicas' gradients times `scale` (None:
    as they are), as the stage scales its own after the tape (a loss of another dtype)."""
    self._scale = scale
    try:
      yield
    finally:
      self._scale = None

  def apply(self, factor: Any = None, finite: Any = None,
            sums: Optional[Sequence[Sequence[Any]]] = None) -> List[tf.Tensor]:
    """Each replica's update with its accumulated gradients (or `sums`, one list per replica:
    `reduce`'s) times `factor` (none where `finite` is False), its accumulator cleared: the
    primary's update, on the same values. Returns the updated weights read back: the stage's
    own update runs after them (`Updates`), so a task that reads the stage's new weights
    reads the replicas' new ones after them."""
    done = []
    for r, (device, weights, optimizer, accumulators) in enumerate(zip(
        self.devices, self.weights, self.optimizers, self.accumulators)):
      with tf.device(device):
        grads = ([tf.convert_to_tensor(a) for a in accumulators] if sums is None
                 else list(sums[r]))
        if factor is not None:
          grads = [g * tf.cast(factor, g.dtype) for g in grads]
        if finite is None:
          self.rule.apply(optimizer, grads, weights, [], self._stage().unused)
        else:
          def step(optimizer: Any = optimizer, grads: List[Any] = grads,
                   weights: List[Any] = weights) -> tf.Tensor:
            self.rule.apply(optimizer, grads, weights, [], self._stage().unused)
            return tf.constant(True)
          tf.cond(finite, step, lambda: tf.constant(False))
        with tf.control_dependencies([tf.convert_to_tensor(w) for w in weights]):
          for a in accumulators:
            a.assign(tf.zeros_like(a))
        done += [tf.identity(tf.convert_to_tensor(w)) for w in weights]
    return done

  def sync(self) -> None:
    """Every replica's weights and optimizer state := the primary's (the stage's)."""
    trainable, optimizer = self.primary
    for weights, clone, accumulators in zip(self.weights, self.optimizers, self.accumulators):
      for w, v in zip(weights, trainable):
        w.assign(v.numpy())
      for mine, theirs in zip(clone.variables, optimizer.variables):
        mine.assign(theirs.numpy())
      for a in accumulators:
        a.assign(tf.zeros_like(a))

  def state(self) -> List[Any]:
    """The replicas' variables an update changes (weights, optimizer state, accumulators)."""
    return [v for weights, clone, accumulators in
            zip(self.weights, self.optimizers, self.accumulators)
            for v in list(weights) + list(clone.variables) + list(accumulators)]
