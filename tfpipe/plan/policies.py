"""Weight policies: which weights each task reads, per method (pure Python).

A policy says where the forward's weights come from ("current" or
"predicted") and where the backward's come from:
  "forward":   the very weights the forward read (PipeDream's stash, or
               SpecTrain's reused prediction); the runtime keeps the forward's
               saved state, so the backward recomputes nothing;
  "current":   the stage's weights at backward time; the forward is
               recomputed from the saved stage input (vanilla);
  "predicted": a new prediction with the backward's version difference, also
               recomputed (SpecTrain `repredict`, the paper's v1);
  "corrected": the current weights moved back along the stage's average
               weight change by the updates since the forward (PipeMare's
               discrepancy correction), recomputed;
  "blend":     e^-d * the forward's weights + (1 - e^-d) * the current ones,
               d updates after the forward (I-TiMePReSt), recomputed.
A forward that reads "delayed" reads W^(b-1) for mini-batch b at every stage
(PipeDream-2BW's double-buffered weights): the current weights when the
stage has applied b - 1 updates (s = 1), the weights before its latest
update when it has applied b (s = 0); s, the updates still to come for
earlier mini-batches, is the schedule's exact version difference.
A backward that reads "corrected" or "blend" weights gets d, the updates its
stage applied since the forward, as its version difference.
"""

import dataclasses
from typing import Dict, List, NamedTuple, Optional, Tuple

from tfpipe.plan import names, schedules, versions

__all__ = ["WeightPolicy", "policy_for", "micro_batches_for", "version_differences",
           "build_schedule", "epoch", "METHODS", "MethodRecord", "VIRTUAL_STAGE_METHODS",
           "PIPELINE_METHODS", "SYNCHRONOUS_METHODS", "MICRO_BATCH_METHODS", "MAX_MICRO_BATCHES",
           "LOCKSTEP_METHODS",
           "SPECTRAIN_BACKWARDS", "VERSION_DIFFERENCES"]

class MethodRecord(NamedTuple):
  """A pipeline method, named once (`METHODS`): its schedule (a name of
  `tfpipe.plan.schedules.SCHEDULES`, which says how it is built), the weights its forward and
  backward read. `synchronous`: no stale weight (equal to training on whole mini-batches).
  `micro_batches`: its default M (whether it takes micro-batches at all is its schedule's).
  `virtual_stages`: its default V (stages per device), None where it runs one per device."""
  schedule: str
  forward: str = "current"
  backward: str = "forward"
  synchronous: bool = False
  micro_batches: int = 1
  virtual_stages: Optional[int] = None


# SpecTrain's backward depends on `spectrain_backward` ("reuse": "forward"); 2BW's default M is
# K (`micro_batches_for`).
METHODS: Dict[str, MethodRecord] = {
    "sequential": MethodRecord("sequential", synchronous=True),
    "gpipe": MethodRecord("gpipe", synchronous=True, micro_batches=4),
    "1f1b": MethodRecord("1f1b_flush", synchronous=True, micro_batches=4),
    "interleaved": MethodRecord("interleaved", synchronous=True, micro_batches=4,
                                virtual_stages=2),
    "zb": MethodRecord("zb_h1", synchronous=True, micro_batches=4),
    "zbv": MethodRecord("zb_v", synchronous=True, micro_batches=4, virtual_stages=2),
    "vanilla": MethodRecord("1f1b", backward="current"),
    "pipedream": MethodRecord("1f1b"),
    "spectrain": MethodRecord("1f1b", forward="predicted"),
    "ddg": MethodRecord("ddg"),
    "feature_replay": MethodRecord("ddg", backward="current"),
    "timeprest": MethodRecord("timeprest", backward="current", micro_batches=4),
    "pipemare": MethodRecord("1f1b", backward="corrected"),
    "i_timeprest": MethodRecord("timeprest", backward="blend", micro_batches=4),
    "2bw": MethodRecord("1f1b", forward="delayed"),
}
PIPELINE_METHODS = tuple(METHODS)
# The methods with no stale weight: each equals training on whole mini-batches.
SYNCHRONOUS_METHODS = tuple(m for m, r in METHODS.items() if r.synchronous)
MICRO_BATCH_METHODS = tuple(m for m, r in METHODS.items()
                            if schedules.kind_of(r.schedule).micro_batches != "never")
