"""Version differences: how many updates a task's weights are behind its mini-batch's turn
(pure Python).

`exact_version_differences` counts them on a schedule's task lists; `updates_since_forward`
counts a backward's stage's updates since its forward; the papers' closed forms are
`paper_version_difference` (SpecTrain eq. 5-6) and `timeprest_version_difference`.
"""

import collections
from typing import Counter, Dict, List, Optional

from tfpipe.plan.schedules import Lists, Task, is_update

__all__ = ["exact_version_differences", "updates_since_forward", "paper_version_difference",
           "timeprest_version_difference"]


def exact_version_differences(schedule: Lists) -> List[Dict[Task, int]]:
  """For every stage and task, the `exact` version difference s.

  s = the number of updates stage k applies, for mini-batches earlier than
  b, after this task starts (docs/methods.md). Returns K dicts mapping
  each task to s.
  """
  result = []
  for tasks in schedule:
    diffs: Dict[Task, int] = {}
    later: Counter[int] = collections.Counter()
    for task in reversed(tasks):
      diffs[task] = sum(n for batch, n in later.items() if batch < task.batch)
      if is_update(task):
        later[task.batch] += 1
    result.append(diffs)
  return result


def updates_since_forward(schedule: Lists) -> List[Dict[Task, int]]:
  """For every stage: each B task -> d, the updates stage k applied between the forward of its
  (first) unit and the backward; every other task -> 0."""
  result = []
  for tasks in schedule:
    diffs: Dict[Task, int] = {}
    at_forward: Dict[int, Dict[Optional[int], int]] = {}
    count = 0
    for task in tasks:
      if task.kind == "F":
        at_forward.setdefault(task.batch, {})[task.micro] = count
      diffs[task] = 0
      if task.kind == "B":
        forwards = at_forward[task.batch]
        diffs[task] = count - (forwards[task.micro] if task.micro is not None
                               else next(iter(forwards.values())))   # its first forward
      count += is_update(task)
    result.append(diffs)
  return result


def paper_version_difference(k: int, K: int, kind: str) -> int:
  """The SpecTrain paper's eq. 5-6: forward s = floor(k/2) + K - k - 1, backward s = floor(k/2)."""
  if not 0 <= k < K:
    raise ValueError(f"stage index must be in [0, {K}). Received: k={k}")
  if kind == "F":
    return k // 2 + K - k - 1
  if kind == "B":
    return k // 2
  raise ValueError(f"task kind must be 'F' or 'B'. Received: {kind!r}")


def timeprest_version_difference(k: int, K: int, M: int, i: int) -> int:
  """Updates between the forward of micro-batch i at stage k and its mini-batch's backward.

  TiMePReSt (the TiMePReSt paper) relates the version difference to the number of
  micro-batches M and workers K; for the schedule above it is
  floor((M-1-i + K-1-k) / M) in steady state: the first micro-batches of a
  mini-batch may read weights older than the last ones ("multiple
  sequences") when K-1-k > 0, and when M >= K no micro-batch is more than
  one update behind. The backward itself reads the latest weights (s = 0).
  """
  if not 0 <= k < K or not 0 <= i < M:
    raise ValueError(f"need 0 <= k < K and 0 <= i < M. Received: k={k}, K={K}, i={i}, M={M}")
  return (M - 1 - i + K - 1 - k) // M
