"""Schedules: golden task tables, version differences, deadlock detection."""

import pytest

from tfpipe import schedules
from tfpipe.schedules import Task


def _names(stage):
  return [f"{t.kind}{t.batch}" for t in stage]


def test_one_f_one_b_golden_k3():
  s = schedules.one_f_one_b(3, 4)
  assert _names(s[0]) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
  assert _names(s[1]) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
  assert _names(s[2]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_sequential_golden():
  assert _names(schedules.sequential(2, 2)[0]) == ["F0", "B0", "F1", "B1"]


@pytest.mark.parametrize("K,N", [(1, 1), (2, 5), (3, 2), (4, 10), (5, 3)])
def test_every_task_once_and_no_deadlock(K, N):
  for build in (schedules.one_f_one_b, schedules.sequential):
    schedule = build(K, N)
    for tasks in schedule:
      assert sorted(tasks) == sorted([Task("F", b) for b in range(N)] + [Task("B", b) for b in range(N)])
    order = schedules.global_order(schedule)
    assert len(order) == 2 * K * N


def test_deadlock_is_reported_with_the_stuck_stage():
  broken = [[Task("B", 0), Task("F", 0)], [Task("F", 0), Task("B", 0)]]
  with pytest.raises(ValueError, match="stage 0 at B0"):
    schedules.global_order(broken)


def test_paper_version_differences_match_eq_5_and_6():
  # N = 3: forward s = floor(k/2) + N - k - 1 -> 2, 1, 1; backward floor(k/2) -> 0, 0, 1.
  assert [schedules.paper_version_difference(k, 3, "F") for k in range(3)] == [2, 1, 1]
  assert [schedules.paper_version_difference(k, 3, "B") for k in range(3)] == [0, 0, 1]
  # N = 4: forward 3, 2, 2, 1; backward 0, 0, 1, 1. The paper's worked example: k=0, N=3 -> 2.
  assert [schedules.paper_version_difference(k, 4, "F") for k in range(4)] == [3, 2, 2, 1]
  assert [schedules.paper_version_difference(k, 4, "B") for k in range(4)] == [0, 0, 1, 1]


def test_exact_version_differences_in_steady_state():
  K, N = 4, 12
  diffs = schedules.exact_version_differences(schedules.one_f_one_b(K, N))
  for k in range(K):
    for b in range(K, N):
      assert diffs[k][("F", b)] == K - 1 - k
      assert diffs[k][("B", b)] == 0
    # Warm-up: only b earlier batches exist.
    assert diffs[k][("F", 0)] == 0
  assert [schedules.exact_version_differences(schedules.sequential(3, 4))[k][("F", 2)]
          for k in range(3)] == [0, 0, 0]


def test_rejects_bad_sizes_and_names():
  with pytest.raises(ValueError, match="`K` must be a positive integer. Received: K=0"):
    schedules.one_f_one_b(0, 3)
  with pytest.raises(ValueError, match="did you mean '1f1b'"):
    schedules.build("1f1c", 2, 2)