DEFAULT_MICRO_BATCHES = {m: r.micro_batches for m, r in METHODS.items() if r.micro_batches > 1}
VIRTUAL_STAGE_METHODS = {m: r.virtual_stages for m, r in METHODS.items() if r.virtual_stages}
# The methods whose schedule has a variant with a barrier closing every step (the DDG paper's).
LOCKSTEP_METHODS = tuple(m for m, r in METHODS.items() if schedules.kind_of(r.schedule).lockstep)
# Each micro-batch is a task of every stage, planned and verified per mini-batch: past this
# the plan alone takes seconds (M=4000: 2.6 s per verify) while the bubble, (K-1)/(M+K-1), is
# already below 1% for K <= 11.
MAX_MICRO_BATCHES = 1024
SPECTRAIN_BACKWARDS = ("reuse", "repredict")
VERSION_DIFFERENCES = ("paper", "exact")


@dataclasses.dataclass(frozen=True)
class WeightPolicy:
  method: str
  schedule: str   # a name in tfpipe.plan.schedules.SCHEDULES
  forward: str    # "current" | "predicted" | "delayed"
  backward: str   # "forward" | "current" | "predicted" | "corrected" | "blend"
  virtual_stages: int = 1   # V: stages (model chunks) per device (interleaved schedules)

  @property
  def recompute(self) -> bool:
    """True when the backward recomputes the forward from the saved stage input."""
    return self.backward != "forward"

  @property
  def splits_backward(self) -> bool:
    """True when the schedule splits each backward into B (input gradient) and W (weights)."""
    return schedules.kind_of(self.schedule).split_backward

  @property
  def predicts(self) -> bool:
    """True when a task reads predicted weights (SpecTrain)."""
    return "predicted" in (self.forward, self.backward)

  @property
  def corrects(self) -> bool:
    """True when the backward reads the current weights corrected back to the forward's
    (PipeMare's discrepancy correction)."""
    return self.backward == "corrected"

  @property
  def keeps_previous(self) -> bool:
    """True when a stage keeps its weights from before its latest update (2BW's 2nd buffer)."""
    return self.forward == "delayed"


def policy_for(method: str, spectrain_backward: str = "reuse", recompute: Optional[bool] = None,
               lockstep: bool = False, virtual_stages: Optional[int] = None) -> WeightPolicy:
  """The weight policy of a pipeline method (docs/methods.md).

  `recompute=True` keeps only stage inputs and recomputes the forward before
  the backward: allowed where the recomputed forward reads the same weights
  as the original one (the `SYNCHRONOUS_METHODS`: no update comes between them).
  Methods whose backward reads other weights than the forward (vanilla,
  feature_replay, timeprest, spectrain "repredict") always recompute.

  `lockstep=True` (ddg, feature_replay) closes every step with a barrier on
  all stages, as the DDG paper runs it; the weights read do not change.
  """
  method = names.lookup("method", method, PIPELINE_METHODS)
  if lockstep not in (True, False):
    raise ValueError(f"`lockstep` must be True or False. Received: lockstep={lockstep!r}")
  if lockstep and method not in LOCKSTEP_METHODS:
    raise ValueError(
        f"method {method!r} has no lock-step schedule (lockstep works with "
        f"{', '.join(LOCKSTEP_METHODS)}). Received: lockstep=True")
  spectrain_backward = names.lookup("spectrain_backward", spectrain_backward, SPECTRAIN_BACKWARDS)
  if recompute not in (None, True, False):
    raise ValueError(f"`recompute` must be None, True or False. Received: recompute={recompute!r}")
  record = METHODS[method]
  backward = record.backward
  if method == "spectrain" and spectrain_backward == "repredict":
    backward = "predicted"
  policy = WeightPolicy(method, record.schedule, record.forward, backward)
  if lockstep:   # a method of LOCKSTEP_METHODS: its schedule has the variant
    variant = schedules.kind_of(policy.schedule).lockstep
    policy = dataclasses.replace(policy, schedule=variant or policy.schedule)
  if virtual_stages is not None and method not in VIRTUAL_STAGE_METHODS:
    raise ValueError(f"method {method!r} runs one stage per device; virtual stages work with "
                     f"{', '.join(VIRTUAL_STAGE_METHODS)}. Received: "
                     f"virtual_stages={virtual_stages!r}")
  if method in VIRTUAL_STAGE_METHODS:
    V = VIRTUAL_STAGE_METHODS[method] if virtual_stages is None else virtual_stages
    if not isinstance(V, int) or isinstance(V, bool) or V < 1:
      raise ValueError(f"`virtual_stages` must be a positive integer. Received: "
                       f"virtual_stages={V!r}")
    schedules.check_virtual_stages(policy.schedule, V)
    policy = dataclasses.replace(policy, virtual_stages=V)
  if recompute is None or recompute == policy.recompute:
    return policy
  if recompute and method in SYNCHRONOUS_METHODS:
    return dataclasses.replace(policy, backward="current")
  if recompute:
    raise ValueError(
        f"method {method!r} cannot recompute: its backward reads the weights its forward read "
        "(a stash), which a recomputation from the stage input would not see. Received: "
        "recompute=True")
  raise ValueError(
      f"method {method!r} always recomputes: its backward reads other weights than its forward. "
      "Received: recompute=False")


