"""`Pipeline(method="auto")`: the choice made at the first `fit`, from a profile of its first
batch (`tfpipe.plan.auto` ranks, `tfpipe.instruments.costs` profiles and predicts,
`tfpipe.rules.epochs` says how many epochs each asynchronous method takes).

Until then the pipeline is built as "1f1b" with 2 micro-batches (its stages are the same
for every candidate: each is a method on K stages, one per device), which is what the
profile times; `choose` measures each candidate micro-batch size once. A choice whose tasks
are the probe's (the synchronous schedules at any M) then trains on the probe's stage
programs (`Chooser.before_fit`).

`Chooser` is `method="auto"` as one object: it holds the user's options, the probe, the
choice and the hand-over; `Pipeline` keeps it as `pipe.auto`, and the fit loop sees only a
`watch` of its batches and a hand-over at a window's end.

Where only the synchronous schedules can win (the epochs table rules out every other
candidate for this optimizer and K: momentum SGD), the probe, one of them, trains from the
first batch (`trains_first`): each schedule equals Keras at any M, so the choice can take
over between two mini-batches without changing what is computed. `Probe` times its first
two windows (the first holds its start-up); a profile then runs only where the rest of the
fit can pay for it (`PROFILE_SHARE`), and its choice takes over for the rest of the fit.
"""

import dataclasses
import time
from typing import Any, List, Optional, Tuple

import tensorflow as tf

from tfpipe.instruments import costs as costs_lib
from tfpipe.plan import auto as auto_plan, policies, windows as windows_lib
from tfpipe.rules import advice, epochs as epochs_lib
from tfpipe.stage import assemble
from tfpipe.training import fit_data, options as options_lib

__all__ = ["PROBE", "PROFILE_SHARE", "PROFILE_PER_START", "Chooser", "Choice", "Probe", "choose",
           "kept_probe", "probe_candidate", "trains_first", "asked_for", "refuse_chosen_options"]

PROBE = {"method": "1f1b", "micro_batches": 2}
SIMULATED_BATCHES = 32   # micro-batches per stage the simulator plays out per candidate
# A candidate's start-up: this share of the seconds the profile took to trace and first run
# each stage's forward and backward, per copy of them the candidate's epoch traces
# (`_executed`). The profile traces one copy run twice and times its first call alone; a
# window traces each copy into one graph. Measured (bench/time_to_accuracy.py's classes MLP
# and 12-layer transformer, "counting", at K = 4 and 8, 1f1b at M = 1, 2, K, 2K): each
# micro-batch more added 0.28 (MLP, K = 4), 0.39 (MLP, K = 8), 0.60-0.65 (transformer,
# K = 4) and 0.45 (transformer, K = 8) of the profile's per-copy seconds to the first epoch.
START_SHARE = 0.45
# A probe training first is profiled only where the profile, predicted at PROFILE_PER_START
# times the probe's own start-up (the profile traces and first runs each stage's tasks, as
# the probe's first window did), costs at most PROFILE_SHARE of the rest of the fit at the
# probe's measured speed. Measured on `bench/time_to_accuracy.py`'s tasks, the profile over
# the probe's start-up: 0.5-1.0 (MLPs), 0.8-1.1 (the 12-layer transformer), 1.2-1.6 (the
# CNN): the largest is taken, so a profile runs where it surely costs under a tenth of the
# rest. There (fits of 3-30 s), on 8 of 10 rows the probe was kept and took 0.71-1.24x the
# fastest column (the same configuration as its own column moved by up to 25% between
# timings); where it profiled (the CNN), the profile took 12-13% and chose the probe.
PROFILE_SHARE = 0.1
PROFILE_PER_START = 1.5


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


