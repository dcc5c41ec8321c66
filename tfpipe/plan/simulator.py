"""Simulator: a schedule's timeline and throughput from per-stage times (pure Python).

K: stages, k: stage index, N: mini-batches, M: micro-batches per mini-batch.
Given each stage's forward and backward time for one mini-batch and each
cut's transfer time, `simulate` plays the verified schedule out: a task
starts when its stage is free and its inputs have arrived; each link moves
one item at a time (a transfer thread per direction). Times scale with the
share of the mini-batch a task covers (1/M for a micro-batch). At the last
stage a forward only receives; its backward runs forward and backward as
one step. A backward that recomputes (vanilla, feature_replay, timeprest,
recompute=True) costs its stage's forward time more. A split backward (zero-bubble)
runs as B, `input_share` of the backward, and W, the rest. A barrier S(t) (lock-step
DDG) ends when the last stage reaches it.

`simulate_data_parallel` models the layer-wise partitioning paper's synchronous data parallelism
through a parameter host (P workers, gradients out and weights back over one
link, overlapped with the next iteration's computation).
"""

import bisect
import collections
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple
import statistics

from tfpipe.plan import policies, schedules, verify
from tfpipe.plan.records import STEP, TaskRecord, kind_of

__all__ = ["Costs", "Timeline", "simulate", "simulate_method", "simulate_data_parallel",
           "costs_from_records"]


@dataclasses.dataclass
class Costs:
  """Seconds per mini-batch: forward[k], backward[k] (without recomputation), transfer[k] across
  cut k -> k+1 (the gradient back takes the same), update: one optimizer update; input_share:
  the part of a backward that a split backward's B takes (the stage input's gradient), the
  rest being its W (the weight gradient); about half for matrix products.

  On hosts joined by links (`tfpipe.plan.network`): reduce[k], seconds per mini-batch stage
  k's replicas take to sum their gradients (data parallel), during which its device waits
  after its update's compute; feed, seconds per mini-batch to bring the first stage its
  input from the client over a link of its own (sent ahead: only its rate binds).

  What the executor pays besides (`tfpipe.instruments.costs` measures both): per_task,
  seconds every compute task costs whatever its size (a call's dispatch); cores, how many
  devices' worth of compute run at once when the devices share the machine's cores
  (logical CPU devices; measured, so it may be fractional: a task then takes the earliest
  gap on one of ceil(cores) cores, and the run takes at least its work / cores; None:
  every device computes on its own); ordered: each device runs its tasks one at a time in
  the schedule's order (tasks as calls, a thread per stage). With shared cores and not
  ordered (tasks traced into one graph, which runs every op whose inputs are ready), a
  device's tasks wait only for their inputs, a forward for the last weight update before it
  on its device, an update for the gradients before it."""
  forward: List[float]
  backward: List[float]
  transfer: Optional[List[float]] = None
  update: float = 0.0
  input_share: float = 0.5
  per_task: float = 0.0
  cores: Optional[float] = None
  ordered: bool = True
  reduce: Optional[List[float]] = None
  feed: float = 0.0

  def __post_init__(self) -> None:
    K = len(self.forward)
    self.reduce = [0.0] * K if self.reduce is None else list(self.reduce)
    if len(self.reduce) != K:
      raise ValueError(f"need one reduce time per stage ({K}). Received: {self.reduce}")
    if min(self.reduce + [self.feed]) < 0:
      raise ValueError(f"reduce and feed times must be >= 0. Received: reduce={self.reduce}, "
                       f"feed={self.feed}")
    if len(self.backward) != K:
      raise ValueError(f"need one backward time per stage: {K} forward times, "
                       f"{len(self.backward)} backward times")
    self.transfer = [0.0] * (K - 1) if self.transfer is None else list(self.transfer)
    if len(self.transfer) != K - 1:
      raise ValueError(f"need one transfer time per cut ({K - 1}). Received: {self.transfer}")
    if min(list(self.forward) + list(self.backward) + list(self.transfer) + [self.update]) < 0:
      raise ValueError("times must be >= 0")
    if not 0.0 <= self.input_share <= 1.0:
      raise ValueError(f"input_share must be in [0, 1]. Received: {self.input_share}")
    if self.per_task < 0:
      raise ValueError(f"per_task must be >= 0. Received: {self.per_task}")
    if self.cores is not None and not (isinstance(self.cores, (int, float))
                                       and self.cores >= 1):
      raise ValueError(f"cores must be a number >= 1 or None. Received: {self.cores!r}")


