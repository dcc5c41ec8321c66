"""Pipeline schedules: each stage's ordered task list, in pure Python (no TensorFlow).

K: stages, k: stage index (0 holds the input), N: batches in an epoch, b: batch index.

A schedule is a list of K task lists. Stage k runs its list in order; a task
waits only for its data: the forward of b at k needs the forward of b at k-1,
the backward of b at k needs the backward of b at k+1 (at the last stage, its
own forward). Every stage owns its weights and is the only one to update them,
so the weight version a task reads depends on its stage's order alone, never
on thread timing: the runtime and the slow reference loop agree exactly.
"""

import collections

__all__ = ["Task", "sequential", "one_f_one_b", "build", "global_order",
           "exact_version_differences", "paper_version_difference", "SCHEDULES"]

Task = collections.namedtuple("Task", ["kind", "batch"])  # kind: "F" or "B"


def sequential(K, N):
  """Naive model parallelism: one batch in flight.

  K = 3, N = 2 (time runs left to right; Fb / Bb = forward / backward of b):

  ```
  stage 0: F0 .  .  .  .  B0 F1 .  .  .  .  B1
  stage 1: .  F0 .  .  B0 .  .  F1 .  .  B1 .
  stage 2: .  .  F0 B0 .  .  .  .  F1 B1 .  .
  ```
  """
  _check(K, N)
  return [[t for b in range(N) for t in (Task("F", b), Task("B", b))] for _ in range(K)]


def one_f_one_b(K, N):
  """Asynchronous 1F1B (PipeDream's steady state), drained at the end.

  Stage k starts with K-1-k forwards, then alternates one forward, one
  backward. K = 3, N = 4:

  ```
  stage 0: F0 F1 .  .  F2 .  B0 F3 .  B1 .  .  B2 .  B3
  stage 1: .  F0 F1 .  B0 F2 .  B1 F3 .  B2 .  B3 .  .
  stage 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  .  .  .
  ```
  The forward of b at stage k runs after the backwards of b-(K-1-k) earlier
  batches: its weights are stale by K-1-k updates.
  """
  _check(K, N)
  stages = []
  for k in range(K):
    warm = min(K - 1 - k, N)
    tasks = [Task("F", b) for b in range(warm)]
    for b in range(N):
      if b + warm < N:
        tasks.append(Task("F", b + warm))
      tasks.append(Task("B", b))
    stages.append(tasks)
  return stages


SCHEDULES = {"sequential": sequential, "1f1b": one_f_one_b}


def build(name, K, N):
  """The schedule called `name` for K stages and N batches."""
  from tfpipe import names
  return SCHEDULES[names.lookup("schedule", name, SCHEDULES)](K, N)


def _check(K, N):
  for label, value in (("K", K), ("N", N)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"`{label}` must be a positive integer. Received: {label}={value!r}")


def _ready(schedule, done, k, task):
  K = len(schedule)
  if task.kind == "F":
    return k == 0 or ("F", task.batch) in done[k - 1]
  if k == K - 1:
    return ("F", task.batch) in done[k]
  return ("B", task.batch) in done[k + 1]


def global_order(schedule):
  """One single-threaded order that runs every task with its inputs ready.

  Round-robin over stages, each running its next task when its inputs are
  ready. Raises ValueError naming the stuck stages when no stage can go on.
  """
  K = len(schedule)
  position = [0] * K
  done = [set() for _ in range(K)]
  order = []
  total = sum(len(tasks) for tasks in schedule)
  while len(order) < total:
    progressed = False
    for k in range(K):
      if position[k] < len(schedule[k]):
        task = schedule[k][position[k]]
        if _ready(schedule, done, k, task):
          done[k].add(tuple(task))
          order.append((k, task))
          position[k] += 1
          progressed = True
    if not progressed:
      stuck = ", ".join(f"stage {k} at {schedule[k][position[k]].kind}{schedule[k][position[k]].batch}"
                        for k in range(K) if position[k] < len(schedule[k]))
      raise ValueError(f"schedule deadlocks: no stage can run its next task ({stuck})")
  return order


def exact_version_differences(schedule):
  """For every stage and task, the `exact` version difference s.

  s = the number of updates stage k applies, for batches earlier than b,
  after this task starts (DESIGN.md section 3). Returns K dicts mapping
  (kind, batch) -> s.
  """
  result = []
  for tasks in schedule:
    diffs = {}
    for i, task in enumerate(tasks):
      diffs[tuple(task)] = sum(1 for later in tasks[i + 1:]
                               if later.kind == "B" and later.batch < task.batch)
    result.append(diffs)
  return result


def paper_version_difference(k, K, kind):
  """Seed 000 eq. 5-6: forward s = floor(k/2) + K - k - 1, backward s = floor(k/2)."""
  if not 0 <= k < K:
    raise ValueError(f"stage index must be in [0, {K}). Received: k={k}")
  if kind == "F":
    return k // 2 + K - k - 1
  if kind == "B":
    return k // 2
  raise ValueError(f"task kind must be 'F' or 'B'. Received: {kind!r}")