def trains_first(pipe, batch_size: int, last_batch: int = 0) -> bool:
  """Whether `method="auto"` trains its probe from the first batch (`Probe`): every candidate
  besides the synchronous schedules is out by the epochs table for `pipe`'s optimizer at its
  K (or by clipping or loss scaling), and the probe's M divides the batch (and a smaller
  `last_batch`, if any, holds M samples at least)."""
  M = PROBE["micro_batches"]
  if batch_size % M or 0 < last_batch < M:
    return False
  if pipe.programs[0].updates.joint is not None:
    return True
  factors = epochs_lib.factor(advice.family(pipe.inner_optimizer), pipe.num_stages)
  return all(c.kind == "synchronous" or auto_plan.epochs_out(c, factors)
             for c in auto_plan.candidates(pipe.num_stages, batch_size, 1, {"advice": True}))


class Probe:
  """The probe training first: its windows (of the executor's window of mini-batches, given
  at each epoch's start) timed as they end (the first holds its start-up; the mark restarts with each
  epoch, so validation is not counted; windows handed on together time as one), and at the
  end of its second the verdict, "profile" where the profile
  (`PROFILE_PER_START` times the probe's start-up) costs at most `PROFILE_SHARE` of the rest
  of the fit at the probe's speed, else "keep". `features`, `labels`: the first mini-batch,
  for the profile; `last_batch`: the fit's smaller last batch (0: none), which a choice's
  micro-batches must fit in."""

  def __init__(self, features, labels, batch_size: int, last_batch: int = 0):
    self.features, self.labels, self.last_batch = features, labels, last_batch
    self.batch_size, self.window = batch_size, 1
    self.spans: List[Tuple[float, int]] = []   # (seconds, mini-batches) per window ended
    self.verdict = None
    self.rest = 0   # mini-batches of the fit left after the verdict
    self.batch_seconds = self.start = self.profile = 0.0
    self._mark, self._count, self._num_batches = 0.0, 0, 0

  def epoch_begins(self, num_batches: int, window: int):
    """An epoch of `num_batches` mini-batches starts, in windows of `window`."""
    self._mark, self._count, self._num_batches = time.perf_counter(), 0, num_batches
    self.window = max(1, window)

  def result(self, b: int, rest: int) -> bool:
    """Mini-batch b of the epoch finished, `rest` left in the fit after it: True where the
    verdict, just reached, is to profile (stop the epoch here)."""
    if self.verdict is not None:
      return False
    self._count += 1
    if (b + 1) % self.window and b + 1 < self._num_batches:
      return False
    now = time.perf_counter()
    if self.spans and now - self._mark < 1e-3:   # handed on with the last: one span with it
      return False
    self.spans.append((now - self._mark, self._count))
    self._mark, self._count = now, 0
    if len(self.spans) < 2:
      return False
    (first, n), (second, m) = self.spans[:2]
    self.batch_seconds = second / m
    self.start = max(first - n * self.batch_seconds, 0.0)
    self.profile, self.rest = PROFILE_PER_START * self.start, rest
    pays = self.profile <= PROFILE_SHARE * rest * self.batch_seconds
    self.verdict = "profile" if pays else "keep"
    return pays

  def why_kept(self) -> str:
    """Why the probe was kept without a profile."""
    if self.verdict is None:
      return "the fit ended before the probe had run two windows"
    return (f"a profile (~{self.profile:.1f} s, from the probe's start-up) would cost over "
            f"{PROFILE_SHARE:.0%} of the rest of the fit (~{self.rest * self.batch_seconds:.1f} "
            "s at the probe's speed)")


