"""Breakdown: a synthetic timeline with known gaps gives the known shares."""

import pytest

from tfpipe.instruments import breakdown
from tfpipe.runtime import TaskRecord


def _r(stage, kind, batch, start, end, micro=None):
  return TaskRecord(stage, kind, batch, None, None, start, end, micro)


def test_known_gaps_give_known_shares():
  # stage 0: F0 [0,1], waits, B0 [4,5]; its gradient was computed by stage 1 until 3 and
  # copied over [3,3.5]: imbalance 1..3, transfer 3..3.5, idle_transfer 3.5..4.
  # stage 1: waits 0..1 for stage 0 (imbalance) and 1..1.5 for the copy (transfer), runs
  # FB0 [1.5,3], then idles to the end (imbalance 3..5).
  records = [
      _r(0, "F", 0, 0.0, 1.0), _r(0, "XF", 0, 1.0, 1.5), _r(1, "FB", 0, 1.5, 3.0),
      _r(1, "XB", 0, 3.0, 3.5), _r(0, "B", 0, 4.0, 5.0)]
  result = breakdown.breakdown(records, 2)
  assert result.seconds == 5.0
  assert result.shares[0] == pytest.approx(
      {"compute": 0.4, "transfer": 0.1, "idle_transfer": 0.1, "idle_imbalance": 0.4})
  assert result.shares[1] == pytest.approx(
      {"compute": 0.3, "transfer": 0.1, "idle_transfer": 0.0, "idle_imbalance": 0.6})
  assert result.scalars()["breakdown/stage1/idle_imbalance"] == pytest.approx(0.6)
  text = breakdown.format_breakdown(result)
  assert "idle_imbalance" in text and "60.0%" in text


def test_queued_transfer_and_early_receive_and_window():
  # Stage 1's input was ready at 1 but its copy waited until 2 (queued behind another):
  # idle_transfer 1..2, transfer 2..2.5. Stage 0 receives B0's gradient early (R) and its
  # B0 then waits for nothing: the gap before it is imbalance.
  records = [
      _r(0, "F", 0, 0.0, 1.0), _r(0, "XF", 0, 2.0, 2.5), _r(1, "FB", 0, 2.5, 3.5),
      _r(1, "XB", 0, 3.5, 4.0), _r(0, "R", 0, 1.0, 4.0), _r(0, "B", 0, 4.5, 5.0)]
  result = breakdown.breakdown(records, 2)
  assert result.shares[1]["idle_transfer"] == pytest.approx(1.0 / 5)
  assert result.shares[1]["transfer"] == pytest.approx(0.5 / 5)
  # Stage 0: R waits 1..3.5 for stage 1 (imbalance), 3.5..4 for the copy; 4..4.5 imbalance.
  assert result.shares[0] == pytest.approx(
      {"compute": 1.5 / 5, "transfer": 0.5 / 5, "idle_transfer": 0.0, "idle_imbalance": 3 / 5})
  windowed = breakdown.breakdown(records, 2, window=(0.0, 2.0))
  assert windowed.shares[1] == pytest.approx(
      {"compute": 0.0, "transfer": 0.0, "idle_transfer": 0.5, "idle_imbalance": 0.5})
  for shares in result.shares + windowed.shares:
    assert sum(shares.values()) == pytest.approx(1.0)


def test_empty_timeline_is_refused():
  with pytest.raises(ValueError, match="no records to break down"):
    breakdown.breakdown([], 2)


def test_combine_weights_windows_by_their_time():
  a = breakdown.Breakdown(1.0, [dict(compute=1.0, transfer=0.0, idle_transfer=0.0,
                                     idle_imbalance=0.0)])
  b = breakdown.Breakdown(3.0, [dict(compute=0.0, transfer=0.0, idle_transfer=0.0,
                                     idle_imbalance=1.0)])
  both = breakdown.combine([a, b])
  assert both.seconds == 4.0
  assert both.shares[0] == pytest.approx(
      {"compute": 0.25, "transfer": 0.0, "idle_transfer": 0.0, "idle_imbalance": 0.75})


def test_overlapping_tasks_of_a_stage_count_once_as_compute():
  # In a graph, stage 0's F1 [0.5, 2] may start before its B0 [0, 1] ends: busy 0..2 of 4.
  records = [_r(0, "B", 0, 0.0, 1.0), _r(0, "F", 1, 0.5, 2.0), _r(0, "F", 2, 3.0, 4.0)]
  result = breakdown.breakdown(records, 1)
  assert result.shares[0] == pytest.approx(
      {"compute": 3 / 4, "transfer": 0.0, "idle_transfer": 0.0, "idle_imbalance": 1 / 4})
