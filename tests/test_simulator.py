"""Simulator: the textbook bubble, Kang's model-parallelism report's table 1, the layer-wise partitioning paper's eq. 8."""

import pytest

from tfpipe.plan import analytic, schedules, simulator
from tfpipe.plan.simulator import Costs


def _uniform(K, T_F=1.0, T_B=2.0, transfer=0.0):
  return Costs([T_F / K] * K, [T_B / K] * K, [transfer] * (K - 1))


@pytest.mark.parametrize("K,M", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 3), (3, 32)])
def test_gpipe_bubble_is_the_textbook_one(K, M):
  timeline = simulator.simulate_method("gpipe", _uniform(K), num_batches=1, micro_batches=M)
  assert timeline.bubble == pytest.approx(analytic.gpipe_bubble(K, M))
  # One mini-batch takes (M + K - 1) micro-batch slots of (T_F + T_B) / (K M).
  assert timeline.makespan == pytest.approx((M + K - 1) * 3.0 / (K * M))


@pytest.mark.parametrize("K", [2, 3, 4, 6])
def test_step_times_match_the_epfl_report_table_1(K):
  T_F, T_B, N = 1.0, 2.0, 400
  costs = _uniform(K, T_F, T_B)

  def steady(method, **options):
    # Time per mini-batch in steady state: the slope between two long runs.
    a = simulator.simulate_method(method, costs, N, **options).makespan
    b = simulator.simulate_method(method, costs, 2 * N, **options).makespan
    return (b - a) / N

  assert steady("sequential") == pytest.approx(analytic.step_time("sequential", T_F, T_B, K))
  assert steady("pipedream") == pytest.approx(analytic.step_time("pipedream", T_F, T_B, K))
  # DDG and Features Replay as tfpipe runs them: only data dependencies, no step barrier.
  for method in ("ddg", "feature_replay"):
    assert steady(method) == pytest.approx(analytic.step_time(method, T_F, T_B, K, lockstep=False))
    # The report's T_F + T_B/K assumes lock-step steps: equal for K = 2, an upper bound beyond.
    table = analytic.step_time(method, T_F, T_B, K)
    if K == 2:
      assert steady(method) == pytest.approx(table)
    assert steady(method) <= table + 1e-9
    # Lock-step, as the DDG paper runs it: exactly the table's T_F + T_B/K for every K.
    assert steady(method, lockstep=True) == pytest.approx(table)
  assert steady("sequential") > steady("ddg") > steady("pipedream")


def test_transfers_and_imbalance_show_as_idle_time():
  costs = Costs([1.0, 3.0], [2.0, 6.0], [0.5])
  timeline = simulator.simulate_method("pipedream", costs, 50)
  # The slow stage sets the pace; the fast one idles about two thirds of the time.
  assert timeline.step_time == pytest.approx(9.0, rel=0.02)
  assert timeline.idle[0] / timeline.makespan == pytest.approx(2 / 3, rel=0.05)
  assert timeline.samples_per_second(32) == pytest.approx(50 * 32 / timeline.makespan)
  with_link = simulator.simulate_method("sequential", costs, 10).makespan
  without = simulator.simulate_method("sequential", Costs([1.0, 3.0], [2.0, 6.0]), 10).makespan
  assert with_link - without == pytest.approx(10 * 2 * 0.5)


@pytest.mark.parametrize("P,t_calc,t_comm", [(4, 149.3, 23.7), (8, 149.3, 23.7), (2, 10.0, 1.0),
                                             (4, 10.0, 1.25)])
def test_data_parallel_matches_seed_001_eq_8(P, t_calc, t_comm):
  _, speedup = simulator.simulate_data_parallel(P, t_calc, t_comm, iterations=2000)
  assert speedup == pytest.approx(analytic.data_parallel_speedup(P, t_calc, t_comm), rel=0.01)


def test_seed_001_worked_example():
  # Section 4.3: T_calc 149.3 ms, T_comm 23.7 ms -> S = T_calc / (2 T_comm) ~ 3.1 once 2P T_comm
  # exceeds T_calc; eq. 9 balances at P ~ 3.15.
  assert analytic.data_parallel_speedup(8, 149.3, 23.7) == pytest.approx(3.15, abs=0.01)
  assert analytic.balanced_workers(149.3, 23.7) == pytest.approx(3.15, abs=0.01)
  assert analytic.data_parallel_efficiency(2, 149.3, 23.7) == 1.0


