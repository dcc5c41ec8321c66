"""Schedule verifier: runs a schedule on paper under the runtime's queue rules (pure Python).

K: stages, k: stage index, b: mini-batch, i: micro-batch. A schedule passes when
  - every stage runs the same forwards, each exactly once; each forward is
    covered by exactly one backward; micro-batch backwards are applied by an
    update U of their mini-batch; an early receive R is followed by its B;
  - at the last stage, each B comes right after the forwards it covers (the
    stage runs them as one step);
  - played out with the runtime's semantics it finishes: a task waits for its
    data (the forward of its unit at k-1; the output gradient from k+1, or its
    own R; its own forwards), items on a link arrive in the order sent (FIFO),
    a task that sends waits while `capacity` items are in flight on its link,
    a barrier S(t) waits until every stage has reached it, and with joint
    updates (`schedules.jointly_updated`) an update U(b) waits until every
    stage has run its backwards of b.
It returns the order it ran and, per stage, the peaks the schedule implies:
forward states kept at once, distinct weight versions among them (what a
stash holds), and the staleness between a forward and its backward. A
schedule that fails is refused with a `ScheduleError` naming stage and task.
"""

import collections
import gc
from typing import Any, Deque, Dict, List, Optional, Sequence, Set, Tuple
import dataclasses

from tfpipe.plan import policies, schedules, tasks as task_table

__all__ = ["format_grid", "ScheduleError", "Report", "verify", "covered_units", "memory_table",
           "format_memory_table"]


class ScheduleError(ValueError):
  """A schedule that cannot run correctly, with the stage and task that show why."""


@dataclasses.dataclass
class Report:
  order: List[Tuple[int, schedules.Task]]   # every task, in an order respecting dependencies
  peak_states: List[int]      # per stage: most forward states (activations or inputs) kept
  peak_versions: List[int]    # per stage: most distinct weight versions among the kept states
  staleness: List[int]        # per stage: most updates between a forward and its backward
  peak_in_flight: List[Tuple[int, ...]]   # per cut k -> k+1: most items in flight (fwd, bwd)


def covered_units(tasks: Sequence[schedules.Task]
                  ) -> Dict[schedules.Task, List[schedules.Unit]]:
  """For each B task of one stage, the forward units (batch, micro) it covers."""
  forwards = collections.defaultdict(list)
  for t in tasks:
    if t.kind == "F":
      forwards[t.batch].append((t.batch, t.micro))
  return {t: ([(t.batch, t.micro)] if t.micro is not None else forwards[t.batch])
          for t in tasks if t.kind == "B"}


def _micro_backwards(tasks: Sequence[schedules.Task]) -> Dict[int, List[schedules.Task]]:
  """Mini-batch -> its micro-batch B tasks, in one stage's list."""
  result = collections.defaultdict(list)
  for t in tasks:
    if t.kind == "B" and t.micro is not None:
      result[t.batch].append(t)
  return result


