"""What a stage computes for each schedule task under a weight policy (pure Python).

The one table the executors (`tfpipe.runtime`), the stage program
(`tfpipe.stage.program`) and the slow reference (`tfpipe.rules.reference`) read: a new
weight rule is one entry here plus its math in the stage, nothing in the
executors.

Task kinds (`tfpipe.plan.schedules.Task`): F forward, B backward (with the
update, or adding into the accumulators for a micro-batch), W the weight half
of a split backward (zero-bubble schedules: their B gives the stage input's
gradient only), U apply the accumulated gradients, R receive a gradient early,
S a barrier. The last stage is an ordinary stage with the same operations: its forward
keeps its inputs and labels (it reads no weights), and its backward computes the loss in
the stage program, as one step (forward, loss, backward, update) on the weights its
`reads` names: the forward's rule, so a stash or a prediction is read once.

`StageOp` fields:
  op:    "forward" | "backward" | "backward_input" and "backward_weights" (a split
         backward's B and W) | "update" | "receive" | "barrier": every stage's;
  reads: the weights read (docs/methods.md): "current"; "predicted"
         (s updates ahead); "kept" (the very weights the forward read: a stash
         or a reused prediction); "corrected" (current minus d times the
         average weight change, PipeMare); "blend" (e^-d * the kept weights +
         (1 - e^-d) * the current ones, I-TiMePReSt). d, the updates since the
         forward, is the backward's version difference
         (`policies.version_differences`);
  keeps: what a forward keeps for its backward: "tape" (its activations: the
         backward takes its gradient through them, reading "kept" weights),
         "weights" (the weights it read, and its inputs: the backward blends
         them) or "inputs" (inputs and random state: the backward recomputes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
  from tfpipe.plan.policies import WeightPolicy

__all__ = ["StageOp", "op", "ops", "keeps_weights", "BACKWARD_READS"]


@dataclasses.dataclass(frozen=True)
class StageOp:
  op: str
  reads: Optional[str] = None
  keeps: Optional[str] = None


# The policy's backward source -> (what the backward reads, what the forward keeps).
BACKWARD_READS = {
    "forward": ("kept", "tape"),
    "current": ("current", "inputs"),
    "predicted": ("predicted", "inputs"),
    "corrected": ("corrected", "inputs"),
    "blend": ("blend", "weights"),
}

_PLAIN = {"U": StageOp("update"), "R": StageOp("receive"), "S": StageOp("barrier")}


def op(policy: WeightPolicy, kind: str, last: bool = False) -> StageOp:
  """The `StageOp` of a task of kind `kind` at a stage (`last`: the last stage) under `policy`
  (`tfpipe.plan.policies.WeightPolicy`)."""
  if kind in _PLAIN:
    return _PLAIN[kind]
  if kind not in ("F", "B", "W"):
    raise ValueError(f"unknown task kind {kind!r}")
  if policy.backward not in BACKWARD_READS:
    raise ValueError(f"policy {policy.method!r} reads unknown backward weights "
                     f"{policy.backward!r}")
  reads, keeps = BACKWARD_READS[policy.backward]
  if last:   # one step: forward and backward on the forward's weights (split: B, then W)
    if kind == "F":
      return StageOp("forward", keeps="inputs")
    reads = policy.forward
  elif kind == "F":
    return StageOp("forward", policy.forward, keeps)
  if kind == "W":
    return StageOp("backward_weights", reads)
  return StageOp("backward_input" if policy.splits_backward else "backward", reads)


def ops(policy: WeightPolicy, last: bool = False) -> Dict[str, StageOp]:
  """{kind: StageOp} for every task kind of a stage."""
  return {kind: op(policy, kind, last) for kind in ("F", "B", "W", "U", "R", "S")}


def keeps_weights(policy: WeightPolicy) -> bool:
  """Whether a forward's kept state holds the weights it read (a version to keep)."""
  return op(policy, "F").keeps in ("tape", "weights")