@dataclasses.dataclass
class Timeline:
  tasks: List[Tuple[int, schedules.Task, float, float]]   # (k, task, start, end)
  makespan: float
  busy: List[float]       # per stage: seconds computing
  batches: int     # N
  # (sending k, "XF" | "XB", unit, start, end)
  transfers: List[Tuple[int, str, schedules.Unit, float, float]] = dataclasses.field(
      default_factory=list)
  devices: Optional[int] = None   # devices the stages run on (None: one per stage)

  def records(self) -> List[TaskRecord]:
    """The timeline as the runtime records it (`tfpipe.plan.records.TaskRecord`s, epoch 0): the
    last stage's forward inside its FB step, transfers as XF / XB; for `tfpipe.instruments.breakdown`."""
    K = len(self.busy)
    out = []
    for k, task, start, end in self.tasks:
      if k == K - 1 and task.kind == "F":
        continue
      out.append(TaskRecord(k, kind_of(k, K, task.kind), task.batch, None, None, start,
                            end, task.micro))
    out += [TaskRecord(k, kind, b, None, None, start, end, i)
            for k, kind, (b, i), start, end in self.transfers]
    return sorted(out, key=lambda r: r.start)

  @property
  def idle(self) -> List[float]:
    """Per stage: seconds not computing between 0 and the end of the schedule."""
    return [self.makespan - b for b in self.busy]

  @property
  def bubble(self) -> float:
    """The share of device time idle: 1 - busy / (devices * makespan)."""
    devices = self.devices or len(self.busy)
    return 1.0 - sum(self.busy) / (devices * self.makespan) if self.makespan else 0.0

  @property
  def step_time(self) -> float:
    return self.makespan / self.batches

  def samples_per_second(self, batch_size: int) -> float:
    return self.batches * batch_size / self.makespan if self.makespan else float("inf")


def _share(units: Sequence[schedules.Unit], M: int) -> float:
  return sum(1.0 / M if i is not None else 1.0 for _, i in units)


def _take_core(cores: List[List[Tuple[float, float]]], ready: float, seconds: float) -> float:
  """The earliest start at or after `ready` at which some core is free for `seconds`; books
  that core's interval and returns the start."""
  best: Optional[Tuple[float, int, int]] = None
  for c, busy in enumerate(cores):
    start = ready
    i = max(0, bisect.bisect_right(busy, (ready, float("inf"))) - 1)
    while i < len(busy):
      begin, end = busy[i]
      if end <= start:
        i += 1
        continue
      if begin >= start + seconds:
        break
      start = end
      i += 1
    if best is None or start < best[0]:
      best = (start, c, i)
  assert best is not None
  start, c, _ = best
  bisect.insort(cores[c], (start, start + seconds))
  return start


def _send(transfers: List[Tuple[int, str, schedules.Unit, float, float]], link: List[float],
          k: int, ready: float, seconds: float, what: Tuple[int, str, schedules.Unit]) -> float:
  """Sends over `link[k]` once it is free and `ready`, for `seconds`; records the transfer
  `what` (sender, kind, unit) with its start and end in `transfers`; returns its end."""
  start = max(ready, link[k])
  link[k] = start + seconds
  transfers.append(what + (start, link[k]))
  return link[k]


def _seconds(costs: Costs, K: int, k: int, task: schedules.Task, share: float, split: bool,
             recompute: bool) -> float:
  """The compute seconds of `task` of stage k on a unit of `share` of its mini-batch (the
  per-task dispatch left out): the last stage's forward and backward run as one at its B;
  `split`: its backward runs as two halves, B (`input_share`) and W; `recompute`: a backward
  runs its forward again first."""
  if task.kind == "F":
    return costs.forward[k] * share if k < K - 1 else 0.0
  if task.kind == "B":
    part = costs.input_share if split else 1.0
    if k == K - 1:
      return (costs.forward[k] + costs.backward[k] * part) * share
    return (costs.backward[k] * part + (costs.forward[k] if recompute else 0.0)) * share
  if task.kind == "W":   # a split backward's weight half (it recomputes too)
    again = costs.forward[k] if recompute and k < K - 1 else 0.0
    return (costs.backward[k] * (1.0 - costs.input_share) + again) * share
  return costs.update if task.kind == "U" else 0.0