def _structure(schedule: schedules.Lists) -> None:
  """Checks what a schedule must contain, before it is played out."""
  if not schedule or any(not isinstance(tasks, (list, tuple)) for tasks in schedule):
    raise ScheduleError("a schedule is a non-empty list of per-stage task lists")
  K = len(schedule)
  units0 = [(t.batch, t.micro) for t in schedule[0] if t.kind == "F"]
  for k, tasks in enumerate(schedule):
    seen = set()
    for t in tasks:
      if t.kind not in "FBWURS" or len(t.kind) != 1:
        raise ScheduleError(f"stage {k}: unknown task kind {t.kind!r} in {t}")
      if t in seen:
        raise ScheduleError(f"stage {k} runs {t} twice")
      seen.add(t)
    units = [(t.batch, t.micro) for t in tasks if t.kind == "F"]
    if sorted(units, key=repr) != sorted(units0, key=repr):
      missing = sorted(set(units0) - set(units), key=repr)
      extra = sorted(set(units) - set(units0), key=repr)
      what = (f"has no forward {schedules.Task('F', *missing[0])} that stage 0 runs" if missing
              else f"runs forward {schedules.Task('F', *extra[0])} that stage 0 does not")
      raise ScheduleError(f"stage {k} {what}")
    cover = covered_units(tasks)
    unit_set, owner = set(units), {}  # type: Set[schedules.Unit], Dict[schedules.Unit, schedules.Task]
    for b_task, units_ in cover.items():
      if not units_:
        raise ScheduleError(f"stage {k}: {b_task} covers no forward")
      for u in units_:
        if u not in unit_set:
          raise ScheduleError(f"stage {k}: {b_task} has no forward {schedules.Task('F', *u)}")
        if u in owner:
          raise ScheduleError(f"stage {k}: forward {schedules.Task('F', *u)} has two backwards, "
                              f"{owner[u]} and {b_task}")
        owner[u] = b_task
    for u in units:
      if u not in owner:
        raise ScheduleError(f"stage {k}: forward {schedules.Task('F', *u)} has no backward")
    barriers = [t for t in tasks if t.kind == "S"]
    barriers0 = [t for t in schedule[0] if t.kind == "S"]
    if barriers != barriers0:
      diff = next((a, b) for a, b in zip(barriers + [None] * len(barriers0),
                                         barriers0 + [None] * len(barriers)) if a != b)
      raise ScheduleError(
          f"stage {k}'s barriers differ from stage 0's: stage {k} has {diff[0] or 'none'} where "
          f"stage 0 has {diff[1] or 'none'} (every stage must pass the same barriers in order)")
    updates = {t.batch for t in tasks if t.kind == "U"}
    micro_backwards = _micro_backwards(tasks)
    _check_weight_halves(k, K, tasks, micro_backwards)
    for t in tasks:
      if t.kind == "B" and t.micro is not None and t.batch not in updates:
        raise ScheduleError(f"stage {k}: {t} accumulates a gradient that no U{t.batch} applies")
      if t.kind == "U" and not micro_backwards[t.batch]:
        raise ScheduleError(f"stage {k}: {t} has no micro-batch backward to apply")
      if t.kind == "R":
        if k == K - 1:
          raise ScheduleError(f"stage {k} is the last stage: it has no gradient to receive ({t})")
        if schedules.Task("B", t.batch, t.micro) not in seen:
          raise ScheduleError(f"stage {k}: {t} receives for a backward the stage does not run")
  last = schedule[-1]
  where = {t: j for j, t in enumerate(last)}
  for b_task, units_ in covered_units(last).items():
    j = where[b_task]
    between = last[max(0, j - len(units_)):j]
    if [(t.kind, t.batch, t.micro) for t in between] != [("F",) + u for u in units_]:
      raise ScheduleError(
          f"stage {K - 1} is the last stage: {b_task} must come right after its forwards "
          f"({', '.join(str(schedules.Task('F', *u)) for u in units_)})")


def _weight_halves(tasks: Sequence[schedules.Task]) -> Dict[int, List[schedules.Task]]:
  """Mini-batch -> its W tasks (the weight-gradient halves of a zero-bubble schedule)."""
  result = collections.defaultdict(list)
  for t in tasks:
    if t.kind == "W":
      result[t.batch].append(t)
  return result


def _check_weight_halves(k: int, K: int, tasks: Sequence[schedules.Task],
                         micro_backwards: Dict[int, List[schedules.Task]]) -> None:
  """A stage splits a mini-batch's backwards into B and W halves for all its micro-batches or
  none; each W follows its B."""
  halves, seen = _weight_halves(tasks), set()
  for t in tasks:
    if t.kind == "W":
      if schedules.Task("B", t.batch, t.micro) not in seen:
        raise ScheduleError(f"stage {k}: {t} comes before its {schedules.Task('B', *t[1:])}")
    seen.add(t)
  for b, ws in halves.items():
    wanted = {o.micro for o in micro_backwards[b]}
    if {w.micro for w in ws} != wanted:
      missing = sorted(i for i in wanted - {w.micro for w in ws} if i is not None)
      raise ScheduleError(f"stage {k}: mini-batch {b} splits some backwards into B and W but not "
                          f"{schedules.Task('B', b, missing[0]) if missing else 'all'}")


