"""`Pipeline(method="auto")`: the choice made at the first `fit`, from a profile of its first
batch (`tfpipe.plan.auto` ranks, `tfpipe.instruments.costs` profiles and predicts,
`tfpipe.rules.epochs` says how many epochs each asynchronous method takes).

Until then the pipeline is built as "1f1b" with 2 micro-batches (its stages are the same
for every candidate: each is a method on K stages, one per device), which is what the
profile times; `choose` measures each candidate micro-batch size once.
"""

import dataclasses
import time
from typing import List, Tuple

from tfpipe.instruments import costs as costs_lib
from tfpipe.plan import auto as auto_plan, policies
from tfpipe.rules import advice, epochs as epochs_lib

__all__ = ["PROBE", "Choice", "choose", "asked_for", "refuse_chosen_options"]

PROBE = {"method": "1f1b", "micro_batches": 2}
SIMULATED_BATCHES = 32   # micro-batches per stage the simulator plays out per candidate


def simulated_batches(K: int, M: int) -> int:
  """Mini-batches the simulator plays out for a candidate at M micro-batches on K stages:
  SIMULATED_BATCHES micro-batches, at least 2K mini-batches (an asynchronous pipeline's fill
  and drain). Against 32 mini-batches at any M (40 random costs, K = 2, 4, 8): the same
  samples/s for the synchronous schedules, within 5% for spectrain at M = K and 2K, in half
  the seconds (at K = 8 and M = 16 a candidate's play took up to 0.3 s)."""
  return max(2 * K, SIMULATED_BATCHES // M)


@dataclasses.dataclass
class Choice:
  """What `choose` chose: the candidate, the ranked rows (chosen first), the report lines,
  and the seconds the profile took."""
  candidate: auto_plan.Candidate
  rows: List[auto_plan.Row]
  lines: List[str]
  seconds: float

  @property
  def kind(self) -> str:
    return self.candidate.kind

  @property
  def name(self) -> str:
    return self.candidate.name

  def summary(self) -> str:
    """One line: what was chosen and why."""
    chosen = self.rows[0]
    others = [r for r in self.rows[1:] if r.seconds is not None]
    why = (f"{others[0].seconds / chosen.seconds:.2f}x faster to accuracy than the next, "
           f"{others[0].candidate.name}" if others and chosen.seconds else "the only contender")
    return (f"method='auto' chose {self.name}: {chosen.samples_per_second:.0f} samples/s "
            f"predicted, {why} (profile {self.seconds:.1f} s; plan_report() lists "
            f"{len(self.rows)} candidates)")


def choose(pipe, features, labels, batch_size: int, num_batches: int) -> Choice:
  """Profiles `pipe` (built as `PROBE`, compiled) on one mini-batch (`features`, `labels`)
  at each candidate's micro-batch size and ranks the candidates by predicted time to
  accuracy for `pipe`'s optimizer at its K."""
  start = time.perf_counter()
  K, optimizer = pipe.num_stages, pipe.inner_optimizer
  spectrain = policies.policy_for("spectrain")
  advised = advice.micro_batches(spectrain, optimizer, K, None, None,
                                 bool(advice.batch_norm_layers(pipe.model))) or 1
  found = auto_plan.candidates(K, batch_size, advised, {"advice": True})
  found.append(auto_plan.Candidate("1f1b", 1, "synchronous"))
  if pipe.programs[0].updates.joint is not None:   # clipping or loss scaling: synchronous only
    found = [c for c in found if c.kind == "synchronous"]
  epochs = epochs_lib.factor(advice.family(optimizer), K)
  speeds, compute, traced = {c: 0.0 for c in found}, {}, {}
  for M, group in sorted(auto_plan.by_micro_batches(found).items()):
    if M > 1 and max(compute.values()) > auto_plan.BUSY * compute[1]:
      continue   # smaller than micro-batches already too small: not profiled
    # The executor inlines some candidates' tasks and calls the stage functions for others
    # (windows too large to inline): a profile for each way, timed as it runs; none for a
    # candidate the epochs table rules out whatever its speed.
    ways = {}
    for c in group:
      if not auto_plan.epochs_out(c, epochs):
        ways.setdefault(_inlines(pipe, c.method, M, num_batches), []).append(c)
    for inline, members in sorted(ways.items()):
      costs = _profile(pipe, features, labels, M, inline, members[0].method,
                       min(num_batches, pipe.runtime.window), traced)
      if M == 1:   # one batch per update: the update runs inside each backward
        costs = dataclasses.replace(costs, backward=[b + costs.update for b in costs.backward],
                                    update=0.0)
      work = sum(costs.forward) + sum(costs.backward) + costs.update * K
      compute[M] = min(compute.get(M, work), work)
      for c in members:
        speeds[c] = costs_lib.predict(costs, c.method, batch_size, M,
                                      num_batches=simulated_batches(K, M))
  rows = auto_plan.rank(found, speeds, compute, epochs)
  lines = auto_plan.report_lines(rows, batch_size, num_batches)
  return Choice(rows[0].candidate, rows, lines, time.perf_counter() - start)


def _profile(pipe, features, labels, M: int, inline: bool, method: str, num_batches: int,
             traced: dict):
  """The costs at M micro-batches, tasks `inline` or not: every stage timed, with the cores
  its micro-batches keep busy, on tasks traced once for every M (`traced`, kept across the
  calls). Each stage's tasks are traced for a batch of any size, with accumulators at M = 1
  too, so a later M traces nothing: traces were most of a profile's seconds. Before, each
  later M traced two stages again and scaled the others by their growth, with the cores
  taken at M = 1: on `bench/time_to_accuracy.py`'s shapes task (a CNN) at K = 4 that
  predicted 3,735 samples/s at M = 4 against 5,477 at M = 1 (chose M = 1), where every
  stage timed at M = 4 with its cores (1.61 against 1.23 at M = 1) predicted 6,264 and
  training measured 7,138 against 5,007."""
  return costs_lib.measure(pipe, features, labels, repeats=5, runs_per_call=2, quick=True,
                           method=method, num_batches=num_batches, micro_batches=M,
                           inline=inline, traced=traced)


def _inlines(pipe, method: str, M: int, num_batches: int) -> bool:
  """Whether the compiled executor traces `method`'s tasks (M micro-batches) inline. Whether
  an epoch finishes each mini-batch before the next (a loop window) shows over 2K
  mini-batches as over 32 (every method, K = 2, 4, 8, M = 1, K, 2K: the same), in a fifth of
  the seconds (up to 0.1 s a candidate at K = 8)."""
  schedule, diffs = policies.epoch(method, pipe.num_stages, 2 * pipe.num_stages, M)
  return pipe.runtime.inlines(schedule, diffs, min(num_batches, pipe.runtime.window))


def asked_for(asked, candidate: auto_plan.Candidate):
  """The `Asked` options that run `candidate` (the user's others kept)."""
  options = dict(candidate.options)
  if options.pop("advice", False):
    return dataclasses.replace(asked, method=candidate.method, micro_batches=None,
                               advice=True, **options)
  return dataclasses.replace(asked, method=candidate.method,
                             micro_batches=candidate.micro_batches, **options)


def refuse_chosen_options(asked) -> Tuple[str, ...]:
  """The options `method="auto"` chooses that the user set (it refuses them)."""
  return tuple(n for n in ("micro_batches", "virtual_stages", "nesterov", "version_difference")
               if getattr(asked, n) is not None) + (("advice",) if asked.advice else ())