def simulate(schedule: schedules.Lists, costs: Costs, recompute: bool = False) -> Timeline:
  """Plays `schedule` out with `costs` (a `Costs`); returns its `Timeline`."""
  K = len(schedule)
  if len(costs.forward) != K:
    raise ValueError(f"the costs are for {len(costs.forward)} stages, the schedule has {K}")
  M = schedules.micro_batches(schedule)
  order = verify.verify(schedule).order
  covers = [verify.covered_units(tasks) for tasks in schedule]
  split = [any(t.kind == "W" for t in tasks) for tasks in schedule]
  lanes = schedules.lanes(schedule)   # stages sharing a device run one task at a time
  device = {k: d for d, lane in enumerate(lanes) for k, _ in lane}
  free, busy = [0.0] * len(lanes), [0.0] * K
  shared = costs.cores is not None and costs.cores < len(lanes)
  # Each shared core's busy intervals, sorted: a task takes the earliest gap that fits it.
  cores: List[List[Tuple[float, float]]] = [
      [] for _ in range(math.ceil(costs.cores or 0) if shared else 0)]
  dataflow = shared and not costs.ordered
  updating = [any(t.kind == "U" for t in tasks) for tasks in schedule]   # else B / W update
  written = [0.0] * len(lanes)   # per device: when its last weight update ended
  gradients = [0.0] * len(lanes)   # per device: when its last B or W ended
  done: Dict[Tuple[int, str, schedules.Unit], float] = {}   # (k, kind, unit) -> end
  fwd_link, bwd_link = [0.0] * (K - 1), [0.0] * (K - 1)
  arrived_fwd: Dict[Tuple[int, schedules.Unit], float] = {}
  arrived_bwd: Dict[Tuple[int, schedules.Unit], float] = {}
  ended: Dict[Tuple[int, schedules.Task], float] = {}
  barrier: Dict[schedules.Task, float] = {}
  tasks: List[Tuple[int, schedules.Task, float, float]] = []
  transfers: List[Tuple[int, str, schedules.Unit, float, float]] = []
  transfer = costs.transfer or []
  reduce = costs.reduce or [0.0] * K
  feed_done = 0.0   # when the client's feed link is next free

  for k, task in order:
    unit = (task.batch, task.micro)
    share = _share(covers[k][task] if task.kind == "B" else [unit], M)
    start = free[device[k]]
    if dataflow:   # what the task reads: its weights' last update, its own earlier halves
      start = {"F": written[device[k]], "U": gradients[device[k]],
               "W": done.get((k, "B", unit), 0.0)}.get(task.kind, 0.0)
      if task.kind == "B" and k == K - 1:
        start = max(done.get((k, "F", u), 0.0) for u in covers[k][task])
    if task.kind == "F" and k > 0:
      start = max(start, arrived_fwd.pop((k - 1, unit)))
    elif task.kind == "F" and costs.feed:   # the input, sent ahead from the client unit by unit
      feed_done += costs.feed * share
      start = max(start, feed_done)
    elif task.kind == "R" or (task.kind == "B" and (k, unit) in arrived_bwd):
      start = max(start, arrived_bwd.pop((k, unit)))
    elif task.kind == "S":  # every stage has run its tasks before S(t) when the first one passes
      start = barrier.setdefault(task, max(free))
    seconds = _seconds(costs, K, k, task, share, split[k], recompute)
    if seconds or task.kind == "U":
      seconds += costs.per_task
      if shared:   # the task computes once a core is free for as long as it takes
        start = _take_core(cores, start, seconds)
    end = start + seconds
    if task.kind == "U":   # the device waits for its replicas' gradient sum (no compute)
      end += reduce[k]
    free[device[k]], busy[k] = max(free[device[k]], end), busy[k] + seconds
    ended[(k, task)] = end
    done[(k, task.kind, unit)] = end
    if task.kind in ("B", "W"):
      gradients[device[k]] = max(gradients[device[k]], end)
    if task.kind == "U" or (task.kind in ("B", "W") and not updating[k]
                            and not (split[k] and task.kind == "B")):
      written[device[k]] = max(written[device[k]], end)
    tasks.append((k, task, start, end))
    if task.kind == "F" and k < K - 1:
      arrived_fwd[(k, unit)] = _send(transfers, fwd_link, k, end, transfer[k] * share,
                                     (k, "XF", unit))
    if task.kind == "B" and k > 0:
      arrived_bwd[(k - 1, unit)] = _send(transfers, bwd_link, k - 1, end,
                                         transfer[k - 1] * share, (k, "XB", unit))
  N = len({t.batch for t in schedule[0]})
  makespan = max(free)
  if shared and costs.cores:   # the cores give `cores` devices' worth of compute at most
    makespan = max(makespan, sum(busy) / costs.cores)
  return Timeline(tasks, makespan, busy, N, transfers, len(lanes))


