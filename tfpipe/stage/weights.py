"""Where a stage's tasks read their weights (`tfpipe.plan.tasks` `reads`).

s: version difference. The variables themselves ("current"), their prediction `s` updates
ahead ("predicted", `tfpipe.rules.prediction`), the variables corrected back by `s` times the
average weight change ("corrected", PipeMare's `deltas`), the weights before the latest
update ("delayed", PipeDream-2BW's second buffer `previous`), a forward's kept weights, or
their blend with the current ones (I-TiMePReSt).
"""

from typing import Any, List, Mapping, Optional, Sequence

import tensorflow as tf

from tfpipe.plan import policies, tasks
from tfpipe.rules import mitigations, prediction

__all__ = ["WeightSources"]


class WeightSources:
  """A stage's `trainable` variables and the weights derived from them; `deltas` and
  `previous` are created (on the caller's device scope) where the stage's policy reads them."""

  def __init__(self, index: int, trainable: List[Any], optimizer: Any,
               policy: policies.WeightPolicy, ops: Mapping[str, tasks.StageOp]) -> None:
    self.trainable, self.optimizer, self.ops = trainable, optimizer, ops
    self.deltas = ([tf.Variable(tf.zeros_like(v), trainable=False, name=f"s{index}_delta{j}")
                    for j, v in enumerate(trainable)] if ops["B"].reads == "corrected" else [])
    self.previous = ([tf.Variable(v, trainable=False, name=f"s{index}_previous{j}")
                      for j, v in enumerate(trainable)] if policy.keeps_previous else [])

  def read(self, s: Any, source: Optional[str]) -> List[Any]:
    """The weights a task reads: "current"; "predicted" `s` updates ahead (the optimizer's
    own step); "corrected" back by `s` updates of the average weight change; "delayed" one
    update old (the weights before the latest update when s = 0, else the current ones).
    Any other source (the forward's own, a blend) reads "current" here.

    `s` is a Python number, so each value traces once and s = 0 costs nothing; for
    "corrected" it may be a scalar tensor (one trace for every s).
    """
    if source == "predicted" and s:
      return prediction.predict_all(self.optimizer, self.trainable, s)
    if source == "corrected" and not (isinstance(s, (int, float)) and not s):
      return [tf.convert_to_tensor(v) - tf.cast(s, d.dtype) * d
              for v, d in zip(self.trainable, self.deltas)]
    if source == "delayed" and not s:   # mini-batch b after b updates: W^(b-1), the 2nd buffer
      return [tf.convert_to_tensor(p) for p in self.previous]
    return [tf.convert_to_tensor(v) for v in self.trainable]

  def forward(self, s: Any) -> List[Any]:
    """What a forward (the last stage: its step) reads."""
    return self.read(s, self.ops["F"].reads or self.ops["B"].reads)

  def backward(self, kept_weights: Optional[Sequence[Any]], s: Any) -> List[Any]:
    """The weights a recomputing backward reads: the forward's `kept_weights`, their blend
    with the current ones (`s`: the updates since the forward), or the policy's source `s`
    updates ahead ("predicted") or back ("corrected")."""
    reads = self.ops["B"].reads
    if reads not in ("kept", "blend"):
      return self.read(s, reads)
    assert kept_weights is not None   # the forward kept them (`tfpipe.plan.tasks`)
    if reads == "kept":
      return list(kept_weights)
    if isinstance(s, (int, float)):   # "blend"
      sigma = mitigations.blend_factor(s)
      return [w if not s else sigma * w + (1.0 - sigma) * tf.convert_to_tensor(v)
              for w, v in zip(kept_weights, self.trainable)]
    sigma_t = tf.exp(-tf.cast(s, tf.float64))   # mitigations.blend_factor, as a tensor
    return [tf.cast(sigma_t, w.dtype) * w + tf.cast(1.0 - sigma_t, w.dtype)
            * tf.convert_to_tensor(v) for w, v in zip(kept_weights, self.trainable)]

  def version(self, updates: int, s: Any) -> int:
    """The update count of the weights a forward (the last stage: its step) reads, `updates`
    applied so far and `s` its version difference: one less from 2BW's second buffer."""
    reads = self.ops["F"].reads or self.ops["B"].reads
    return updates - (reads == "delayed" and not s and updates > 0)

  def keep_previous(self) -> None:
    """2BW: the weights about to be updated become the second buffer."""
    for p, v in zip(self.previous, self.trainable):
      p.assign(v)