def micro_batches_for(policy: WeightPolicy, micro_batches: Optional[int] = None,
                      num_stages: Optional[int] = None) -> int:
  """M for `policy`: the method's default when None; checked against what the method supports
  (`num_stages`: K, when known: "2bw" needs M >= K - 1 and defaults to K, PipeDream-2BW's
  m >= d)."""
  if micro_batches is None:
    if policy.method == "2bw":
      return max(1, num_stages or 1)
    return DEFAULT_MICRO_BATCHES.get(policy.method, 1)
  if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
    raise ValueError(
        f"`micro_batches` must be a positive integer. Received: micro_batches={micro_batches!r}")
  if micro_batches > MAX_MICRO_BATCHES:
    raise ValueError(
        f"`micro_batches` must be at most {MAX_MICRO_BATCHES} (each micro-batch is a task of "
        "every stage; beyond that planning alone is slow and the bubble no smaller). Received: "
        f"micro_batches={micro_batches}")
  if micro_batches > 1 and policy.method not in MICRO_BATCH_METHODS:
    raise ValueError(
        f"method {policy.method!r} has no micro-batched schedule (micro-batches work with "
        f"{', '.join(MICRO_BATCH_METHODS)}). Received: micro_batches={micro_batches}")
  if policy.method == "2bw" and num_stages and micro_batches < num_stages - 1:
    raise ValueError(
        f"method '2bw' reads weights one update old at every stage, which two buffers hold "
        f"only when a mini-batch has at least K - 1 = {num_stages - 1} micro-batches "
        f"(PipeDream-2BW's m >= d). Received: micro_batches={micro_batches} at {num_stages} "
        "stages")
  return micro_batches


def version_differences(policy: WeightPolicy, schedule: schedules.Lists,
                        mode: str = "paper") -> List[Dict[schedules.Task, int]]:
  """Per stage, a dict task -> s, the version difference of each task.

  Zero for every task of a policy that does not predict. For SpecTrain:
  `paper` uses the SpecTrain paper eq. 5-6 with k the stage index (one batch per
  update, so not with micro-batches); `exact` counts the updates the
  schedule really applies between the task and its batch's turn.
  """
  mode = names.lookup("version_difference", mode, VERSION_DIFFERENCES)
  K = len(schedule)
  if policy.backward in ("corrected", "blend"):
    return versions.updates_since_forward(schedule)
  if policy.keeps_previous:
    return versions.exact_version_differences(schedule)
  if not policy.predicts:
    return [{t: 0 for t in tasks} for tasks in schedule]
  if mode == "exact":
    return versions.exact_version_differences(schedule)
  if schedules.micro_batches(schedule) > 1:
    raise ValueError(
        "version_difference='paper' counts one update per batch (the SpecTrain paper eq. 5-6); with "
        "micro-batches use version_difference='exact'")
  return [{t: (versions.paper_version_difference(k, K, t.kind) if t.kind in "FB" else 0)
           for t in tasks} for k, tasks in enumerate(schedule)]


def epoch(method: str, K: int, N: int,
          M: int) -> Tuple[schedules.Lists, List[Dict[schedules.Task, int]]]:
  """`method`'s schedule for K stages over N mini-batches of M micro-batches, with its
  default version differences ("exact" with micro-batches, else the paper's): what a
  candidate of `method="auto"` runs. Returns (schedule, diffs)."""
  policy = policy_for(method)
  schedule = build_schedule(policy, K, N, M)
  return schedule, version_differences(policy, schedule, "exact" if M > 1 else "paper")


def build_schedule(policy: WeightPolicy, K: int, N: int, M: int = 1,
                   joint: bool = False) -> schedules.Lists:
  """The schedule of `policy` for K stages (K / V devices with virtual stages), N mini-batches
  of M micro-batches. `joint` (a synchronous policy): with joint updates
  (`schedules.jointly_updated`); "sequential" then runs as GPipe with one micro-batch, the
  same tasks with the update as a task of its own."""
  if not joint:
    return schedules.build(policy.schedule, K, N, M, policy.virtual_stages)
  if policy.method not in SYNCHRONOUS_METHODS:
    raise ValueError(f"joint updates need a synchronous schedule; {policy.method!r} is not one")
  name = schedules.kind_of(policy.schedule).joint_as or policy.schedule
  return schedules.jointly_updated(schedules.build(name, K, N, M, policy.virtual_stages))

