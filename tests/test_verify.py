"""Schedule verifier: every method for K = 1..16 and M = 1..64, peaks, broken schedules."""

import collections

import pytest

from tfpipe.plan import policies, schedules, verify, windows
from tfpipe.plan.schedules import Task


def _check_dependencies(schedule, order):
  """An independent check of an order: per-stage order kept and every input ready in time."""
  K = len(schedule)
  assert collections.Counter(order) == collections.Counter(
      (k, t) for k in range(K) for t in schedule[k])
  for k in range(K):
    assert [t for j, t in order if j == k] == list(schedule[k])
  position = {item: n for n, item in enumerate(order)}
  # Per stage: its forwards by (batch, micro) and by batch, its backwards by batch.
  forwards, backwards = collections.defaultdict(list), collections.defaultdict(list)
  for k in range(K):
    for t in schedule[k]:
      if t.kind == "F":
        forwards[(k, t.batch, t.micro)].append(t)
        forwards[(k, t.batch)].append(t)
      elif t.kind == "B":
        backwards[(k, t.batch)].append(t)
  for (k, t), n in position.items():
    needs = []
    if t.kind == "F" and k > 0:
      needs.append((k - 1, t))
    if t.kind == "R" or (t.kind == "B" and k < K - 1 and (k, Task("R", *t[1:])) not in position):
      needs.append((k + 1, Task("B", t.batch, t.micro)))
    if t.kind == "B":
      key = (k, t.batch) if t.micro is None else (k, t.batch, t.micro)
      needs += [(k, f) for f in forwards[key]]
    if t.kind == "U":
      needs += [(k, o) for o in backwards[(k, t.batch)]]
    for need in needs:
      assert position[need] < n, (k, str(t), need)


def _capacity(K, M):
  # The runtime's links: maxsize max(K, M), so 2 * maxsize + 1 items in flight.
  return 2 * max(K, M) + 1


# Every M to 16, then larger ones up to 64 (odd, prime, powers of two): a schedule's
# tasks grow with M, and the M of 17-64 that were left out took 85% of the verifier's time.
MICRO_BATCHES = list(range(1, 17)) + [23, 24, 32, 37, 48, 63, 64]


