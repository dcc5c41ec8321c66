"""Windows: a verified schedule cut into runs of mini-batches for the compiled executor.

K: stages, k: stage index, N: mini-batches, W: mini-batches per window,
b: mini-batch. Windows of W mini-batches, the last one shorter (`firsts`), or
when no batch hook reads their ends a first window of 1 to W, windows of W and
the drain alone (`drained_firsts`). A window finishes its mini-batches
first..last: on every stage
it holds the prefix of the stage's task list up to its last task of those
batches, minus what earlier windows hold. Because each stage keeps its own
order and the cut ends after a batch's last task on every stage, every task
of a window finds its data made in this window or an earlier one: forward
outputs in flight and forwards kept for a later backward cross the boundary
as carried state (see `tfpipe.runtime.compiled`). A boundary only splits the
trace: every task reads the weights its stage's order gives it.

Barriers S(t) order time, not data (`tfpipe.plan.schedules.ddg`); a graph has no
Python thread to hold, so windows leave them out: the weights read are the
same.

Within a window, tasks run in an order made from the window's own lists
(every dependency before its user), with batches relative to the window's
first batch, so the windows of the steady state have equal `key`s and share
one trace.
"""

import collections
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from tfpipe.plan import schedules, verify

__all__ = ["Window", "firsts", "drained_firsts", "plan", "drain", "flush_window", "crossing",
           "traced_forwards"]

class Window(NamedTuple):
  """Mini-batches `first`..`last` finish in this window. `tasks`: its `schedules.Action`s in
  trace order; `key`: the same actions with batches counted from `first`, equal for windows
  that trace alike."""
  first: int
  last: int
  tasks: List[schedules.Action]
  key: Tuple[schedules.Action, ...]


Diffs = Sequence[Mapping[schedules.Task, int]]   # per stage: each task's version difference
Done = Set[Tuple[int, schedules.Task]]


def _key(tasks: Sequence[schedules.Action], base: int) -> Tuple[schedules.Action, ...]:
  return tuple(schedules.Action(k, schedules.Task(t.kind, t.batch - base, t.micro), s,
                                tuple((b - base, i) for b, i in units))
               for k, t, s, units in tasks)


def _window(first: int, last: int, tasks: List[schedules.Action]) -> Window:
  return Window(first, last, tasks, _key(tasks, first))


def firsts(N: int, size: int) -> List[int]:
  """The first mini-batch of each window of an epoch of N: windows of `size`, the last one
  shorter. The steady windows trace alike, so an epoch traces the warm-up window, the steady
  window and the last one, which drains the pipeline. Fewer distinct windows start faster
  than smaller ones: each new window function optimises again every stage function it calls
  (`bench/window_bound.py`). Measured (12-layer Llama, K=4, spectrain, windows of 4): first
  epoch 22.7 / 22.8 / 23.5 s, against 26.3 / 25.5 / 25.1 s when the last 1 to `size`
  mini-batches ran in windows of one (6 distinct windows, not 3)."""
  return list(range(0, N, size))


def drained_firsts(N: int, size: int, lead: int) -> Optional[List[int]]:
  """The first mini-batch of each window when window ends need not fall on multiples of
  `size` (no batch hook reads them): a first window of 1 to `size` mini-batches, then
  windows of `size` that end where a steady window can (stage 0 starts `lead` - 1 batches
  past the last it finishes: the last such window ends at N - `lead`), then the drain alone
  (the last `lead` - 1 batches), so the last distinct window is the drain, not a window of
  `size` plus the drain. None when fewer than two windows of `size` fit (no steady state)."""
  end = N - lead   # the last batch a steady window can finish
  steady = end // size   # windows of `size` after a first of end + 1 - steady * size >= 1
  if steady < 2:
    return None
  first = end + 1 - steady * size
  return [0] + [first + i * size for i in range(steady)] + ([end + 1] if lead > 1 else [])