def probe_candidate() -> auto_plan.Candidate:
  """The probe as a candidate (a synchronous schedule)."""
  return auto_plan.Candidate(PROBE["method"], PROBE["micro_batches"], "synchronous")


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
  """Profiles `pipe` (built as `PROBE`, compiled) on one mini-batch (`features`, `labels`)
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
  K, optimizer = pipe.num_stages, pipe.inner_optimizer
  spectrain = policies.policy_for("spectrain")
  advised = advice.micro_batches(spectrain, optimizer, K, None, None,
                                 bool(advice.batch_norm_layers(pipe.model))) or 1
  found = auto_plan.candidates(K, batch_size, advised, {"advice": True})
  if pipe.programs[0].updates.joint is not None:   # clipping or loss scaling: synchronous only
    found = [c for c in found if c.kind == "synchronous"]
  if trained is not None:   # taking over from the probe: on its stage programs
    found = [c for c in found if c.kind == "synchronous" and assemble.runs_tasks_of(
        pipe.programs, policies.policy_for(c.method))
             and not 0 < last_batch < c.micro_batches]
  factors = epochs_lib.factor(advice.family(optimizer), K)
  samples = epochs * num_batches * batch_size if samples is None else samples
  cores = costs_lib.shared_cores(pipe.devices)
  speeds, compute, traced, starts = {c: 0.0 for c in found}, {}, {}, {}
  # The best predicted seconds to accuracy so far, the least seconds a mini-batch can take at
  # the largest M profiled (a larger M's least, its compute only growing), and the
  # candidates left out by that bound.
  best, least, bounded = float("inf"), None, {}

  def floors(cands, seconds):
    """Each of `cands`' least seconds to accuracy at `seconds` a mini-batch, `NOISE` off."""
    rate = batch_size / (seconds * (1 - auto_plan.NOISE))
    return {c: auto_plan.seconds_to_accuracy(c, rate, factors, samples, starts[c])
            for c in cands}

  def timed(costs):
    """Records M's compute per mini-batch from `costs`; whether M is too small."""
    work = sum(costs.forward) + sum(costs.backward) + costs.update * K
    compute[M] = min(compute.get(M, work), work)
    return auto_plan.too_small(compute, M)

  for M, group in sorted(auto_plan.by_micro_batches(found).items()):
    if any(auto_plan.too_small(compute, m) for m in compute):
      continue   # smaller than micro-batches already too small: not profiled
    # The executor inlines some candidates' tasks and calls the stage functions for others
    # (windows too large to inline): a profile for each way, timed as it runs; none for a
    # candidate the epochs table rules out whatever its speed.
    ways, copies = {}, {}
    for c in group:
      if not auto_plan.epochs_out(c, factors):
        inline, copies[c] = _executed(pipe, c.method, M, num_batches)
        if c == trained:   # its windows are traced: no start-up left
          copies[c] = [0] * K
        ways.setdefault(inline, []).append(c)
        starts[c] = _start(traced, inline, K, copies[c])
    if least is not None:   # none profiled at M where none can beat the best at its least
      floor = floors(copies, least)
      if all(s >= best for s in floor.values()):
        bounded.update(floor)
        continue
    at_m, window = [], min(num_batches, pipe.runtime.window)
    for inline, members in sorted(ways.items()):
      if auto_plan.too_small(compute, M):
        break
      if (M not in compute and not _traced_way(traced, inline)
          and _traced_way(traced, not inline)):
        # A way not traced yet (its traces: seconds a transformer stage): M's compute first,
        # timed the other way (traced for any batch size, so no trace), which may show M
        # too small or unable to win (its compute is the same either way).
        costs = _profile(pipe, features, labels, M, not inline, members[0].method, window,
                         traced)
        if timed(costs):
          continue
        at_m.append(_least(costs, cores))
        floor = floors(members, at_m[-1])
        if all(s >= best for s in floor.values()):
          bounded.update(floor)
          continue
      costs = _profile(pipe, features, labels, M, inline, members[0].method, window, traced)
      if M == 1:   # one batch per update: the update runs inside each backward
        costs = dataclasses.replace(costs, backward=[b + costs.update for b in costs.backward],
                                    update=0.0)
      if timed(costs):
        continue   # too small to keep a device busy: not played out (up to 0.3 s each)
      at_m.append(_least(costs, cores))
      for c in members:   # the schedules that keep least first: a tie goes their way
        starts[c] = _start(traced, inline, K, copies[c])
        floor = auto_plan.seconds_to_accuracy(c, batch_size / at_m[-1], factors, samples,
                                              starts[c])
        if floor >= best:
          bounded[c] = floor
          continue
        speeds[c] = costs_lib.predict(costs, c.method, batch_size, M,
                                      num_batches=simulated_batches(K, M))
        best = min(best, auto_plan.seconds_to_accuracy(c, speeds[c], factors, samples,
                                                       starts[c]))
    least = min(at_m) if at_m else least
  rows = auto_plan.rank(found, speeds, compute, factors, samples=samples, start=starts,
                        bounded=bounded)
  lines = auto_plan.report_lines(rows, batch_size, num_batches)
  return Choice(rows[0].candidate, rows, lines, time.perf_counter() - start, epochs)


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


