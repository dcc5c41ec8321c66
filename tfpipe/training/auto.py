"""`Pipeline(method="auto")`: the choice made at the first `fit`, from a profile of its first
batch (`tfpipe.plan.auto` ranks, `tfpipe.instruments.costs` profiles and predicts,
`tfpipe.rules.epochs` says how many epochs each asynchronous method takes).

Until then the pipeline is built as "1f1b" with 2 micro-batches (its stages are the same
for every candidate: each is a method on K stages, one per device), which is what the
profile times; `choose` measures each candidate micro-batch size once. A choice whose tasks
are the probe's (the synchronous schedules at any M) then trains on the probe's stage
programs (`tfpipe.training.chooser.Chooser.before_fit`).

`tfpipe.training.chooser` holds the choice, the probe (`tfpipe.training.probe`) and the
hand-over as one object.
"""

import dataclasses
import time
from typing import List, Optional, Tuple

from tfpipe.instruments import costs as costs_lib
from tfpipe.plan import auto as auto_plan, policies, windows as windows_lib
from tfpipe.rules import advice, epochs as epochs_lib
from tfpipe.training import assemble
from tfpipe.training.probe import Probe, probe_candidate

__all__ = ["Choice", "choose", "kept_probe", "simulated_batches"]

SIMULATED_BATCHES = 32   # micro-batches per stage the simulator plays out per candidate
# A candidate's start-up: this share of the seconds the profile took to trace and first run
# each stage's forward and backward, per copy of them the candidate's epoch traces
# (`_executed`). The profile traces one copy run twice and times its first call alone; a
# window traces each copy into one graph. Measured (bench/time_to_accuracy.py's classes MLP
# and 12-layer transformer, "counting", at K = 4 and 8, 1f1b at M = 1, 2, K, 2K): each
# micro-batch more added 0.28 (MLP, K = 4), 0.39 (MLP, K = 8), 0.60-0.65 (transformer,
# K = 4) and 0.45 (transformer, K = 8) of the profile's per-copy seconds to the first epoch.
START_SHARE = 0.45


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
  the seconds the profile took, and the fit's epochs the choice was weighed over; `kept`:
  why the probe, training first, was kept without a profile (`kept_probe`), if it was; `after`:
  the mini-batches the probe trained before a choice took over (0: from the first)."""
  candidate: auto_plan.Candidate
  rows: List[auto_plan.Row]
  lines: List[str]
  seconds: float
  epochs: int = 1
  kept: str = ""
  after: int = 0

  @property
  def kind(self) -> str:
    return self.candidate.kind

  @property
  def name(self) -> str:
    return self.candidate.name

  def summary(self) -> str:
    """One line: what was chosen and why."""
    chosen = self.rows[0]
    if self.kept:
      return (f"method='auto' kept its probe, {self.name}: {chosen.samples_per_second:.0f} "
              f"samples/s measured; {self.kept}")
    # The next: the fastest other played out, or one whose least seconds are fewer still.
    others = [(r.seconds, "", r) for r in self.rows[1:] if r.seconds is not None]
    others += [(r.least, "at least ", r) for r in self.rows[1:] if r.least is not None]
    over = f"over {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
    if others and chosen.seconds:
      seconds, bound, r = min(others, key=lambda o: o[0])
      why = (f"{bound}{seconds / chosen.seconds:.2f}x faster to accuracy {over} than the "
             f"next, {r.candidate.name}")
    else:
      why = "the only contender"
    after = (f", taking over after the probe's first {self.after} mini-batches"
             if self.after else "")
    return (f"method='auto' chose {self.name}: {chosen.samples_per_second:.0f} samples/s "
            f"and {chosen.start:.1f} s of start-up predicted, {why} (profile "
            f"{self.seconds:.1f} s{after}; plan_report() lists {len(self.rows)} candidates)")


def kept_probe(probe: Probe, epochs: int) -> Choice:
  """The probe kept without a profile: one row, its measured samples/s and start-up."""
  candidate = probe_candidate()
  rate = probe.batch_size / probe.batch_seconds if probe.batch_seconds else 0.0
  why = probe.why_kept()
  row = auto_plan.Row(candidate, rate, 1.0, None, "", probe.start)
  lines = [f"{'candidate':<46}{'samples/s':>10}{'start-up':>10}  note",
           f"{candidate.name:<46}{rate:>10.0f}{probe.start:>8.1f} s  kept, measured "
           "(the others not profiled)"]
  return Choice(candidate, [row], lines, 0.0, epochs, kept=why)


def choose(pipe, features, labels, batch_size: int, num_batches: int,
           epochs: int = 1, samples: Optional[int] = None,
           trained: Optional[auto_plan.Candidate] = None, last_batch: int = 0) -> Choice:
  """Profiles `pipe` (built as the probe, compiled) on one mini-batch (`features`, `labels`)
  at each candidate's micro-batch size and ranks the candidates by predicted time to the
  accuracy `epochs` epochs of `num_batches` mini-batches of synchronous training reach, for
  `pipe`'s optimizer at its K. A way of running the tasks (inlined or as calls) is traced
  only for an M whose compute, timed first the way already traced, leaves a candidate that
  could win (12-layer Llama at K=4, a one-epoch fit: M=8's calls, too small, had been traced
  for 4.8 s of a 10.4 s profile; now 1.2 s to time M=8 inlined, and 7.3 s in all).
  With `trained` (the probe, training first): the choice takes over from it for the fit's
  last `samples` samples, so it is weighed over those, the probe's start-up is paid (0), and
  only the schedules the probe's stage programs run (`assemble.runs_tasks_of`) whose
  micro-batches fit in the smaller `last_batch` (if any) compete."""
  start = time.perf_counter()
  found = _candidates(pipe, batch_size, trained, last_batch)
  samples = epochs * num_batches * batch_size if samples is None else samples
  search = _Search(pipe, features, labels, batch_size, num_batches, samples, trained)
  for M, group in sorted(auto_plan.by_micro_batches(found).items()):
    search.weigh(M, group)
  rows = auto_plan.rank(found, {c: search.speeds.get(c, 0.0) for c in found}, search.compute,
                        search.factors, samples=samples, start=search.starts,
                        bounded=search.bounded)
  lines = auto_plan.report_lines(rows, batch_size, num_batches)
  return Choice(rows[0].candidate, rows, lines, time.perf_counter() - start, epochs)


def _candidates(pipe, batch_size: int, trained, last_batch: int) -> List[auto_plan.Candidate]:
  """The candidates `choose` weighs for `pipe` at `batch_size` (see there)."""
  K = pipe.num_stages
  advised = advice.micro_batches(policies.policy_for("spectrain"), pipe.inner_optimizer, K,
                                 None, None, bool(advice.batch_norm_layers(pipe.model))) or 1
  found = auto_plan.candidates(K, batch_size, advised, {"advice": True})
  if pipe.programs[0].updates.joint is not None:   # clipping or loss scaling: synchronous only
    found = [c for c in found if c.kind == "synchronous"]
  if trained is not None:   # taking over from the probe: on its stage programs
    found = [c for c in found if c.kind == "synchronous" and assemble.runs_tasks_of(
        pipe.programs, policies.policy_for(c.method))
             and not 0 < last_batch < c.micro_batches]
  return found


class _Search:
  """`choose`'s search over micro-batch sizes, smallest first: per candidate its predicted
  samples/s (`speeds`) and start-up (`starts`), per M the compute a mini-batch took
  (`compute`), the profile's traces (`traced`), the best predicted seconds to accuracy so
  far (`best`), the least seconds a mini-batch can take at the largest M profiled (`least`:
  a larger M's least, its compute only growing), and the candidates left out by that bound
  (`bounded`, with their least seconds to accuracy)."""

  def __init__(self, pipe, features, labels, batch_size, num_batches, samples, trained):
    self.pipe, self.features, self.labels = pipe, features, labels
    self.batch_size, self.num_batches, self.samples = batch_size, num_batches, samples
    self.trained, self.K = trained, pipe.num_stages
    self.factors = epochs_lib.factor(advice.family(pipe.inner_optimizer), self.K)
    self.cores = costs_lib.shared_cores(pipe.devices)
    self.window = min(num_batches, pipe.runtime.window)
    self.speeds, self.compute, self.traced, self.starts = {}, {}, {}, {}
    self.best, self.least, self.bounded = float("inf"), None, {}

  def floors(self, cands, seconds):
    """Each of `cands`' least seconds to accuracy at `seconds` a mini-batch, `NOISE` off."""
    rate = self.batch_size / (seconds * (1 - auto_plan.NOISE))
    return {c: auto_plan.seconds_to_accuracy(c, rate, self.factors, self.samples,
                                             self.starts[c]) for c in cands}

  def timed(self, M, costs) -> bool:
    """Records M's compute per mini-batch from `costs`; whether M is too small."""
    work = sum(costs.forward) + sum(costs.backward) + costs.update * self.K
    self.compute[M] = min(self.compute.get(M, work), work)
    return auto_plan.too_small(self.compute, M)

  def bound(self, cands, seconds) -> bool:
    """Whether none of `cands` can beat the best at `seconds` a mini-batch (then they are
    `bounded`)."""
    floor = self.floors(cands, seconds)
    if all(s >= self.best for s in floor.values()):
      self.bounded.update(floor)
      return True
    return False

  def weigh(self, M, group) -> None:
    """Profiles and plays out `group`, the candidates at M micro-batches. The executor
    inlines some candidates' tasks and calls the stage functions for others (windows too
    large to inline): a profile for each way, timed as it runs; none for a candidate the
    epochs table rules out whatever its speed."""
    if any(auto_plan.too_small(self.compute, m) for m in self.compute):
      return   # smaller than micro-batches already too small: not profiled
    ways, copies = {}, {}
    for c in group:
      if not auto_plan.epochs_out(c, self.factors):
        inline, copies[c] = _executed(self.pipe, c.method, M, self.num_batches)
        if c == self.trained:   # its windows are traced: no start-up left
          copies[c] = [0] * self.K
        ways.setdefault(inline, []).append(c)
        self.starts[c] = _start(self.traced, inline, self.K, copies[c])
    # None profiled at M where none can beat the best at its least.
    if self.least is not None and self.bound(copies, self.least):
      return
    at_m = []
    for inline, members in sorted(ways.items()):
      if auto_plan.too_small(self.compute, M):
        break
      self._weigh_way(M, inline, members, copies, at_m)
    self.least = min(at_m) if at_m else self.least

  def _weigh_way(self, M, inline, members, copies, at_m) -> None:
    """Profiles M's tasks `inline` (or as calls) and plays out `members`, the candidates that
    run them so, unless M proves too small or none of them can win; appends each profile's
    least seconds a mini-batch to `at_m`."""
    if (M not in self.compute and not _traced_way(self.traced, inline)
        and _traced_way(self.traced, not inline)):
      # A way not traced yet (its traces: seconds a transformer stage): M's compute first,
      # timed the other way (traced for any batch size, so no trace), which may show M
      # too small or unable to win (its compute is the same either way).
      costs = self._profile(M, not inline, members[0].method)
      if self.timed(M, costs):
        return
      at_m.append(_least(costs, self.cores))
      if self.bound(members, at_m[-1]):
        return
    costs = self._profile(M, inline, members[0].method)
    if M == 1:   # one batch per update: the update runs inside each backward
      costs = dataclasses.replace(costs, backward=[b + costs.update for b in costs.backward],
                                  update=0.0)
    if self.timed(M, costs):
      return   # too small to keep a device busy: not played out (up to 0.3 s each)
    at_m.append(_least(costs, self.cores))
    for c in members:   # the schedules that keep least first: a tie goes their way
      self.starts[c] = _start(self.traced, inline, self.K, copies[c])
      floor = auto_plan.seconds_to_accuracy(c, self.batch_size / at_m[-1], self.factors,
                                            self.samples, self.starts[c])
      if floor >= self.best:
        self.bounded[c] = floor
        continue
      self.speeds[c] = costs_lib.predict(costs, c.method, self.batch_size, M,
                                         num_batches=simulated_batches(self.K, M))
      self.best = min(self.best, auto_plan.seconds_to_accuracy(
          c, self.speeds[c], self.factors, self.samples, self.starts[c]))

  def _profile(self, M, inline, method):
    return _profile(self.pipe, self.features, self.labels, M, inline, method, self.window,
                    self.traced)


def _least(costs, cores) -> float:
  """The least seconds a mini-batch can take on `costs` (`plan.auto.least_batch_seconds`)."""
  return auto_plan.least_batch_seconds(costs.forward, costs.backward, costs.update, cores)


def _traced_way(traced: dict, inline: bool) -> bool:
  """Whether the profile has traced the stages' tasks `inline` (or as calls)."""
  return ((0, "fb"), inline) in traced or ((0, "step"), inline) in traced


def _start(traced: dict, inline: bool, K: int, copies: List[int]) -> float:
  """A candidate's predicted start-up: `START_SHARE` of the profile's seconds to trace and
  first run each stage's tasks `inline` or not, per copy its epoch traces (`copies`); 0
  before a profile of that way (the least it can be)."""
  if not _traced_way(traced, inline):
    return 0.0
  copy = costs_lib.start_seconds(traced, inline, K)
  return START_SHARE * sum(n * s for n, s in zip(copies, copy))


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


def _executed(pipe, method: str, M: int, num_batches: int) -> Tuple[bool, List[int]]:
  """How the compiled executor runs an epoch of `num_batches` mini-batches of `method` (M
  micro-batches): whether it traces the tasks inline, and per stage the copies of its tasks
  its graphs hold (`CompiledRuntime.traced_copies`). Whether an epoch finishes each
  mini-batch before the next (a loop window) shows over 2 mini-batches as over 2K and 32
  (every method, K = 2, 3, 4, 8, M = 1, 2, K, 2K: the same), in a twentieth of 2K's seconds
  (zb at K = 8, M = 16: 0.26 s over 2K); inlined windows that do not loop are counted over
  three windows (the warm-up, a steady one and the last: the steady ones trace alike)."""
  runtime, K = pipe.runtime, pipe.num_stages
  window = min(num_batches, runtime.window)
  schedule, diffs = policies.epoch(method, K, 2, M)
  loops = windows_lib.flush_window(schedule, diffs) is not None
  inline = runtime.inlines(schedule, diffs, window, loops=loops)
  if inline and not loops:   # the warm-up, a steady window and the last, as long as the epoch's
    W = runtime.window
    N = num_batches if num_batches <= 3 * W else 2 * W + (num_batches - 1) % W + 1
    schedule, diffs = policies.epoch(method, K, N, M)
  return inline, runtime.traced_copies(schedule, diffs, window, loops=loops)