def verify(schedule: schedules.Lists, capacity: Optional[float] = None) -> Report:
  """Checks `schedule` (see the module docstring); returns its `Report`. A broken schedule
  raises `ScheduleError`, its message ending with the schedule as a grid (`format_grid`).

  `capacity`: the most items a link holds in flight (None: unbounded).
  """
  # The play-out allocates a tuple or two per task and frees none in cycles: Python's cyclic
  # collector, left on, scanned the whole heap (TensorFlow's graphs too) again and again,
  # 2-10x the verifier's own time (1f1b, K=4, M=8: 0.97 against 0.29 ms a mini-batch).
  collecting = gc.isenabled()
  gc.disable()
  try:
    return _verify(schedule, capacity)
  except ScheduleError as error:
    raise ScheduleError(f"{error}\n{format_grid(schedule)}") from None
  finally:
    if collecting:
      gc.enable()


def format_grid(schedule: Any, width: int = 16) -> str:
  """`schedule` as a grid: a row per stage (its device's lane order), a column per step of
  its list, at most `width` steps shown (the rest counted)."""
  if not isinstance(schedule, (list, tuple)) or not all(
      isinstance(tasks, (list, tuple)) for tasks in schedule):
    return f"(the schedule is not a list of task lists: {type(schedule).__name__})"
  rows = [[str(t) for t in tasks[:width]] for tasks in schedule]
  size = max([len(cell) for row in rows for cell in row] + [2])
  steps = range(max(map(len, rows), default=0))
  lines = [("stage | " + " ".join(str(i).ljust(size) for i in steps)).rstrip()]
  for k, (tasks, row) in enumerate(zip(schedule, rows)):
    more = f" ... (+{len(tasks) - width})" if len(tasks) > width else ""
    lines.append(f"{k:>5} | " + " ".join(cell.ljust(size) for cell in row).rstrip() + more)
  return "\n".join(lines)


def _verify(schedule: schedules.Lists, capacity: Optional[float]) -> Report:
  _structure(schedule)
  capacity = float("inf") if capacity is None else capacity
  if capacity < 1:
    raise ScheduleError(f"link capacity must be at least 1. Received: {capacity}")
  play = _PlayOut(schedule, capacity)
  play.run_lanes()
  return Report(play.order, play.peaks["states"], play.peaks["versions"], play.peaks["stale"],
                [(a, b) for a, b in play.in_flight])


