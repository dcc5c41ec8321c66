"""Weight policies: which weights each task reads, per method (pure Python).

A policy says where the forward's weights come from ("current" or
"predicted") and where the backward's come from:
  "forward":   the very weights the forward read (PipeDream's stash, or
               SpecTrain's reused prediction); the runtime keeps the forward's
               saved state, so the backward recomputes nothing;
  "current":   the stage's weights at backward time; the forward is
               recomputed from the saved stage input (vanilla);
  "predicted": a new prediction with the backward's version difference, also
               recomputed (SpecTrain `repredict`, the paper's v1).
"""

import dataclasses

from tfpipe import names, schedules

__all__ = ["WeightPolicy", "policy_for", "version_differences", "PIPELINE_METHODS",
           "SPECTRAIN_BACKWARDS", "VERSION_DIFFERENCES"]

PIPELINE_METHODS = ("sequential", "vanilla", "pipedream", "spectrain")
SPECTRAIN_BACKWARDS = ("reuse", "repredict")
VERSION_DIFFERENCES = ("paper", "exact")


@dataclasses.dataclass(frozen=True)
class WeightPolicy:
  method: str
  schedule: str   # "sequential" | "1f1b"
  forward: str    # "current" | "predicted"
  backward: str   # "forward" | "current" | "predicted"

  @property
  def recompute(self):
    """True when the backward recomputes the forward from the saved stage input."""
    return self.backward != "forward"

  @property
  def predicts(self):
    return "predicted" in (self.forward, self.backward)


def policy_for(method, spectrain_backward="reuse"):
  """The weight policy of a pipeline method (DESIGN.md section 3)."""
  method = names.lookup("method", method, PIPELINE_METHODS)
  spectrain_backward = names.lookup("spectrain_backward", spectrain_backward, SPECTRAIN_BACKWARDS)
  if method == "sequential":
    return WeightPolicy(method, "sequential", "current", "forward")
  if method == "vanilla":
    return WeightPolicy(method, "1f1b", "current", "current")
  if method == "pipedream":
    return WeightPolicy(method, "1f1b", "current", "forward")
  backward = "forward" if spectrain_backward == "reuse" else "predicted"
  return WeightPolicy(method, "1f1b", "predicted", backward)


def version_differences(policy, schedule, mode="paper"):
  """Per stage, a dict (kind, batch) -> s, the version difference of each task.

  Zero for every task of a policy that does not predict. For SpecTrain:
  `paper` uses seed 000 eq. 5-6 with k the stage index; `exact` counts the
  updates the schedule really applies between the task and its batch's turn.
  """
  mode = names.lookup("version_difference", mode, VERSION_DIFFERENCES)
  K = len(schedule)
  if not policy.predicts:
    return [{tuple(t): 0 for t in tasks} for tasks in schedule]
  if mode == "exact":
    return schedules.exact_version_differences(schedule)
  return [{tuple(t): schedules.paper_version_difference(k, K, t.kind) for t in tasks}
          for k, tasks in enumerate(schedule)]