def test_bad_costs_are_refused():
  with pytest.raises(ValueError, match="need one backward time per stage"):
    Costs([1.0, 1.0], [1.0])
  with pytest.raises(ValueError, match="need one transfer time per cut"):
    Costs([1.0, 1.0], [1.0, 1.0], [0.1, 0.1])
  with pytest.raises(ValueError, match="the costs are for 2 stages, the schedule has 3"):
    simulator.simulate(schedules.one_f_one_b(3, 4), Costs([1.0, 1.0], [1.0, 1.0]))


@pytest.mark.parametrize("method,micro", [("pipedream", None), ("vanilla", None),
                                          ("gpipe", 4), ("timeprest", 2)])
def test_costs_measured_from_a_timeline_give_back_the_costs(method, micro):
  costs = Costs([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.25, 0.5], update=0.0)
  timeline = simulator.simulate_method(method, costs, 12, micro_batches=micro)
  policy = simulator.policies.policy_for(method)
  M = micro or 1
  measured = simulator.costs_from_records(timeline.records(), 3, M, policy.recompute)
  assert measured.forward[:2] == pytest.approx(costs.forward[:2])
  assert measured.backward[:2] == pytest.approx(costs.backward[:2])
  # The last stage runs forward and backward as one step: its backward is their sum.
  assert measured.backward[2] == pytest.approx(costs.forward[2] + costs.backward[2])
  assert measured.transfer == pytest.approx(costs.transfer)
  again = simulator.simulate_method(method, measured, 12, micro_batches=micro)
  assert again.makespan == pytest.approx(timeline.makespan)


@pytest.mark.parametrize("method,micro", [("1f1b", 4), ("pipedream", None)])
def test_a_task_recorded_in_pieces_costs_the_sum_of_its_pieces(method, micro):
  # The compiled executor's profiler timeline gives one record per run of a task's ops: a
  # task that waits for a core between its ops comes as several records.
  costs = Costs([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.25, 0.5], update=0.0)
  records = simulator.simulate_method(method, costs, 12, micro_batches=micro).records()
  pieces = []
  for r in records:
    third = (r.end - r.start) / 3
    pieces += [r._replace(start=r.start + 2 * i * third, end=r.start + (2 * i + 1) * third)
               for i in range(3)] if r.kind in ("F", "B", "FB") else [r]
  policy = simulator.policies.policy_for(method)
  whole = simulator.costs_from_records(records, 3, micro or 1, policy.recompute)
  split = simulator.costs_from_records(pieces, 3, micro or 1, policy.recompute)
  assert split.forward == pytest.approx(whole.forward)
  assert split.backward == pytest.approx(whole.backward)
  assert whole.backward[:2] == pytest.approx(costs.backward[:2])


@pytest.mark.parametrize("method,micro", [("gpipe", 4), ("1f1b", 4), ("zb", 4), ("pipedream", None),
                                          ("spectrain", None), ("vanilla", None)])
