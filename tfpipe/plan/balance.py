"""Balancing: where to cut a chain of n layers into K stages (pure Python).

n: layers, K: stages. A cut list `cuts` has K+1 entries, cuts[0] = 0 and
cuts[K] = n; stage j holds layers cuts[j] .. cuts[j+1]-1.
"""

import functools
import math
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["uniform", "min_max", "stage_costs", "NoFit"]


def _check(n: int, K: int) -> None:
  if not isinstance(K, int) or K < 1:
    raise ValueError(f"the number of stages must be a positive integer. Received: {K!r}")
  if K > n:
    raise ValueError(f"cannot cut {n} layers into {K} stages: more stages than cuttable layers")


def uniform(n: int, K: int) -> List[int]:
  """Cuts giving every stage n // K layers, the first n % K stages one more."""
  _check(n, K)
  base, extra = divmod(n, K)
  cuts = [0]
  for j in range(K):
    cuts.append(cuts[-1] + base + (1 if j < extra else 0))
  return cuts


def stage_costs(costs: Sequence[float], cuts: Sequence[int],
                boundary_costs: Optional[Sequence[float]] = None,
                last_costs: Optional[Sequence[float]] = None) -> List[float]:
  """The cost of each stage: its layers' costs plus the transfer out of it."""
  out: List[float] = []
  n = len(costs)
  for a, b in zip(cuts[:-1], cuts[1:]):
    if b == n:
      out.append(sum((last_costs if last_costs is not None else costs)[a:b]))
    else:
      out.append(sum(costs[a:b]) + (boundary_costs[b - 1] if boundary_costs is not None else 0.0))
  return out


class NoFit(ValueError):
  """No cuts put every stage within what `fits` allows."""


def min_max(costs: Sequence[float], K: int, boundary_costs: Optional[Sequence[float]] = None,
            last_costs: Optional[Sequence[float]] = None,
            fits: Optional[Callable[[int, int, int], bool]] = None) -> List[int]:
  """PipeDream's dynamic program: the cuts that minimise the slowest stage.

  Args:
    costs: per-layer cost (time or parameters), in layer order.
    K: number of stages.
    boundary_costs: optional per-layer cost of a cut right after that layer
      (the transfer time of what crosses it), charged to the stage before it.
    last_costs: optional per-layer cost when the layer sits in the last stage
      (methods that recompute the forward everywhere but in the last stage).
    fits: optional fits(k, a, b): whether stage k may hold layers a..b-1 (a memory
      budget); the cuts are the best among those whose every stage fits, and `NoFit`
      is raised when there are none.

  Returns:
    K+1 cut positions. Among optimal cuts, ties go to the one whose earlier
    stages are shortest (deterministic).
  """
  n = len(costs)
  _check(n, K)
  if any(c < 0 for c in costs):
    raise ValueError(f"layer costs must be >= 0. Received: {list(costs)}")
  prefix, last_prefix = [0.0], [0.0]
  for c, l in zip(costs, last_costs if last_costs is not None else costs):
    prefix.append(prefix[-1] + c)
    last_prefix.append(last_prefix[-1] + l)

  def cost(a: int, b: int) -> float:
    if b == n:
      return last_prefix[b] - last_prefix[a]
    transfer = boundary_costs[b - 1] if boundary_costs is not None else 0.0
    return prefix[b] - prefix[a] + transfer

  allowed = (lambda k, a, b: True) if fits is None else functools.lru_cache(maxsize=None)(fits)

  @functools.lru_cache(maxsize=None)
  def best(start: int, stages: int) -> Tuple[float, Tuple[int, ...]]:
    # Lowest achievable max stage cost for layers start..n-1 in `stages` stages (infinite
    # where no cuts of them fit).
    k = K - stages
    if stages == 1:
      return (cost(start, n), (n,)) if allowed(k, start, n) else (math.inf, ())
    choice: Tuple[float, Tuple[int, ...]] = (math.inf, ())
    for end in range(start + 1, n - stages + 2):
      if not allowed(k, start, end):
        continue
      rest, rest_cuts = best(end, stages - 1)
      value = max(cost(start, end), rest)
      if value < choice[0] - 1e-12:
        choice = (value, (end,) + rest_cuts)
    return choice

  value, cuts = best(0, K)
  if value == math.inf:
    raise NoFit(f"no cuts of {n} layers into {K} stages fit")
  return [0] + list(cuts)
