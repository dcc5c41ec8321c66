"""A forward's residuals: a forward called from a compiled window's graph outputs the tensors
its gradient reads (`compat.ResidualCall`), so its backward needs no tape and may run in a
later window; what a window carries across its boundary (`carried`) and opens again.

`KeptResiduals` is a part of `tfpipe.stage.program.StageProgram`, written apart: it reads
the program's state and task functions and is not built on its own.
"""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import tensorflow as tf

from tfpipe import compat
from tfpipe.stage.kept import Kept
from tfpipe.stage.tracing import TaskFunctions

__all__ = ["KeptResiduals"]


class KeptResiduals:
  """How a `StageProgram` keeps a called forward's residuals (see the module)."""

  # What it reads of the program it is part of (`StageProgram` sets them).
  device: str
  remote: bool
  jit_compile: Optional[bool]
  functions: TaskFunctions
  trainable: List[Any]
  _float_out: List[bool]
  _inlined_residuals: bool
  _residual_calls: Dict[str, compat.ResidualCall]
  _loss_scaled: Callable[[Any], Any]
  _connected: Callable[[Sequence[Any], Sequence[Any], int], List[Any]]

  @contextlib.contextmanager
  def residuals_inlined(self, on: bool = True) -> Iterator[None]:
    """While on, a forward traced inline whose backward reads its tape is instead a call of
    the forward traced once per signature (`TaskFunctions.inlined_forward`) that outputs its
    residuals, which TensorFlow inlines when the graph runs, and its backward a call of that
    forward's backward (`compat.ResidualCall`): a window graph that holds M copies of the
    stage's tasks traces the forward and its gradient once, not M times. For the compiled
    executor's loop windows, where each forward's backward is in the same graph (a
    zero-bubble backward's input half takes both gradients from the residuals, as a
    window of calls does). It starts a 12-layer Llama's 1f1b, gpipe and zb about a third
    sooner than tracing each forward inline, steady epochs unchanged
    (measured: `bench/results/history.md`, "Figures the code cited")."""
    before, self._inlined_residuals = self._inlined_residuals, on
    try:
      yield
    finally:
      self._inlined_residuals = before

  def _residual_call(self, weights: Any, xs: Any,
                     inline: bool = False) -> Optional[compat.ResidualCall]:
    """The forward's `compat.ResidualCall` for these arguments, when a window's graph calls
    the traced forward (not eagerly, not under XLA); else None. `inline`: of the forward
    TensorFlow inlines when the graph runs (`residuals_inlined`), else of the one that stays
    a call. Under XLA (on CPU) the forward is recomputed instead: residuals started sooner
    there but made steady epochs a quarter slower
    (measured: `bench/results/history.md`, "Figures the code cited")."""
    if tf.executing_eagerly() or self.jit_compile:
      return None
    forward = self.functions.inlined_forward if inline else self.functions.traced["forward_on"]
    concrete = forward.get_concrete_function(weights, xs)
    if concrete.name not in self._residual_calls:
      self._residual_calls[concrete.name] = compat.ResidualCall(concrete)
    return self._residual_calls[concrete.name]

  def carried(self, kept: Kept) -> Kept:
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

  def _opened(self, parts: Sequence[Kept]) -> List[Kept]:
    """`parts` with any residuals a window carried packed (`carried`) unpacked: the weights
    the forward read and its residuals, as tensors again."""
    return [self._opened_one(kept) for kept in parts]

  def _opened_one(self, kept: Kept) -> Kept:
    if not isinstance(kept.residuals, tf.Tensor):
      return kept
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in self.trainable]
    call = self._residual_call(specs, kept.xs)
    assert call is not None   # residuals come from a window's graph
    with tf.device(self.device):
      values = tf.raw_ops.OptionalGetValue(
          optional=kept.residuals, output_types=[s.dtype for s in specs] + call.residual_types,
          output_shapes=[s.shape for s in specs] + call.residual_shapes)
    n = len(specs)
    return kept._replace(weights=list(values[:n]), residuals=list(values[n:]))

  def _replays(self, kept: Kept, dys: Sequence[Any]) -> bool:
    """Whether the backward of `kept` takes its gradients from its residuals: it has them
    and every float output has its gradient (else the forward is recomputed)."""
    return kept.residuals is not None and all(
        dy is not None for dy, f in zip(dys, self._float_out) if f)

  def _from_residuals(self, kept: Kept, dys: Sequence[Any], scale: Any, sources: Sequence[Any],
                      n_weights: int, inline: bool = False) -> List[Any]:
    """`_walk` for a forward that kept its residuals (`Kept.residuals`), not a tape."""
    call = self._residual_call(kept.weights, kept.xs, inline)
    assert call is not None   # residuals come from a window's graph
    residuals = kept.residuals
    _, reg, state = call.outputs
    reg_grad = self._loss_scaled(tf.ones([], reg.dtype) * tf.cast(scale, reg.dtype))
    zeros = [tf.zeros(t.shape, t.dtype) if call.trainable_output(t) else None
             for t in tf.nest.flatten(state)]
    out_grads = [dy if f else None for dy, f in zip(dys, self._float_out)]
    grads = call.gradients(residuals, (out_grads, reg_grad, zeros))
    by_id = {id(t): g for t, g in zip(list(kept.weights) + list(kept.xs), grads)}
    return self._connected([by_id[id(t)] for t in sources], sources, n_weights)