class Chooser:
  """`method="auto"` as one object: the user's options (`asked`, the method left to it), the
  probe training first (`probe`), the choice (`chosen`) and its hand-over of the pipeline's
  options and executor. `Pipeline` builds the probe's pipeline (`probe_options`) and calls
  `before_fit` at each fit's start and `after_fit` at its end; between them the fit loop
  times the probe through `watch()` and hands the rest of the fit over at its verdict."""

  def __init__(self, asked: options_lib.Asked):
    refused = refuse_chosen_options(asked)
    if refused:
      raise ValueError(f"method='auto' chooses {', '.join(refused)}: leave "
                       f"{'it' if len(refused) == 1 else 'them'} unset, or name a method")
    self.asked = asked
    self.chosen: Optional[Choice] = None
    self.probe: Optional[Probe] = None
    self.verbose: Any = 0   # the fit's verbosity (what a hand-over prints)

  @property
  def probe_options(self) -> options_lib.Asked:
    """The options the pipeline is built with until the choice: `PROBE`'s."""
    return dataclasses.replace(self.asked, **PROBE)

  @property
  def choosing(self) -> bool:
    """Whether the choice is yet to be made (at the first fit)."""
    return self.chosen is None

  def before_fit(self, pipe, x, y, batch_size, steps, sample_weight, class_weight, verbose,
                 epochs: int) -> None:
    """At a fit's start, before the first choice: where the probe trains first
    (`trains_first`) sets up its timing (`Probe`, read by the fit loop through `watch`); else
    profiles the first batch, chooses, and hands `pipe` over to the choice on the probe's
    stage programs where their tasks and updates are the choice's (`assemble.adopt`: every
    synchronous schedule that keeps 1f1b's table rows, at any M): no second compile, and the
    accumulators and the update the profile traced (on one stage) are training's; else
    builds them again, compiled as the user compiled. Measured (`bench/time_to_accuracy.py`'s
    12-layer transformer, "counting", K=4, pairs of processes): the first epoch after the
    profile 4.54-4.87 s compiled again, 4.02-4.19 s on the probe's programs. (Training's
    windows calling the forwards the profile traced, for a batch of any size, started 0.2 s
    sooner still but ran their epochs 2-12% slower than forwards traced for the
    micro-batch: not kept.)"""
    self.verbose = verbose
    if not self.choosing:
      return
    probe, num_batches = fit_data.dataset(pipe, x, y, batch_size, steps,
                                          sample_weight=sample_weight,
                                          class_weight=class_weight)
    first = next(iter(probe))
    features, labels = first[0], first[1]
    size = int(tf.nest.flatten(features)[0].shape[0])
    last = fit_data.last_batch(pipe, x, batch_size, steps)
    if trains_first(pipe, size, last):
      self.probe = Probe(features, labels, size, last)
      if verbose != 0:
        M = PROBE["micro_batches"]
        print(f"method='auto' trains its probe, {PROBE['method']} M={M} (micro-batches of "
              f"{size // M}), from the first batch and times it; it profiles the candidates "
              "only where the rest of the fit can pay for it")
      return
    self.chosen = choose(pipe, features, labels, size, num_batches or 16, max(epochs, 1))
    self._hand_over(pipe)
    if verbose != 0:
      print(self.chosen.summary())

  def watch(self) -> Optional["Chooser"]:
    """What the fit loop times while the probe trains first (None otherwise): its hooks
    `epoch_begins`, `result`, `due` and `hand_over`."""
    return self if self.probe is not None else None

  def epoch_begins(self, num_batches: int, window: int) -> None:
    """An epoch of `num_batches` mini-batches starts, in the executor's windows of `window`."""
    if self.probe is not None:
      self.probe.epoch_begins(num_batches, window)

  def result(self, b: int, rest: int) -> bool:
    """Mini-batch b of the epoch finished, `rest` left in the fit: True where the epoch stops
    here for the profile (`Probe.result`)."""
    return (self.probe is not None and self.probe.verdict is None
            and self.probe.result(b, rest))

  @property
  def due(self) -> bool:
    """Whether the probe has its verdict and the hand-over is due."""
    return self.probe is not None and self.probe.verdict is not None

  def hand_over(self, pipe, trained: int, rest: int, num_batches: int = 16) -> Tuple[bool, bool]:
    """At the probe's verdict (`trained` mini-batches into the fit, `rest` left): keeps the
    probe, or profiles (`choose`, the rest of the fit weighed) and hands the rest to the
    choice on the probe's stage programs (`assemble.adopt`: the same tasks, so the same
    updates as Keras's from here on, the optimizers' state kept; the new executor continues
    the old one's counts). Returns (whether the executor changed, whether the epoch goes on
    from where it stopped for the profile)."""
    probe = self.probe
    self.probe = None
    if probe.verdict != "profile":
      self.chosen = kept_probe(probe, max(rest // max(num_batches, 1), 1))
    else:
      epochs = max(-(-rest // max(num_batches, 1)), 1)
      for program in pipe.programs:   # the weights so far: what the profile puts back
        program.write_to_model()
      chosen = choose(pipe, probe.features, probe.labels, probe.batch_size, num_batches,
                      epochs, samples=rest * probe.batch_size, trained=probe_candidate(),
                      last_batch=probe.last_batch)
      self.chosen = dataclasses.replace(chosen, after=trained)
    if self.verbose != 0:
      print(self.chosen.summary())
    changed = self._hand_over(pipe, before=pipe.runtime)
    return changed, probe.verdict == "profile"

  def after_fit(self, pipe, num_batches: int) -> None:
    """At a fit's end: the probe, still training first without a verdict, is kept."""
    if self.probe is not None:
      self.hand_over(pipe, 0, 0, num_batches)

  def _hand_over(self, pipe, before=None) -> bool:
    """`pipe` takes the choice's options; its executor runs them on the probe's stage
    programs where their tasks are the choice's (`assemble.adopt`), else (before training
    only) it is compiled again. `before`: the executor that trained so far, whose counts the
    new one continues (the same policy and M: kept). Returns whether the executor changed."""
    pipe.asked = asked_for(self.asked, self.chosen.candidate)
    checked = options_lib.checked(pipe.asked, pipe.model, pipe.num_stages)
    options, _, rules = options_lib.resolved(checked, pipe.asked, pipe.model,
                                             pipe.inner_optimizer, pipe.num_stages)
    if (before is not None and options.policy == pipe.options.policy
        and options.micro_batches == pipe.micro_batches):
      return False
    if assemble.adopt(pipe.programs, options.policy, rules):
      pipe.options = options
      pipe.runtime = assemble.executor(pipe, pipe.programs, pipe.AUTO_WINDOW)
      if before is not None:
        pipe.runtime.take_over(before)
      return True
    if before is not None:
      raise AssertionError(f"{self.chosen.name} cannot take over the probe's stage programs")
    pipe.options = checked
    pipe.recompile()
    return True