class _PlayOut:
  """`schedule` played out task by task on links of `capacity` items: what each stage has
  done, the units on each link, the forwards each stage holds (with the updates it had made
  at each), and the peaks `Report` gives."""

  def __init__(self, schedule: schedules.Lists, capacity: float) -> None:
    K = self.K = len(schedule)
    self.schedule, self.capacity = schedule, capacity
    self.fwd: List[Deque[schedules.Unit]] = [collections.deque() for _ in range(K - 1)]
    self.bwd: List[Deque[schedules.Unit]] = [collections.deque() for _ in range(K - 1)]
    self.cover = [covered_units(tasks) for tasks in schedule]
    self.micro_backwards = [_micro_backwards(tasks) for tasks in schedule]
    self.halves = [_weight_halves(tasks) for tasks in schedule]
    self.split = [{(w.batch, w.micro) for ws in h.values() for w in ws} for h in self.halves]
    self.done: List[Set[schedules.Task]] = [set() for _ in range(K)]
    self.received: List[Set[schedules.Unit]] = [set() for _ in range(K)]
    self.pos = [0] * K
    self.held: List[Dict[schedules.Unit, int]] = [{} for _ in range(K)]   # unit -> updates at F
    self.updates = [0] * K
    self.peaks = dict(states=[0] * K, versions=[0] * K, stale=[0] * K)
    self.in_flight = [[0, 0] for _ in range(K - 1)]
    self.order: List[Tuple[int, schedules.Task]] = []
    self.joint = getattr(schedule, "joint", False)   # `schedules.jointly_updated`
    # b -> every stage's (k, B or W of b)
    self.accumulations: Dict[int, List[Tuple[int, schedules.Task]]] = collections.defaultdict(
        list)
    for j, tasks in enumerate(schedule):
      for o in tasks:
        if o.kind in ("B", "W"):
          self.accumulations[o.batch].append((j, o))

  def blocked(self, k: int, t: schedules.Task) -> Optional[str]:
    """Why task t of stage k cannot run now (None when it can)."""
    if t.kind == "S":
      for j in range(self.K):
        if t not in self.done[j] and (self.pos[j] >= len(self.schedule[j])
                                      or self.schedule[j][self.pos[j]] != t):
          return f"waits for stage {j} to reach the barrier"
      return None
    if t.kind == "F":
      return self._forward_blocked(k, t)
    return self._backward_blocked(k, t)

  def _forward_blocked(self, k: int, t: schedules.Task) -> Optional[str]:
    fwd, unit = self.fwd, (t.batch, t.micro)
    if k > 0:
      if not fwd[k - 1]:
        return f"waits for stage {k - 1}'s {t}"
      if fwd[k - 1][0] != unit:
        raise ScheduleError(
            f"stage {k} expects {t} but stage {k - 1} sent "
            f"{schedules.Task('F', *fwd[k - 1][0])} first (the links are FIFO)")
    if k < self.K - 1 and len(fwd[k]) >= self.capacity:
      return f"its output link to stage {k + 1} is full"
    return None

  def _backward_blocked(self, k: int, t: schedules.Task) -> Optional[str]:
    """Why a B, W, U or R task cannot run now (None when it can)."""
    bwd, done, unit = self.bwd, self.done, (t.batch, t.micro)
    if t.kind == "B":
      for u in self.cover[k][t]:
        if ("F",) + u not in done[k]:   # a Task equals (and hashes as) its tuple
          return f"waits for its own {schedules.Task('F', *u)}"
    if t.kind == "R" or (t.kind == "B" and k < self.K - 1 and unit not in self.received[k]):
      if not bwd[k]:
        return f"waits for stage {k + 1}'s B{t.batch}" + ("" if t.micro is None else f".{t.micro}")
      if bwd[k][0] != unit:
        raise ScheduleError(
            f"stage {k} expects the gradient of {schedules.Task('B', *unit)} but stage {k + 1} "
            f"sent {schedules.Task('B', *bwd[k][0])} first (the links are FIFO)")
    if t.kind == "B":
      if k > 0 and len(bwd[k - 1]) >= self.capacity:
        return f"its output link to stage {k - 1} is full"
    if t.kind == "W" and ("B",) + unit not in done[k]:
      return f"waits for its own {schedules.Task('B', *unit)}"
    if t.kind == "U":
      for o in self.micro_backwards[k][t.batch] + self.halves[k][t.batch]:
        if o not in done[k]:
          return f"waits for its own {o}"
      if self.joint:
        for j, o in self.accumulations[t.batch]:
          if o not in done[j]:
            return f"waits for stage {j}'s {o} (joint updates)"
    return None

  def run(self, k: int, t: schedules.Task) -> None:
    """Runs task t of stage k: its links, held forwards, updates and the peaks."""
    unit, fwd, bwd, held, peaks = (t.batch, t.micro), self.fwd, self.bwd, self.held, self.peaks
    if t.kind == "F":
      if k > 0:
        fwd[k - 1].popleft()
      if k < self.K - 1:
        fwd[k].append(unit)
        self.in_flight[k][0] = max(self.in_flight[k][0], len(fwd[k]))
      held[k][unit] = self.updates[k]
      peaks["states"][k] = max(peaks["states"][k], len(held[k]))
      peaks["versions"][k] = max(peaks["versions"][k], len(set(held[k].values())))
    elif t.kind == "R":
      bwd[k].popleft()
      self.received[k].add(unit)
    elif t.kind == "B":
      if k < self.K - 1 and unit not in self.received[k]:
        bwd[k].popleft()
      if k > 0:
        bwd[k - 1].append(unit)
        self.in_flight[k - 1][1] = max(self.in_flight[k - 1][1], len(bwd[k - 1]))
      for u in self.cover[k][t]:
        peaks["stale"][k] = max(peaks["stale"][k], self.updates[k] - held[k][u])
        if u not in self.split[k]:   # a split backward's state stays until its W
          del held[k][u]
    elif t.kind == "W":
      del held[k][unit]
    if schedules.is_update(t):
      self.updates[k] += 1
    self.done[k].add(t)
    self.order.append((k, t))

  def run_lanes(self) -> None:
    """Each device runs its lane in order (a stage per device, or several:
    `schedules.Schedule`) as far as its next task can run, waking its neighbours; raises
    where every device is stuck before its lane's end (a deadlock)."""
    K, lanes = self.K, schedules.lanes(self.schedule)
    shared = len(lanes) != K
    lane_of = {k: d for d, lane in enumerate(lanes) for k, _ in lane}
    at = [0] * len(lanes)
    pending, queued = collections.deque(range(len(lanes))), set(range(len(lanes)))
    while pending:
      d = pending.popleft()
      queued.discard(d)
      progressed, barrier, ran = False, False, set()
      while at[d] < len(lanes[d]) and self.blocked(*lanes[d][at[d]]) is None:
        k, t = lanes[d][at[d]]
        barrier = barrier or t.kind == "S"
        self.run(k, t)
        self.pos[k] += 1
        at[d] += 1
        progressed = True
        ran.add(k)
      if progressed:
        wake = (range(len(lanes)) if barrier or shared else
                {lane_of[j] for k in ran for j in (k - 1, k + 1) if 0 <= j < K})
        for j in wake:
          if j not in queued:
            pending.append(j)
            queued.add(j)
    if any(at[d] < len(lane) for d, lane in enumerate(lanes)):
      heads = [lane[at[d]] for d, lane in enumerate(lanes) if at[d] < len(lane)]
      stuck = "; ".join(f"stage {k} at {t} ({self.blocked(k, t)})" for k, t in heads)
      raise ScheduleError(f"schedule deadlocks: no stage can run its next task: {stuck}")


