"""Schedules: golden task tables for every method, version differences."""

import pytest

from tfpipe.plan import schedules, verify, versions
from tfpipe.plan.schedules import Task


def _table(schedule):
  return [" ".join(map(str, tasks)) for tasks in schedule]


def test_sequential_golden_k3():
  assert _table(schedules.sequential(3, 2)) == ["F0 B0 F1 B1"] * 3


def test_one_f_one_b_golden_k3():
  assert _table(schedules.one_f_one_b(3, 4)) == [
      "F0 F1 F2 B0 F3 B1 B2 B3",
      "F0 F1 B0 F2 B1 F3 B2 B3",
      "F0 B0 F1 B1 F2 B2 F3 B3",
  ]


def test_one_f_one_b_with_micro_batches_golden_k3():
  # Micro-batches are the units of 1F1B; each stage updates once per mini-batch (U).
  assert _table(schedules.one_f_one_b(3, 2, 2)) == [
      "F0.0 F0.1 F1.0 B0.0 F1.1 B0.1 U0 B1.0 B1.1 U1",
      "F0.0 F0.1 B0.0 F1.0 B0.1 U0 F1.1 B1.0 B1.1 U1",
      "F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1",
  ]


def test_gpipe_golden_k3():
  assert _table(schedules.gpipe(3, 2, 2)) == [
      "F0.0 F0.1 B0.0 B0.1 U0 F1.0 F1.1 B1.0 B1.1 U1",
      "F0.0 F0.1 B0.0 B0.1 U0 F1.0 F1.1 B1.0 B1.1 U1",
      "F0.0 B0.0 F0.1 B0.1 U0 F1.0 B1.0 F1.1 B1.1 U1",
  ]


def test_ddg_golden_k4():
  # Kang's model-parallelism report table 3: step t of stage k is F(t), B(t-d) with the gradient in
  # store, then
  # receive the gradient of t-d+1 (d = K-1-k).
  assert _table(schedules.ddg(4, 5)) == [
      "F0 F1 F2 R0 F3 B0 R1 F4 B1 R2 B2 R3 B3 R4 B4",
      "F0 F1 R0 F2 B0 R1 F3 B1 R2 F4 B2 R3 B3 R4 B4",
      "F0 R0 F1 B0 R1 F2 B1 R2 F3 B2 R3 F4 B3 R4 B4",
      "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",
  ]


def test_ddg_lockstep_golden_k3():
  # The DDG paper's lock-step steps: every stage ends step t at the barrier S(t).
  assert _table(schedules.ddg(3, 3, lockstep=True)) == [
      "F0 S0 F1 R0 S1 F2 B0 R1 S2 B1 R2 B2",
      "F0 R0 S0 F1 B0 R1 S1 F2 B1 R2 S2 B2",
      "F0 B0 S0 F1 B1 S1 F2 B2 S2",
  ]
  without = [[t for t in tasks if t.kind != "S"] for tasks in schedules.ddg_lockstep(4, 7)]
  assert without == schedules.ddg(4, 7)


def test_ddg_orders_forwards_and_backwards_as_one_f_one_b():
  # DDG differs from PipeDream in when gradients are received, not in the per-stage order.
  for K, N in [(2, 5), (4, 9)]:
    ddg = [[t for t in tasks if t.kind != "R"] for tasks in schedules.ddg(K, N)]
    assert ddg == schedules.one_f_one_b(K, N)


def test_timeprest_golden_k3():
  assert _table(schedules.timeprest(3, 3, 2)) == [
      "F0.0 F0.1 F1.0 F1.1 B0 F2.0 F2.1 B1 B2",
      "F0.0 F0.1 F1.0 B0 F1.1 F2.0 B1 F2.1 B2",
      "F0.0 F0.1 B0 F1.0 F1.1 B1 F2.0 F2.1 B2",
  ]