def plan(schedule: schedules.Lists, diffs: Diffs, size: int, aligned: bool = True) -> List[Window]:
  """The windows that run `schedule` (verified), `size` mini-batches at most: `firsts`, or
  when not `aligned` `drained_firsts` where its steady windows trace alike."""
  if not isinstance(size, int) or isinstance(size, bool) or size < 1:
    raise ValueError(f"a window holds a positive number of mini-batches. Received: {size!r}")
  N = 1 + max(t.batch for t in schedule[0] if t.kind == "F")
  lead = schedules.lead(schedule)
  starts = None if aligned else drained_firsts(N, size, lead)
  if starts is not None:
    windows = _cut(schedule, diffs, starts, N)
    if len({w.key for w in windows[1:1 + (N - lead) // size]}) == 1:
      return windows
  return _cut(schedule, diffs, firsts(N, size), N)


def _cut(schedule: schedules.Lists, diffs: Diffs, starts: List[int], N: int) -> List[Window]:
  """The windows that start at `starts` (ascending, from 0) in an epoch of N mini-batches."""
  K = len(schedule)
  covers = [verify.covered_units(tasks) for tasks in schedule]
  joint = _accumulations(schedule) if getattr(schedule, "joint", False) else None
  ends = [b - 1 for b in starts[1:]] + [N - 1]
  reach = [_reach(tasks) for tasks in schedule]
  cuts = [[0] * K] + [[r[min(last, len(r) - 1)] for r in reach] for last in ends]
  windows: List[Window] = []
  done: Done = set()
  for w, (first, last) in enumerate(zip(starts, ends)):
    lists = [[t for t in tasks[cuts[w][k]:cuts[w + 1][k]] if t.kind != "S"]
             for k, tasks in enumerate(schedule)]
    tasks = [schedules.Action(k, t, diffs[k].get(t, 0), tuple(covers[k].get(t, ())))
             for k, t in _order(lists, done, joint)]
    windows.append(_window(first, last, tasks))
  return windows


def _reach(tasks: Sequence[schedules.Task]) -> List[int]:
  """Per mini-batch b, 1 + the index of the last of `tasks` (barriers aside) of a mini-batch
  <= b: where a window that finishes b ends in this stage's list. One pass (a scan per window
  end made an epoch's windows of one cost O(N^2): 1.8 s of Python a fit at N=256, K=4, M=4)."""
  last_of: Dict[int, int] = {}
  for i, t in enumerate(tasks):
    if t.kind != "S":
      last_of[t.batch] = i + 1
  reach, running = [], 0
  for b in range(1 + max(last_of, default=-1)):
    running = max(running, last_of.get(b, 0))
    reach.append(running)
  return reach


def _needs(k: int, t: schedules.Task, K: int) -> Optional[Tuple[int, schedules.Task]]:
  """The other stage's task whose data task t of stage k reads (None: its own stage's)."""
  if t.kind == "F" and k > 0:
    return (k - 1, t)
  if t.kind in ("B", "R") and k < K - 1:
    return (k + 1, type(t)("B", t.batch, t.micro))
  return None


def _accumulations(schedule: schedules.Lists
                   ) -> Dict[int, List[Tuple[int, schedules.Task]]]:
  """Joint updates (`schedules.jointly_updated`): b -> every stage's (k, B or W task of b)."""
  result = collections.defaultdict(list)
  for k, tasks in enumerate(schedule):
    for t in tasks:
      if t.kind in ("B", "W"):
        result[t.batch].append((k, t))
  return result


def _order(lists: schedules.Lists, done: Done,
           joint: Optional[Dict[int, List[Tuple[int, schedules.Task]]]] = None
           ) -> List[Tuple[int, schedules.Task]]:
  """The window's tasks in trace order: stage by stage, each stage running its next tasks
  while their data is there (made earlier, or in `done`, which gains them).

  It depends on the window's own lists only, so windows alike trace alike.
  An R task and the B it serves both wait for stage k+1's B. With joint updates (`joint`:
  `_accumulations`), an update U(b) waits for every stage's backwards of b, so a decision
  over the whole gradient is traced before any stage applies it (`tfpipe.rules.joint`).
  """
  K, heads, order = len(lists), [0] * len(lists), []
  while any(heads[k] < len(lists[k]) for k in range(K)):
    progressed = False
    for k in range(K):
      while heads[k] < len(lists[k]):
        t = lists[k][heads[k]]
        need = _needs(k, t, K)
        if need is not None and need not in done and not (t.kind == "B" and (k, type(t)(
            "R", t.batch, t.micro)) in done):
          break
        if joint is not None and t.kind == "U" and any(o not in done for o in joint[t.batch]):
          break
        order.append((k, t))
        done.add((k, t))
        heads[k] += 1
        progressed = True
    if not progressed:
      raise AssertionError("a window's tasks wait on each other")   # verify() rules it out
  return order


def drain(windows: List[Window], w: int) -> Optional[Window]:
  """The window that finishes the batches already started by windows 0..w, and no other:
  what runs when training stops after window w (None when nothing is in flight)."""
  started = 1 + max(task[1].batch for win in windows[:w + 1] for task in win.tasks
                    if task[0] == 0 and task[1].kind == "F")
  tasks = [task for win in windows[w + 1:] for task in win.tasks if task[1].batch < started]
  if not tasks:
    return None
  return _window(windows[w].last + 1, started - 1, tasks)


def flush_window(schedule: schedules.Lists, diffs: Diffs) -> Optional[Window]:
  """The window of mini-batch 0 when `schedule` finishes every mini-batch before the next one
  starts and runs each alike (sequential, gpipe: a flush after each mini-batch), else None.
  Such a schedule runs as a loop over that window (`tfpipe.runtime.compiled`)."""
  windows = plan(schedule, diffs, 1)
  first = windows[0]
  alike = all(w.key == first.key and all(task.batch == w.first for _, task, _, _ in w.tasks)
              for w in windows)
  return first if alike else None


def crossing(windows: Sequence[Window], K: int) -> List[float]:
  """Per stage, the share of its backwards whose forward ran in an earlier window: a forward
  that keeps its tape loses it at a window's end, so its backward recomputes it
  (`tfpipe.runtime.compiled`). The last stage's step holds its forward: 0 there."""
  crossed, total = [0] * K, [0] * K
  for window in windows:
    forwards = {(k, t.batch, t.micro) for k, t, _, _ in window.tasks if t.kind == "F"}
    for k, t, _, _ in window.tasks:
      if t.kind == "B" and k < K - 1:
        total[k] += 1
        crossed[k] += (k, t.batch, t.micro) not in forwards
  return [c / n if n else 0.0 for c, n in zip(crossed, total)]


def traced_forwards(windows: Sequence[Window], K: int) -> List[int]:
  """Per stage, the forwards in `windows` that trace (a window whose `key` an earlier one has
  reuses its trace): the copies of each stage's tasks an epoch's graphs hold."""
  counts, seen = [0] * K, set()
  for window in windows:
    if window.key in seen:
      continue
    seen.add(window.key)
    for k, t, _, _ in window.tasks:
      counts[k] += t.kind == "F"
  return counts