@pytest.mark.parametrize("K", range(1, 17))
def test_every_method_verifies_for_k_up_to_16_and_m_up_to_64(K):
  for name in ("sequential", "ddg", "1f1b"):
    schedule = schedules.build(name, K, K + 3)
    _check_dependencies(schedule, verify.verify(schedule, _capacity(K, 1)).order)
  for M in MICRO_BATCHES:
    N = max(2, -(-(K + 2) // M))  # enough micro-batches to reach the steady state
    for name in ("gpipe", "timeprest", "1f1b"):
      schedule = schedules.build(name, K, N, M)
      report = verify.verify(schedule, _capacity(K, M))
      assert len(report.order) == sum(len(tasks) for tasks in schedule)
      if M in (1, 7, 64) or K in (1, 16):
        _check_dependencies(schedule, report.order)


def test_memory_table_matches_the_epfl_report_and_design():
  # Kang's model-parallelism report table 1 (devices counted from 1 there: K-k+1 is K-k here, k from
  # 0):
  # sequential 1 mini-batch; DDG and PipeDream K-k states; FR inputs only.
  K, M = 5, 4
  table = verify.memory_table(K, M)
  down = [K - k for k in range(K)]
  assert table["sequential"] == ("activations", [1] * K, [1] * K)
  assert table["ddg"] == ("activations", down, down)
  assert table["pipedream"] == ("activations", down, down)
  assert table["feature_replay"] == ("inputs", down, [0] * K)
  assert table["vanilla"] == ("inputs", down, [0] * K)
  # docs/methods.md: gpipe keeps M activation sets (the last stage runs each micro-batch's forward
  # and backward as one step, so it keeps one); timeprest keeps inputs of M micro-batches,
  # plus the K-1-k it runs ahead; no weight versions.
  assert table["gpipe"] == ("activations", [M] * (K - 1) + [1], [1] * K)
  assert table["timeprest"] == ("inputs", [M + K - 1 - k for k in range(K)], [0] * K)
  text = verify.format_memory_table(table)
  assert "feature_replay" in text and "5/0" in text


def test_recompute_only_where_it_reads_the_forwards_weights():
  # gpipe and sequential apply no update between a forward and its backward, so recomputing
  # from the stage input reads the same weights; a stash cannot be recomputed.
  for method in ("gpipe", "sequential"):
    policy = policies.policy_for(method, recompute=True)
    assert policy.recompute and policy.backward == "current"
    assert not policies.policy_for(method).recompute
  with pytest.raises(ValueError, match="method 'pipedream' cannot recompute"):
    policies.policy_for("pipedream", recompute=True)
  with pytest.raises(ValueError, match="method 'vanilla' always recomputes"):
    policies.policy_for("vanilla", recompute=False)


def _broken(text):
  return [[Task(w[0], int(w[1:].split(".")[0]), int(w.split(".")[1]) if "." in w else None)
           for w in line.split()] for line in text]


def test_rejects_a_missing_backward():
  schedule = _broken(["F0 B0 F1 B1 F2 B2", "F0 B0 F1 B1 F2"])
  with pytest.raises(verify.ScheduleError, match="stage 1: forward F2 has no backward"):
    verify.verify(schedule)


def test_rejects_a_cycle_naming_the_stuck_tasks():
  # Stage 0 waits for a gradient that needs its own later forward.
  schedule = _broken(["R0 F0 B0", "F0 B0"])
  with pytest.raises(verify.ScheduleError,
                     match=r"deadlocks.*stage 0 at R0 \(waits for stage 1's B0\).*"
                           r"stage 1 at F0 \(waits for stage 0's F0\)"):
    verify.verify(schedule)
  with pytest.raises(verify.ScheduleError, match=r"stage 0 at B0 \(waits for its own F0\)"):
    verify.verify(_broken(["B0 F0", "F0 B0"]))


def test_rejects_out_of_order_links_and_other_defects():
  with pytest.raises(verify.ScheduleError, match="stage 1 expects F1 but stage 0 sent F0 first"):
    verify.verify(_broken(["F0 F1 B0 B1", "F1 B1 F0 B0"]))
  with pytest.raises(verify.ScheduleError, match="stage 0 runs F0 twice"):
    verify.verify(_broken(["F0 F0 B0", "F0 B0"]))
  with pytest.raises(verify.ScheduleError, match="B0.0 accumulates a gradient that no U0 applies"):
    verify.verify(_broken(["F0.0 B0.0", "F0.0 B0.0"]))
  with pytest.raises(verify.ScheduleError, match="last stage: B0 must come right after its forwards"):
    verify.verify(_broken(["F0 F1 B0 B1", "F0 F1 B0 B1"]))
  with pytest.raises(verify.ScheduleError, match="stage 1 has no forward F1 that stage 0 runs"):
    verify.verify(_broken(["F0 B0 F1 B1", "F0 B0"]))


def test_rejects_barriers_that_not_every_stage_passes():
  with pytest.raises(verify.ScheduleError,
                     match="stage 1's barriers differ from stage 0's: stage 1 has none where "
                           "stage 0 has S1"):
    verify.verify(_broken(["F0 B0 S0 F1 B1 S1", "F0 B0 S0 F1 B1"]))
  # A barrier before a forward the next stage needs to reach it: a deadlock, named.
  with pytest.raises(verify.ScheduleError,
                     match=r"stage 0 at S0 \(waits for stage 1 to reach the barrier\); "
                           r"stage 1 at F0 \(waits for stage 0's F0\)"):
    verify.verify(_broken(["S0 F0 B0", "F0 B0 S0"]))
  report = verify.verify(schedules.ddg_lockstep(4, 6))
  assert sum(t.kind == "S" for _, t in report.order) == 4 * 6


def test_bounded_links_can_deadlock_and_the_verifier_says_so():
  # GPipe with 8 micro-batches: the last stage's gradients pile up while stage 0 still runs
  # forwards. Two items per link are too few; the runtime's capacity is enough.
  schedule = schedules.gpipe(2, 1, 8)
  with pytest.raises(verify.ScheduleError, match="stage 1 at B0.2 \\(its output link to stage 0 is full\\)"):
    verify.verify(schedule, capacity=2)
  verify.verify(schedule, capacity=_capacity(2, 8))


@pytest.mark.parametrize("name,M,V", [("gpipe", 1, 1), ("1f1b_flush", 4, 1), ("interleaved", 4, 2),
                                      ("zb_h1", 4, 1), ("zb_v", 4, 2)])
def test_joint_updates_run_every_stages_backwards_of_a_batch_before_any_of_its_updates(name, M,
                                                                                       V):
  K = 4
  plain = schedules.build(name, K, 3, M, V)
  joint = schedules.jointly_updated(plain)
  first_update = lambda order, b: min(i for i, (_, t) in enumerate(order)
                                      if t.kind == "U" and t.batch == b)
  last_backward = lambda order, b: max(i for i, (_, t) in enumerate(order)
                                       if t.kind in ("B", "W") and t.batch == b)
  order = verify.verify(joint).order
  assert all(last_backward(order, b) < first_update(order, b) for b in range(3))
  plain_order = verify.verify(plain).order   # without joint updates a stage may update first
  assert any(last_backward(plain_order, b) > first_update(plain_order, b) for b in range(3))
  for w in windows.plan(joint, [{} for _ in joint], 2):   # and the compiled windows' order
    tasks = [(k, t) for k, t, _, _ in w.tasks]
    for b in range(w.first, w.last + 1):
      assert last_backward(tasks, b) < first_update(tasks, b)


def test_joint_updates_need_update_tasks():
  with pytest.raises(ValueError, match="joint updates need a schedule whose updates are U tasks"):
    schedules.jointly_updated(schedules.sequential(2, 2))


def test_a_schedule_error_shows_the_schedule_as_a_grid():
  schedule = _broken(["F0 B0 F1 B1 F2 B2", "F0 B0 F1 B1 F2"])
  with pytest.raises(verify.ScheduleError) as raised:
    verify.verify(schedule)
  lines = str(raised.value).splitlines()
  assert lines[0] == "stage 1: forward F2 has no backward"
  assert lines[1].split() == ["stage", "|", "0", "1", "2", "3", "4", "5"]
  assert lines[2].split() == ["0", "|", "F0", "B0", "F1", "B1", "F2", "B2"]
  assert lines[3].split() == ["1", "|", "F0", "B0", "F1", "B1", "F2"]


def test_a_long_schedule_grid_shows_its_first_steps_and_counts_the_rest():
  grid = verify.format_grid(schedules.build("1f1b", 2, 10), width=4).splitlines()
  assert len(grid) == 3 and grid[1].endswith("... (+16)") and grid[1].split()[2] == "F0"


@pytest.mark.parametrize("method,M", [("spectrain", 1), ("pipedream", 1), ("1f1b", 4), ("zb", 4),
                                      ("zbv", 2), ("interleaved", 4), ("gpipe", 2),
                                      ("i_timeprest", 1)])
@pytest.mark.parametrize("size", [1, 3, 16])
def test_windows_end_where_each_stage_last_runs_a_task_of_their_batches(method, M, size):
  """Each window ends, on every stage, after that stage's last task (barriers aside) of a
  mini-batch the window finishes: the definition, scanned per window, against the one
  pass the planner makes (`windows._reach`)."""
  schedule, diffs = policies.epoch(method, 4, 13, M)
  planned = windows.plan(schedule, diffs, size)
  done = [0] * len(schedule)
  for window in planned:
    for k, tasks in enumerate(schedule):
      end = 1 + max(i for i, t in enumerate(tasks) if t.kind != "S" and t.batch <= window.last)
      ran = [t for t in tasks[done[k]:end] if t.kind != "S"]
      traced = [t for j, t, _, _ in window.tasks if j == k]   # in the window's trace order
      assert collections.Counter(traced) == collections.Counter(ran)
      done[k] = end


@pytest.mark.parametrize("broken", [False, True])
def test_the_verifier_leaves_the_garbage_collector_as_it_found_it(broken):
  import gc
  schedule, _ = policies.epoch("1f1b", 2, 3, 2)
  if broken:
    schedule = [list(reversed(schedule[0])), schedule[1]]
  for enabled in (True, False):
    (gc.enable if enabled else gc.disable)()
    try:
      verify.verify(schedule)
    except verify.ScheduleError:
      assert broken
    finally:
      assert gc.isenabled() == enabled
      gc.enable()