def simulate_method(method: str, costs: Costs, num_batches: int,
                    micro_batches: Optional[int] = None, recompute: Optional[bool] = None,
                    spectrain_backward: str = "reuse", lockstep: bool = False,
                    virtual_stages: Optional[int] = None) -> Timeline:
  """The timeline of `method` (its schedule and recomputation) over `num_batches` mini-batches
  (`costs`: one entry per stage, V per device with `virtual_stages`)."""
  policy = policies.policy_for(method, spectrain_backward, recompute, lockstep, virtual_stages)
  M = policies.micro_batches_for(policy, micro_batches)
  schedule = policies.build_schedule(policy, len(costs.forward), num_batches, M)
  return simulate(schedule, costs, recompute=policy.recompute)


def simulate_data_parallel(P: int, t_calc: float, t_comm: float,
                           iterations: int) -> Tuple[float, float]:
  """The layer-wise partitioning paper's fig. 4b: P workers compute a batch each (t_calc) while the
  host link moves the
  previous iteration's P gradients and P weight copies (t_comm each, one at a time).

  Returns (makespan, speedup over one worker running the same P * iterations batches).
  """
  if P < 1 or iterations < 1 or t_calc < 0 or t_comm < 0:
    raise ValueError(f"need P >= 1, iterations >= 1 and times >= 0. Received: P={P}, "
                     f"iterations={iterations}, t_calc={t_calc}, t_comm={t_comm}")
  compute_end, link, comm_end = 0.0, 0.0, [0.0]
  for _ in range(iterations):
    start = max(compute_end, comm_end[-2] if len(comm_end) > 1 else 0.0)  # one update behind
    compute_end = start + t_calc
    link = max(link, compute_end) + 2 * P * t_comm
    comm_end.append(link)
  makespan = max(compute_end, link)
  return makespan, P * iterations * t_calc / makespan if makespan else float("inf")


def costs_from_records(records: Sequence[TaskRecord], num_stages: int, micro_batches: int = 1,
                       recompute: bool = False) -> Costs:
  """`Costs` measured in a run: each stage's median task times, per mini-batch.

  `records`: `tfpipe.runtime.TaskRecord`s of a `Pipeline(record=True)` run
  (or `Timeline.records()`); a task's records (one per run of its ops, on the
  compiled executor) add up to its time; a micro-batch task counts 1/M of a
  mini-batch. With `recompute`, a backward's time includes its stage's
  forward, which is taken out. The last stage's FB step is its backward (its
  forward costs 0 here: the simulator runs the two as one step there). The
  times are the tasks' own: where the devices share cores, give the result
  the cores they share (`dataclasses.replace(costs, cores=...)`, e.g. a
  profile's, `tfpipe.instruments.costs.measure`).
  """
  K, M = num_stages, micro_batches

  def median(kind: str, k: int) -> Optional[float]:
    # A task's records add up: the compiled executor's profiler timeline gives one record
    # per run of its ops, and a task waiting for a core between its ops runs several (1F1B,
    # K=4 on 2 cores: 3-14 a task; their median was a twentieth of a task).
    tasks: Dict[Tuple[Optional[int], Optional[int], int], float] = collections.defaultdict(float)
    for r in records:
      if r.kind == kind and r.stage == k:
        tasks[(r.batch, r.micro, r.epoch)] += (r.end - r.start) * (M if r.micro is not None
                                                                    else 1)
    return statistics.median(tasks.values()) if tasks else None

  forward, backward, transfer, shares = [], [], [], []
  for k in range(K):
    if k == K - 1:
      forward.append(0.0)
      backward.append(median(STEP, k) or 0.0)
      continue
    f, b, w = median("F", k), median("B", k), median("W", k)
    if f is None or b is None:
      raise ValueError(f"no forward or backward of stage {k} in the records")
    forward.append(f)
    b = max(0.0, b - f) if recompute else b
    if w is not None:   # a split backward: B and W, each recomputing with `recompute`
      w = max(0.0, w - f) if recompute else w
      shares.append(b / (b + w) if b + w else 0.5)
      b += w
    backward.append(b)
    moves = [t for t in (median("XF", k), median("XB", k + 1)) if t is not None]
    transfer.append(sum(moves) / len(moves) if moves else 0.0)
  return Costs(forward, backward, transfer, median("U", 0) or 0.0,
               sum(shares) / len(shares) if shares else 0.5)