def test_stages_sharing_one_core_take_the_sum_of_their_work(method, micro):
  costs = Costs([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], update=0.0, cores=1)
  timeline = simulator.simulate_method(method, costs, 6, micro_batches=micro)
  # One core: some task is always ready, so the makespan is all the work, one task at a time.
  assert timeline.makespan == pytest.approx(sum(timeline.busy))
  starts = sorted((start, end) for _, _, start, end in timeline.tasks if end > start)
  assert all(b[0] >= a[1] - 1e-9 for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize("method,micro", [("gpipe", 4), ("zb", 4), ("spectrain", None)])
def test_as_many_cores_as_devices_changes_nothing(method, micro):
  free = Costs([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.1, 0.2])
  enough = Costs([1.0, 2.0, 1.5], [2.0, 3.0, 2.5], [0.1, 0.2], cores=3)
  assert (simulator.simulate_method(method, enough, 5, micro_batches=micro).makespan
          == simulator.simulate_method(method, free, 5, micro_batches=micro).makespan)


def test_two_cores_for_four_stages_bound_the_speed_by_the_work():
  costs = Costs([1.0] * 4, [2.0] * 4, cores=2)
  timeline = simulator.simulate_method("pipedream", costs, 40)
  # 12 s of work per mini-batch on 2 cores: at best 6 s a mini-batch, and list scheduling
  # fills the gaps, so close to it once the pipeline is full.
  assert 6.0 <= timeline.step_time <= 6.0 * 1.1
  unshared = simulator.simulate_method("pipedream", Costs([1.0] * 4, [2.0] * 4), 40)
  assert unshared.step_time == pytest.approx(3.0, rel=0.1)


def test_a_task_pays_its_call_whatever_its_size():
  base = Costs([1.0, 1.0], [2.0, 2.0])
  called = Costs([1.0, 1.0], [2.0, 2.0], per_task=0.25)
  one = simulator.simulate_method("sequential", base, 3)
  more = simulator.simulate_method("sequential", called, 3)
  computing = [t.kind for _, t, start, end in more.tasks if end > start]
  # Per mini-batch stage 0's F and B (its update inside) and stage 1's step (its F only
  # receives), one after another: every call adds to the makespan.
  assert sorted(computing) == sorted(["F", "B", "B"] * 3)
  assert more.makespan == pytest.approx(one.makespan + len(computing) * 0.25)


def test_a_task_takes_the_earliest_gap_a_core_has():
  cores = [[(0.0, 1.0), (3.0, 4.0)], [(0.0, 5.0)]]
  assert simulator._take_core(cores, 0.5, 2.0) == 1.0   # between 1 and 3 on the first core
  assert simulator._take_core(cores, 0.0, 2.0) == 4.0   # the gap is taken now
  assert cores[0] == [(0.0, 1.0), (1.0, 3.0), (3.0, 4.0), (4.0, 6.0)]


def test_bad_sharing_is_refused():
  with pytest.raises(ValueError, match="cores must be a number >= 1 or None. Received: 0"):
    Costs([1.0], [1.0], cores=0)
  with pytest.raises(ValueError, match="per_task must be >= 0"):
    Costs([1.0], [1.0], per_task=-1.0)


def test_breakdown_of_a_simulated_timeline():
  from tfpipe.instruments import breakdown
  costs = Costs([1.0, 3.0], [2.0, 6.0], [0.5])
  result = breakdown.breakdown(simulator.simulate_method("pipedream", costs, 50).records(), 2)
  # Per 9 s step the fast stage computes 3 s, waits 0.5 s for its gradient to cross the link
  # (not hidden: nothing else to do) and idles the rest because of the slow stage.
  assert result.shares[0]["compute"] == pytest.approx(3 / 9, abs=0.02)
  assert result.shares[0]["transfer"] == pytest.approx(0.5 / 9, abs=0.02)
  assert result.shares[0]["idle_imbalance"] == pytest.approx(5.5 / 9, abs=0.02)
  assert result.shares[1]["compute"] == pytest.approx(1.0, abs=0.05)


def test_seed_001_eq_4_to_9_and_the_layerwise_model():
  # Eq. 5-7 into eq. 4 gives eq. 8: S = P T_calc / max(T_calc, 2P T_comm).
  t_ser = analytic.serial_time(1000, 149.3)
  for P in (2, 4, 8):
    t_par = analytic.data_parallel_time(1000, P, 149.3, 23.7)
    assert analytic.speedup(t_ser, t_par) == pytest.approx(
        analytic.data_parallel_speedup(P, 149.3, 23.7))
    assert analytic.efficiency(t_ser, t_par, P) == pytest.approx(
        analytic.data_parallel_efficiency(P, 149.3, 23.7))
  # Section 2's model size, and section 4.4's T_comm: 180 MB at 7.6 GB/s is ~23.7 ms.
  assert analytic.dnn_weights(400, 2048, 10000, 8) == 2048 * (400 + 6 * 2048 + 10000)
  assert analytic.communication_time(45e6, 7.6e9) == pytest.approx(0.0237, rel=0.01)
  # The ideal pipeline scales with K until a cut's transfer is the slowest step. 1F1B keeps
  # only K-k batches in flight at stage k, so it hides no transfer latency: the simulator
  # matches the ideal without transfers and stays below it with them.
  assert analytic.layerwise_speedup(1.0, 4) == 4.0
  assert analytic.layerwise_speedup(1.0, 4, t_transfer=0.5) == 2.0
  for transfer in (0.0, 0.05, 0.5):
    costs = _uniform(4, 1.0 / 3, 2.0 / 3, transfer=transfer)
    a = simulator.simulate_method("pipedream", costs, 400).makespan
    b = simulator.simulate_method("pipedream", costs, 800).makespan
    simulated = 1.0 / ((b - a) / 400)
    ideal = analytic.layerwise_speedup(1.0, 4, transfer)
    assert simulated == pytest.approx(ideal) if transfer == 0 else simulated < ideal