def memory_table(K: int, M: int = 4, N: Optional[int] = None,
                 methods: Sequence[str] = policies.PIPELINE_METHODS) -> Dict[str, Tuple[str, List[int], List[int]]]:
  """Per method, what each stage keeps at its peak, from the verified schedule.

  Returns {method: (kept, states, versions)}: `kept` is "activations" (a
  forward's whole state, kept for its backward) or "inputs" (stage inputs,
  recomputed before the backward); states[k] the most kept at once at stage
  k; versions[k] the most distinct weight versions they were computed with,
  which a method whose backward reads its forward's weights must keep (0
  where the backward reads the current or a new predicted version).
  Interleaved (V stages per device) is in the default table only where K
  stages make K/V devices and M is a multiple of them; asked for by name
  otherwise, its error says why.
  """
  N = N or 2 * K + 2
  table: Dict[str, Tuple[str, List[int], List[int]]] = {}
  requested = () if methods is policies.PIPELINE_METHODS else tuple(methods)
  for method in methods:
    policy = policies.policy_for(method)
    always = schedules.kind_of(policy.schedule).micro_batches == "always"
    m = policies.micro_batches_for(policy, M if always else None)
    V = policy.virtual_stages
    if V > 1 and (K % V or m % (K // V)) and method not in requested:
      continue   # the K stages do not make V chunks per device in groups of M micro-batches
    report = verify(policies.build_schedule(policy, K, N, m))
    # A blend (I-TiMePReSt) keeps the forward's weights until the backward, as a stash.
    versions = report.peak_versions if task_table.keeps_weights(policy) else [0] * K
    table[method] = ("inputs" if policy.recompute else "activations", report.peak_states,
                     versions)
  return table


def format_memory_table(table: Dict[str, Tuple[str, List[int], List[int]]]) -> str:
  """The memory table as text, one row per method."""
  K = len(next(iter(table.values()))[1])
  head = f"{'method':<16}{'keeps':<13}" + "".join(f"{'stage ' + str(k):>16}" for k in range(K))
  rows = [head, f"{'':<29}" + "".join(f"{'states/versions':>16}" for _ in range(K))]
  for method, (kept, states, versions) in table.items():
    rows.append(f"{method:<16}{kept:<13}" +
                "".join(f"{f'{s}/{v}':>16}" for s, v in zip(states, versions)))
  return "\n".join(rows)
