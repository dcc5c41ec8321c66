"""Balancing: the dynamic program against brute force, uniform cuts, errors."""

import itertools
import random

import pytest

from tfpipe.plan import balance


def _brute_force(costs, K, boundary=None, last=None):
  n = len(costs)
  best = None
  for inner in itertools.combinations(range(1, n), K - 1):
    cuts = [0, *inner, n]
    value = max(balance.stage_costs(costs, cuts, boundary, last))
    best = value if best is None else min(best, value)
  return best


@pytest.mark.parametrize("seed", range(30))
def test_min_max_equals_brute_force(seed):
  rng = random.Random(seed)
  n = rng.randint(1, 8)
  K = rng.randint(1, n)
  costs = [rng.choice([1, 2, 3, 10, 0.5]) * rng.random() for _ in range(n)]
  boundary = [rng.random() for _ in range(n)] if seed % 2 else None
  last = [c * 0.75 for c in costs] if seed % 3 == 0 else None
  cuts = balance.min_max(costs, K, boundary, last)
  assert len(cuts) == K + 1 and cuts[0] == 0 and cuts[-1] == n
  assert max(balance.stage_costs(costs, cuts, boundary, last)) == pytest.approx(
      _brute_force(costs, K, boundary, last))


def test_min_max_isolates_the_expensive_layer():
  assert balance.min_max([10, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1, 10]


def test_uniform():
  assert balance.uniform(7, 3) == [0, 3, 5, 7]
  assert balance.uniform(4, 4) == [0, 1, 2, 3, 4]


def test_more_stages_than_layers_is_refused():
  with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
    balance.min_max([1, 2, 3], 4)
  with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
    balance.uniform(2, 3)


def test_min_max_takes_the_best_cuts_among_those_that_fit():
  costs = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  assert balance.min_max(costs, 2) == [0, 3, 6]
  # Stage 0 may hold at most two layers: the balanced cut is out, the next best is taken.
  fits = lambda k, a, b: k != 0 or b - a <= 2
  assert balance.min_max(costs, 2, fits=fits) == [0, 2, 6]
  seen = []
  balance.min_max(costs, 3, fits=lambda k, a, b: seen.append((k, a, b)) or True)
  assert all(0 <= k < 3 and 0 <= a < b <= 6 for k, a, b in seen)


def test_min_max_says_when_no_cuts_fit():
  with pytest.raises(balance.NoFit, match="no cuts of 4 layers into 2 stages fit"):
    balance.min_max([1.0] * 4, 2, fits=lambda k, a, b: b - a <= 1)