@pytest.mark.parametrize("K,M", [(2, 1), (3, 2), (4, 2), (4, 4), (5, 3), (8, 2), (3, 8)])
def test_timeprest_version_difference_formula_equals_the_schedule(K, M):
  # The relation between micro-batches and workers, checked against the schedule itself:
  # the updates between each micro-batch's forward and its mini-batch's backward.
  N = K + 4
  report = verify.verify(schedules.timeprest(K, N, M))
  diffs = versions.exact_version_differences(schedules.timeprest(K, N, M))
  for k in range(K):
    for b in range(K, N - K):  # steady state
      for i in range(M):
        assert diffs[k][Task("F", b, i)] == versions.timeprest_version_difference(k, K, M, i)
    assert report.staleness[k] == versions.timeprest_version_difference(k, K, M, 0)
  # No micro-batch is more than one update behind once M >= K.
  if M >= K:
    assert max(report.staleness) <= 1


def test_paper_version_differences_match_eq_5_and_6():
  # N = 3: forward s = floor(k/2) + N - k - 1 -> 2, 1, 1; backward floor(k/2) -> 0, 0, 1.
  assert [versions.paper_version_difference(k, 3, "F") for k in range(3)] == [2, 1, 1]
  assert [versions.paper_version_difference(k, 3, "B") for k in range(3)] == [0, 0, 1]
  # N = 4: forward 3, 2, 2, 1; backward 0, 0, 1, 1. The paper's worked example: k=0, N=3 -> 2.
  assert [versions.paper_version_difference(k, 4, "F") for k in range(4)] == [3, 2, 2, 1]
  assert [versions.paper_version_difference(k, 4, "B") for k in range(4)] == [0, 0, 1, 1]


def test_exact_version_differences_in_steady_state():
  K, N = 4, 12
  diffs = versions.exact_version_differences(schedules.one_f_one_b(K, N))
  for k in range(K):
    for b in range(K, N):
      assert diffs[k][Task("F", b)] == K - 1 - k
      assert diffs[k][Task("B", b)] == 0
    # Warm-up: only b earlier batches exist.
    assert diffs[k][Task("F", 0)] == 0
  assert [versions.exact_version_differences(schedules.sequential(3, 4))[k][Task("F", 2)]
          for k in range(3)] == [0, 0, 0]


def test_exact_version_differences_count_updates_not_micro_batches():
  # 1F1B over micro-batches: the updates are the U tasks, one per mini-batch.
  diffs = versions.exact_version_differences(schedules.one_f_one_b(3, 6, 2))
  assert diffs[0][Task("F", 3, 0)] == 1 and diffs[0][Task("F", 3, 1)] == 1
  assert diffs[2][Task("F", 3, 0)] == 0
  # GPipe: no update between a mini-batch's forwards and its backward.
  assert set(versions.exact_version_differences(schedules.gpipe(4, 3, 4))[0].values()) == {0}


def test_micro_sizes():
  assert schedules.micro_sizes(10, 4) == [3, 3, 2, 2]
  assert schedules.micro_sizes(8, 1) == [8]
  with pytest.raises(ValueError, match="a mini-batch of 3 samples cannot be split into 4"):
    schedules.micro_sizes(3, 4)


def test_rejects_bad_sizes_and_names():
  with pytest.raises(ValueError, match="`K` must be a positive integer. Received: K=0"):
    schedules.one_f_one_b(0, 3)
  with pytest.raises(ValueError, match="`M` must be a positive integer. Received: M=0"):
    schedules.gpipe(2, 3, 0)
  with pytest.raises(ValueError, match="did you mean '1f1b'"):
    schedules.build("1f1c", 2, 2)
  with pytest.raises(ValueError, match="the 'ddg' schedule has no micro-batches. Received: M=2"):
    schedules.build("ddg", 2, 2, 2)


def test_lead_is_how_far_stage_0_runs_ahead():
  # sequential: F0 B0 F1 ...; 1F1B K=3: F0 F1 F2 B0 F3 ... (three batches before B0 ends).
  assert [schedules.lead(schedules.build("sequential", K, 8)) for K in (1, 2, 3)] == [1, 1, 1]
  assert [schedules.lead(schedules.build("gpipe", K, 8, 4)) for K in (2, 4)] == [1, 1]
  assert [schedules.lead(schedules.build("1f1b", K, 8)) for K in (1, 2, 3, 4)] == [1, 2, 3, 4]
  assert [schedules.lead(schedules.build("ddg", K, 8)) for K in (2, 3)] == [2, 3]
