"""How values move within one window the compiled executor traces (`WindowMoves`): tensors of
its graph, kept by unit; what `tfpipe.runtime.interpreter.run` moves them with.
"""

from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

import tensorflow as tf

from tfpipe.plan import pieces
from tfpipe.runtime import interpreter
from tfpipe.runtime.groups import Carry
from tfpipe.runtime.interpreter import Micro

if TYPE_CHECKING:
  from tfpipe.runtime.compiled import CompiledRuntime

__all__ = ["WindowMoves"]


class WindowMoves(interpreter.Moves):
  """How values move within one traced window: tensors of its graph. Stage 0 takes the
  window's mini-batches (split into micro-batches once each), the last stage their labels;
  outputs and gradients in flight are kept by unit, with those carried in from the window
  before (`carry`); shares are float64 tensors; a mini-batch's result is its loss and logs."""

  def __init__(self, runtime: "CompiledRuntime", carry: Carry, inputs: Dict[int, Any],
               labels: Dict[int, Any], M: int) -> None:
    self.runtime, self.inputs, self.labels, self.M = runtime, inputs, labels, M
    self.outputs, self.gradients = dict(carry["x"]), dict(carry["g"])
    self.pieces: Dict[Tuple[str, int], List[Any]] = {}
    self.results: Dict[int, Tuple[Any, Any]] = {}   # per batch: (loss, logs)

  def _piece(self, source: Dict[int, Any], name: str, b: int, micro: Micro) -> Any:
    """Unit (b, micro) of mini-batch b's inputs or (labels, sample weights): the mini-batch,
    or its micro-batch (`tfpipe.plan.pieces`), and its share."""
    if (name, b) not in self.pieces:
      self.pieces[(name, b)] = pieces.split(source[b], self.M if micro is not None else 1,
                                            cut=tf.split)
    return self.pieces[(name, b)][0 if micro is None else micro]

  def take_input(self, k: int, b: int, micro: Micro) -> Tuple[Any, Any, Any]:
    if k > 0:
      xs, share = self.outputs.pop((k, b, micro))
    else:
      xs, share = self._piece(self.inputs, "inputs", b, micro)
      share = self.runtime.share(0, share)
    last = k == self.runtime.K - 1
    return xs, share, self._piece(self.labels, "labels", b, micro)[0] if last else None

  def take_gradient(self, k: int, b: int, micro: Micro) -> Any:
    return self.gradients.pop((k, b, micro))

  def send_output(self, k: int, b: int, micro: Micro, ys: Any, share: Any) -> None:
    self.outputs[(k + 1, b, micro)] = (ys, share)

  def send_gradient(self, k: int, b: int, micro: Micro, dxs: Any) -> None:
    self.gradients[(k - 1, b, micro)] = dxs

  def total(self, shares: Sequence[Any]) -> Any:
    """Several units' shares (float64 scalars) added."""
    return shares[0] if len(shares) == 1 else tf.add_n(shares)

  def add_loss(self, total: Any, loss: Any, share: Any) -> Any:
    weighted = tf.cast(loss, tf.float64) * share
    return weighted if total is None else total + weighted

  def finished(self, b: int, loss: Any, logs: Any) -> None:
    self.results[b] = (loss, logs)
