"""method="auto": the candidates, their ranking by time to accuracy, the measured epochs table,
the profile the simulator predicts from, and a Pipeline that chooses at its first fit."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.instruments import costs as costs_lib
from tfpipe.plan import auto, policies, simulator
from tfpipe.rules import epochs
from tfpipe.training import assemble
from tests import helpers


def test_candidates_are_the_schedules_at_m_dividing_the_batch_and_the_asynchronous_methods():
  found = auto.candidates(4, 96, 8, {"advice": True})
  names = [c.name for c in found]
  # 1f1b at M = 1; M = 2, 4 and 8 divide 96; the advised spectrain takes its 8 micro-batches
  # and the advice.
  assert names == ["1f1b M=1", "1f1b M=2", "zb M=2", "gpipe M=2", "1f1b M=4", "zb M=4",
                   "gpipe M=4", "1f1b M=8", "zb M=8", "gpipe M=8",
                   "spectrain M=1", "spectrain M=8, advice=True", "2bw M=1"]
  assert [c.name for c in auto.candidates(4, 36, 8, {})] == [
      "1f1b M=1", "1f1b M=2", "zb M=2", "gpipe M=2", "1f1b M=4", "zb M=4", "gpipe M=4",
      "spectrain M=1", "2bw M=1"]


@pytest.mark.parametrize("K, expected", [(2, [2, 4]), (3, [2, 3, 6]), (4, [2, 4, 8]),
                                         (8, [2, 4, 8, 16]), (6, [2, 4, 6, 12])])
def test_the_schedules_are_candidates_at_powers_of_two_below_k_and_at_k_and_2k(K, expected):
  assert auto.synchronous_micro_batches(K) == expected


def test_micro_batches_are_too_small_where_their_compute_passes_busy_times_the_whole():
  compute = {1: 1.0, 2: 1.5, 4: 2.0 + 1e-9, 8: 3.0}
  assert [auto.too_small(compute, M) for M in (1, 2, 4, 8, 16)] == [False, False, True, True,
                                                                    False]   # 16: not profiled
  assert auto.too_small({2: 1.0, 4: 2.5}, 4) and not auto.too_small({2: 1.0, 4: 2.0}, 4)


def test_a_short_fit_weighs_start_up_and_a_long_one_speed():
  found = [auto.Candidate("1f1b", 1, "synchronous"), auto.Candidate("1f1b", 4, "synchronous")]
  speeds = dict(zip(found, [1000.0, 1250.0]))   # M=4 a quarter faster, 3 s more to start
  start = dict(zip(found, [1.0, 4.0]))
  epoch = 2000   # samples
  short = auto.rank(found, speeds, {1: 1.0, 4: 1.1}, {}, samples=2 * epoch, start=start)
  assert short[0].candidate.micro_batches == 1
  assert short[0].seconds == pytest.approx(1.0 + 2 * epoch / 1000.0)
  assert short[1].seconds == pytest.approx(4.0 + 2 * epoch / 1250.0) and short[1].start == 4.0
  long = auto.rank(found, speeds, {1: 1.0, 4: 1.1}, {}, samples=20 * epoch, start=start)
  assert long[0].candidate.micro_batches == 4
  lines = auto.report_lines(long, 100, 20)
  assert "start-up" in lines[0] and "4.0 s" in lines[1] and "1.0 s" in lines[2]


def _rank(speeds, epochs_by_kind, compute=None):
  found = [auto.Candidate("1f1b", 4, "synchronous"), auto.Candidate("spectrain", 1, "spectrain"),
           auto.Candidate("spectrain", 8, "spectrain advised")]
  return auto.rank(found, dict(zip(found, speeds)), compute or {1: 1.0, 4: 1.2, 8: 1.5},
                   epochs_by_kind)


def test_time_to_accuracy_counts_a_stale_methods_extra_epochs_against_its_speed():
  # spectrain is twice as fast but needs 2.5 times the epochs: the schedule wins.
  rows = _rank([1000.0, 2000.0, 900.0], {"spectrain": 2.5, "spectrain advised": 1.2})
  assert rows[0].candidate.method == "1f1b"
  assert rows[0].seconds == pytest.approx(1 / 1000) and rows[1].seconds == pytest.approx(1.25 / 1000)
  # With fewer epochs than synchronous training the advised spectrain wins though slower.
  rows = _rank([1000.0, 2000.0, 900.0], {"spectrain": None, "spectrain advised": 0.8})
  assert rows[0].candidate.kind == "spectrain advised"
  assert rows[0].seconds == pytest.approx(0.8 / 900)


def test_schedules_predicted_alike_at_one_m_rank_by_what_they_keep():
  # Stages sharing the cores: the three schedules predicted alike but for the last digits.
  found = [auto.Candidate(m, 4, "synchronous") for m in ("gpipe", "zb", "1f1b")]
  found += [auto.Candidate("1f1b", 8, "synchronous"), auto.Candidate("2bw", 1, "2bw")]
  rates = [1000.0 * (1 + 3e-9), 1000.0 * (1 + 1e-9), 1000.0, 999.9, 1000.0]
  rows = auto.rank(found, dict(zip(found, rates)), {1: 1.0, 4: 1.0, 8: 1.0}, {"2bw": 1.0})
  assert [r.candidate.name for r in rows[:3]] == ["1f1b M=4", "zb M=4", "gpipe M=4"]
  # Another M ranks by its own prediction (2bw M=1 as fast as 1f1b M=4 is no tie with it).
  assert [r.candidate.name for r in rows[3:]] == ["2bw M=1", "1f1b M=8"]
  # Faster by more than a tie: the prediction ranks.
  rates[1] = 1000.0 * (1 + 2 * auto.TIE)
  rows = auto.rank(found, dict(zip(found, rates)), {1: 1.0, 4: 1.0, 8: 1.0}, {"2bw": 1.0})
  assert rows[0].candidate.name == "zb M=4"


def test_candidates_that_cannot_win_say_why():
  rows = _rank([1000.0, 3000.0, 900.0], {"spectrain": None}, compute={1: 1.0, 4: 1.2, 8: 2.5})
  why = {r.candidate.kind: r.why for r in rows}
  assert "did not reach the synchronous accuracy" in why["spectrain"]
  assert "too small to keep a device busy (compute 2.5x" in why["spectrain advised"]
  assert rows[0].candidate.kind == "synchronous" and not rows[0].why
  rows = _rank([1000.0, 3000.0, 900.0], {})   # an optimizer no run measured
  assert "not measured for this optimizer" in {r.candidate.kind: r.why for r in rows}["spectrain"]
  lines = auto.report_lines(rows, 32, 10)
  assert "chosen" in lines[1] and lines[1].startswith("1f1b M=4")


def test_the_epochs_table_counts_a_method_only_where_every_run_reached_the_accuracy():
  assert epochs.factor("adam", 4)["spectrain advised"] == pytest.approx(0.81)
  assert epochs.factor("sgd", 4)["spectrain advised"] is None   # 8 of 9 runs
  assert epochs.factor("sgd", 3) == epochs.factor("sgd", 4)     # the next depth measured
  assert epochs.factor("sgd", 16) == {} and epochs.factor(None, 4) == {}


@pytest.fixture(scope="module")
def compiled_pipe():
  tfpipe.devices.ensure_logical_cpus(2)
  pipe = tfpipe.Pipeline(helpers.mlp(width=256), num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1, momentum=0.9),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return pipe


def test_the_profile_times_every_stage_and_leaves_the_weights_and_updates_as_they_were(
    compiled_pipe):
  pipe = compiled_pipe
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  before = [w.numpy() for w in pipe.model.weights]
  for p in pipe.programs:   # a step count, momentum slots and accumulators of their own
    p.updates.build_accumulators()
    p.optimizer.iterations.assign(3)
    for v in p.optimizer.variables[1:] + p.updates.accumulators:
      v.assign(tf.fill(v.shape, tf.constant(0.25, v.dtype)))
  state = [[v.numpy() for v in p.updates.state()] for p in pipe.programs]
  called = costs_lib.measure(pipe, x, y, inline=False, repeats=2, runs_per_call=2)
  traced = costs_lib.measure(pipe, x, y, inline=True, repeats=2, runs_per_call=2, quick=True,
                             update=0.5, cores=1.5)
  pipe._load_weights()
  helpers.assert_weights_close([w.numpy() for w in pipe.model.weights], before, 0, 0)
  # The profile's updates stepped the optimizers and filled the accumulators: put back.
  for p, values in zip(pipe.programs, state):
    helpers.assert_weights_close([v.numpy() for v in p.updates.state()], values, 0, 0)
  assert len(called.forward) == len(called.backward) == 2 and len(called.transfer) == 1
  assert min(called.forward + called.backward) > 0 and called.update > 0
  assert called.per_task > 0 and called.ordered            # each task a call
  assert traced.per_task == 0 and not traced.ordered       # traced into one graph
  assert traced.update == 0.5 and traced.cores == 1.5      # given, not measured
  assert traced.forward[0] == pytest.approx(traced.backward[0] / 2)   # quick: F = (F+B) / 3
  assert 1.0 <= called.cores <= 2.0
  rate = costs_lib.predict(called, "1f1b", 32, 2)
  assert np.isfinite(rate) and rate > 0


def test_a_quick_profile_traces_each_stage_once_beside_the_last_ones_first_call_and_times_them_together_without_a_trace(
    compiled_pipe, monkeypatch):
  # Traces were most of a profile's seconds: the stages' work together is timed by calling
  # each stage's traced runs at once from threads, not by tracing them all again.
  traced, runs = [], costs_lib._Runs

  events = []

  class Recorded(runs):
    def __init__(self, works, *args, pool=None, **options):
      traced.append((len(works), pool is not None))   # its first call started on a thread?
      super().__init__(works, *args, pool=pool, **options)

    def wait(self):
      super().wait()
      events.append("first call ended")

    def seconds(self, *args, **options):
      events.append("timed")
      return super().seconds(*args, **options)
  monkeypatch.setattr(costs_lib, "_Runs", Recorded)
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  costs = costs_lib.measure(compiled_pipe, x, y, micro_batches=1, inline=True, repeats=3,
                            runs_per_call=2, quick=True)
  compiled_pipe._load_weights()
  # One function per stage (and one update, on one stage, where the stages accumulate), each
  # of one work.
  updates = compiled_pipe.programs[0].updates.accumulators is not None
  assert traced == [(1, True)] * (2 + (1 if updates else 0))
  # No task is timed while another's first call (its graph's optimisation) may still run.
  assert "timed" not in events[:len(traced)] and events.count("first call ended") >= len(traced)
  assert 1.0 <= costs.cores <= 2.0 and min(costs.forward + costs.backward) > 0
  made = costs_lib._Runs([(lambda xs: [xs[0] * 2.0], [tf.ones([4])], "/device:CPU:0")], 1)
  assert made.call_seconds is None and made.seconds(2) > 0 and made.call_seconds > 0
  assert costs_lib._at_once([made, made], 3) > 0


def test_a_quick_profile_feeds_each_stage_from_the_one_before_without_tracing_its_forward():
  # The next stage's inputs come from an eager inference run: tracing the forward (and its
  # weight read) for them was 10-15% of a quick profile of an MLP at K=4.
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1, momentum=0.9),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=32))
  first = pipe.programs[0].functions.traced
  names = ("read_weights", "forward", "forward_on", "infer")
  before = {name: first[name].experimental_get_tracing_count() for name in names}
  costs = costs_lib.measure(pipe, x, y, micro_batches=1, inline=True, repeats=2,
                            runs_per_call=1, quick=True, cores=1.0)
  pipe._load_weights()
  assert {name: first[name].experimental_get_tracing_count() for name in names} == before
  assert min(costs.forward + costs.backward) > 0   # both stages timed


def test_stages_run_at_once_are_timed_at_their_fastest_quarter_after_warm_calls(monkeypatch):
  # Calls of every stage at once took ~19 ms or ~12 ms call by call (the executor's order),
  # the first ~10 of a graph ~19 ms: a median of few calls read the cores half idle.
  clock = [0.0]
  monkeypatch.setattr(costs_lib.time, "perf_counter", lambda: clock[0])

  class Run:   # a traced stage whose calls take the next of `durations`
    def __init__(self, durations):
      self.durations = iter(durations)

    def call(self):
      clock[0] += next(self.durations)
      return []
  mixed = [0.019] * 7 + [0.012] * 5
  assert costs_lib.TOGETHER_REPEATS == len(mixed) and costs_lib.TOGETHER_QUANTILE == 0.25
  assert costs_lib._at_once([Run(mixed)], 5) == pytest.approx(0.012)
  asked = []
  real = costs_lib.median_seconds

  def median_seconds(fn, repeats, untimed=2, quantile=0.5):
    asked.append((repeats, untimed, quantile))
    return real(fn, repeats, untimed, quantile)
  monkeypatch.setattr(costs_lib, "median_seconds", median_seconds)
  work = (lambda xs: [xs[0] * 2.0], [tf.ones([4])], "/device:CPU:0")
  clock[0] = 0.0   # real runs below: they take no time on the fake clock
  costs_lib._in_graph([work, work], repeats=5, runs_per_call=1)
  # 12 timed after 12 warm calls, after the first call (timed apart: where TensorFlow
  # optimises the graph).
  assert asked == [(12, 12, 0.25)]


def test_a_full_profile_takes_the_higher_of_its_two_readings_of_the_cores(compiled_pipe,
                                                                          monkeypatch):
  # Either reading (every stage in one graph, or their graphs called from threads) errs low
  # only, when the executor's order leaves a core idle, and one graph may keep that order.
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  cores = {}
  for graph, threads in ((1e-9, 1e3), (1e3, 1e-9), (1e3, 1e3)):   # seconds together
    monkeypatch.setattr(costs_lib, "_in_graph", lambda *args, s=graph, **kw: s)
    monkeypatch.setattr(costs_lib, "_at_once", lambda runs, repeats, s=threads: s)
    cores[(graph, threads)] = costs_lib.measure(compiled_pipe, x, y, repeats=2,
                                                runs_per_call=2).cores
    compiled_pipe._load_weights()
  assert cores == {(1e-9, 1e3): 2.0, (1e3, 1e-9): 2.0, (1e3, 1e3): 1.0}   # 2 logical CPUs


def test_a_profile_of_some_stages_times_only_them(compiled_pipe):
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  costs = costs_lib.measure(compiled_pipe, x, y, micro_batches=2, inline=True, repeats=2,
                            runs_per_call=2, quick=True, stages=[1])
  compiled_pipe._load_weights()
  assert costs.forward[0] == costs.backward[0] == 0 and costs.forward[1] > 0
  assert costs.transfer == [0.0] and costs.cores is None and costs.update > 0


def test_a_profile_kept_traced_times_other_micro_batch_sizes_without_a_trace(compiled_pipe,
                                                                             monkeypatch):
  made, runs = [], costs_lib._Runs

  class Counted(runs):
    def __init__(self, *args, **options):
      super().__init__(*args, **options)
      made.append(self)
  monkeypatch.setattr(costs_lib, "_Runs", Counted)
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  traced, options = {}, dict(inline=True, repeats=2, runs_per_call=2, quick=True)
  one = costs_lib.measure(compiled_pipe, x, y, micro_batches=1, traced=traced, **options)
  # Two stages' tasks and one update (accumulated at M=1 too), each traced for any batch.
  assert len(made) == 3 and one.update > 0
  program_class, forwards = type(compiled_pipe.programs[0]), []
  forward = program_class.forward
  monkeypatch.setattr(program_class, "forward",
                      lambda self, *a, **k: forwards.append(self.index) or forward(self, *a, **k))
  four = costs_lib.measure(compiled_pipe, x, y, micro_batches=4, traced=traced, **options)
  compiled_pipe._load_weights()
  assert len(made) == 3   # nothing traced again
  assert forwards == []   # the next stage's inputs: the first rows of the outputs kept
  fed = [r.inputs[0].shape[0] for r in made if r.inputs]
  assert fed == [16, 16]   # the stages' tasks fed micro-batches of 64 / 4
  assert four.cores is not None and min(four.forward + four.backward) > 0 and four.update > 0
  with pytest.raises(ValueError, match="pass quick=True"):
    costs_lib.measure(compiled_pipe, x, y, traced={}, inline=True)


def test_a_quick_profile_times_what_each_stage_took_to_trace_and_run_first_inlined_as_a_window(
    compiled_pipe, monkeypatch):
  from tfpipe import compat
  light, entered = compat.light_calls, []

  def recorded(layout=True):
    entered.append(layout)
    return light(layout)
  monkeypatch.setattr(compat, "light_calls", recorded)
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  traced, options = {}, dict(repeats=2, runs_per_call=2, quick=True)
  costs_lib.measure(compiled_pipe, x, y, micro_batches=1, inline=False, traced=traced, **options)
  assert entered == []   # tasks as calls: their graphs optimised as the stage functions are
  inlined = costs_lib.measure(compiled_pipe, x, y, micro_batches=1, inline=True, traced=traced,
                              **options)
  compiled_pipe._load_weights()
  # Inlined tasks' graphs run as the executor's inlined windows: the lighter Grappler (no
  # layout pass on CPUs), every call.
  assert entered and set(entered) == {False} and inlined.forward[0] > 0
  for inline in (False, True):
    seconds = costs_lib.start_seconds(traced, inline, 2)
    runs = [traced[((0, "fb"), inline)], traced[((1, "step"), inline)]]
    assert seconds == [r.trace_seconds + r.first_seconds for r in runs]
    assert all(r.trace_seconds > 0 and r.first_seconds > 0 for r in runs)


def test_a_candidates_start_up_counts_the_copies_of_each_stages_tasks_its_epoch_traces(
    compiled_pipe, monkeypatch):
  from tfpipe.plan import policies, windows
  from tfpipe.runtime import compiled
  from tfpipe.training import auto as auto_training
  runtime = compiled_pipe.runtime
  # A loop window inlined holds its M micro-batches on every stage.
  assert auto_training._executed(compiled_pipe, "1f1b", 4, 62) == (True, [4, 4])
  assert auto_training._executed(compiled_pipe, "gpipe", 8, 62) == (True, [8, 8])
  # Inlined windows that do not loop (micro-batches on small stages): the forwards of the
  # distinct windows, whatever the epoch's length past the warm-up, steady and last windows.
  for N in (200, 62, 40):
    inline, copies = auto_training._executed(compiled_pipe, "spectrain", 2, N)
    schedule, diffs = policies.epoch("spectrain", 2, N, 2)
    plan = windows.plan(schedule, diffs, runtime.window)
    assert inline and copies == windows.traced_forwards(plan, 2)
    assert copies[0] == 2 * min(N, 2 * runtime.window + (N - 1) % runtime.window + 1)
  # Tasks as calls of the stage functions: each traced once (one batch per update on small
  # stages, or any stages too large to inline).
  assert auto_training._executed(compiled_pipe, "spectrain", 1, 62) == (False, [1, 1])
  monkeypatch.setattr(compiled.CompiledRuntime, "INLINE_LOOP_OPS", 0)
  monkeypatch.setattr(compiled.CompiledRuntime, "INLINE_OPS", 0)
  assert auto_training._executed(compiled_pipe, "1f1b", 4, 62) == (False, [1, 1])
  assert auto_training._executed(compiled_pipe, "spectrain", 1, 62) == (False, [1, 1])


def test_the_profiles_trace_without_autograph_as_the_executor_does(compiled_pipe, monkeypatch):
  # AutoGraph converting the stage code was over half of a profile's seconds.
  from tensorflow.python.autograph.impl import api
  from tfpipe.stage import partition
  from tfpipe.training import layer_profile
  converted = []
  convert = api._convert_actual
  monkeypatch.setattr(api, "_convert_actual",
                      lambda entity, *a: converted.append(entity) or convert(entity, *a))
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  costs_lib.measure(compiled_pipe, x, y, inline=True, repeats=1, runs_per_call=1, quick=True)
  profiler = layer_profile.Profiler(batch_size=8, device="/device:CPU:0", repeats=1)
  profiler(partition.graph_nodes(helpers.mlp(width=8))[2])
  assert converted == []
  tf.function(lambda t: t + 1.0)(tf.ones([1]))   # the probe sees a conversion where one is made
  assert converted


def test_auto_profiles_each_candidate_the_way_the_executor_will_run_it(compiled_pipe,
                                                                      monkeypatch):
  from tfpipe.runtime import compiled
  from tfpipe.training import auto as auto_training
  monkeypatch.setattr(compiled.CompiledRuntime, "INLINE_OPS", 0)   # windows of stage calls
  seen, made, measure, runs = [], [], costs_lib.measure, costs_lib._Runs

  def recorded(pipe, x, y, micro_batches=None, inline=None, method=None, **options):
    seen.append((micro_batches, inline, method))
    made.append(0)
    costs = measure(pipe, x, y, micro_batches=micro_batches, inline=inline, method=method,
                    **options)
    assert costs.cores is not None and all(f > 0 for f in costs.forward)   # every stage timed
    return costs

  class Counted(runs):
    def __init__(self, *args, **options):
      made[-1] += 1
      super().__init__(*args, **options)
  monkeypatch.setattr(costs_lib, "measure", recorded)
  monkeypatch.setattr(costs_lib, "_Runs", Counted)
  kinds = ("spectrain", "spectrain advised", "2bw")
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: dict.fromkeys(
      kinds, 1.0))   # every candidate a contender
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  # A long fit: speed, not start-up, decides, so more than M=1 is profiled.
  choice = auto_training.choose(compiled_pipe, x, y, 64, 8, epochs=10 ** 5)
  ways = {(M, inline): method for M, inline, method in seen}
  # At M=1, 1f1b finishes each mini-batch in a loop window (inlined by its own size), the
  # asynchronous methods run windows of calls: one profile for each way.
  assert ways[(1, True)] == "1f1b" and ways[(1, False)] in ("spectrain", "2bw")
  assert len(seen) == len(ways) and len({M for M, _ in ways}) > 1
  # Each way's first profile traces each stage's task (and one update); a later M, none.
  first = {}
  for (M, inline, _), count in zip(seen, made):
    assert count == (3 if inline not in first else 0), (M, inline, count)
    first.setdefault(inline, M)
  assert all(r.samples_per_second > 0 for r in choice.rows if r.seconds is not None)
  # Candidates the epochs table rules out (never measured here) are not profiled.
  seen.clear()
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: {})
  choice = auto_training.choose(compiled_pipe, x, y, 64, 8)
  compiled_pipe._load_weights()
  assert seen and all(inline for _, inline, _ in seen)
  out = [r for r in choice.rows if r.candidate.kind != "synchronous"]
  assert out and all(r.samples_per_second == 0 and "not measured" in r.why for r in out)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_no_schedule_is_predicted_faster_than_the_least_a_mini_batch_can_take(K):
  from tfpipe.training import auto as auto_training
  for seed in range(10):
    rng = np.random.default_rng(seed)
    forward, backward = list(rng.uniform(1e-4, 1e-3, K)), list(rng.uniform(2e-4, 2e-3, K))
    update = float(rng.uniform(0, 2e-4))
    for cores, ordered in [(1.5, False), (2.0, True), (None, True), (None, False)]:
      costs = simulator.Costs(forward, backward, list(rng.uniform(0, 2e-4, K - 1)), update,
                              per_task=1e-5, cores=cores, ordered=ordered)
      # The cores the stages share at most (the measured `cores` may be fewer).
      least = auto.least_batch_seconds(forward, backward, update, cores and 2.0)
      for method, M in [("1f1b", K), ("gpipe", 2 * K), ("zb", K), ("spectrain", 2 * K)]:
        rate = costs_lib.predict(costs, method, 64, M,
                                 num_batches=auto_training.simulated_batches(K, M))
        assert rate <= 64 / least * (1 + 1e-9), (seed, cores, ordered, method, M)


@pytest.mark.parametrize("epochs", [1, 10 ** 5])
def test_auto_profiles_and_plays_out_only_candidates_that_could_beat_one_predicted(
    compiled_pipe, monkeypatch, epochs):
  # Stages of known costs: compute per mini-batch growing slowly with M, every copy of a
  # stage's tasks 100 ms to trace and first run. A short fit is start-up bound, so a larger M
  # cannot win and is not profiled; whatever the fit, the choice is the brute force's.
  import types
  from tfpipe.training import auto as auto_training
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: {})
  monkeypatch.setattr(costs_lib, "shared_cores", lambda devices: None)
  K, batch, num_batches = 2, 64, 8

  def costs_at(M):
    grow = 1 + 0.05 * M
    return simulator.Costs([1e-3 * grow] * K, [2e-3 * grow] * K, [0.0], 0.0 if M == 1 else 1e-4)
  profiled = []

  def profile(pipe, features, labels, M, inline, method, n, traced):
    profiled.append(M)
    for k in range(K):
      traced[((k, "step" if k == K - 1 else "fb"), inline)] = types.SimpleNamespace(
          trace_seconds=0.05, first_seconds=0.05)
    return costs_at(M)
  monkeypatch.setattr(auto_training, "_profile", profile)
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=batch))
  choice = auto_training.choose(compiled_pipe, x, y, batch, num_batches, epochs)
  found = [r.candidate for r in choice.rows]
  speeds, starts = {}, {}
  for c in found:
    if c.kind == "synchronous":
      speeds[c] = costs_lib.predict(costs_at(c.micro_batches), c.method, batch, c.micro_batches,
                                    num_batches=auto_training.simulated_batches(K, c.micro_batches))
      copies = auto_training._executed(compiled_pipe, c.method, c.micro_batches, num_batches)[1]
      starts[c] = auto_training.START_SHARE * 0.1 * sum(copies)
  samples = epochs * num_batches * batch
  brute = auto.rank(found, {c: speeds.get(c, 0.0) for c in found}, {1: 1.0}, {},
                    samples=samples, start=starts)
  assert choice.candidate == brute[0].candidate
  assert choice.rows[0].seconds == pytest.approx(brute[0].seconds)
  left = [r for r in choice.rows if r.why.startswith("not played out")]
  for r in left:   # each left out could not have won
    assert auto.seconds_to_accuracy(r.candidate, speeds[r.candidate], {}, samples,
                                    starts[r.candidate]) >= choice.rows[0].seconds
  if epochs == 1:   # start-up bound: M=1 alone profiled, the rest left out unplayed
    assert profiled == [1] and len(left) == len(speeds) - 1
    assert sum("no faster than the chosen" in line for line in choice.lines) == len(left)
    assert "at least" in choice.summary() and "to accuracy over 1 epoch than" in choice.summary()


@pytest.mark.parametrize("grow", [3.0, 1.1])
def test_a_way_not_traced_yet_is_traced_only_where_the_ms_compute_leaves_it_a_contender(
    compiled_pipe, monkeypatch, grow):
  # M=1 runs inlined, larger M as calls (as a transformer's windows may): each M's compute
  # is first timed the way already traced (no trace). Growing 3x, M=2 is too small to keep
  # a device busy and the calls are never traced; growing slowly over a long fit, they are.
  import types
  from tfpipe.training import auto as auto_training
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: {})
  monkeypatch.setattr(costs_lib, "shared_cores", lambda devices: None)
  monkeypatch.setattr(auto_training, "_executed",
                      lambda pipe, method, M, n: (M == 1, [1] * pipe.num_stages))
  K, batch, profiled = 2, 64, []

  def profile(pipe, features, labels, M, inline, method, n, traced):
    profiled.append((M, inline))
    for k in range(K):
      traced[((k, "step" if k == K - 1 else "fb"), inline)] = types.SimpleNamespace(
          trace_seconds=0.05, first_seconds=0.05)
    scale = grow ** (M.bit_length() - 1)
    return simulator.Costs([1e-3 * scale] * K, [2e-3 * scale] * K, [0.0], 0.0)
  monkeypatch.setattr(auto_training, "_profile", profile)
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=batch))
  choice = auto_training.choose(compiled_pipe, x, y, batch, 8, epochs=10 ** 5)
  if grow > auto.BUSY:
    assert profiled == [(1, True), (2, True)]
    assert all(r.candidate.micro_batches == 1 for r in choice.rows if r.seconds is not None)
  else:
    assert profiled[:3] == [(1, True), (2, True), (2, False)]
    assert all(inline is False for M, inline in profiled[3:])   # traced for any batch size


def test_auto_refuses_the_options_it_chooses():
  with pytest.raises(ValueError, match="method='auto' chooses micro_batches, nesterov"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="auto", micro_batches=4, nesterov=True)
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="gpipe")
  with pytest.raises(ValueError, match="runs method='gpipe', which was not chosen"):
    pipe.plan_report()
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="auto")
  pipe.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = helpers.as_arrays(helpers.batches(n=2))
  with pytest.raises(ValueError, match="would take it from the generator: give the first fit"):
    pipe.fit(((x[i:i + 16], y[i:i + 16]) for i in range(0, 32, 16)), epochs=1)


def test_auto_chooses_at_the_first_fit_says_what_and_trains_the_choice(capsys, monkeypatch):
  from tfpipe.training import auto as auto_training
  choose, horizons = auto_training.choose, []

  def recorded(pipe, features, labels, batch_size, num_batches, epochs=1):
    horizons.append((batch_size, num_batches, epochs))
    return choose(pipe, features, labels, batch_size, num_batches, epochs)
  monkeypatch.setattr(auto_training, "choose", recorded)
  tfpipe.devices.ensure_logical_cpus(2)
  pipe = tfpipe.Pipeline(helpers.mlp(width=32), num_stages=2, method="auto")
  assert pipe.describe().startswith("method=auto (chosen at the first fit")
  summary = []
  pipe.summary(summary.append)
  assert "method=auto (chosen at the first fit" in summary[0]
  pipe.compile(keras.optimizers.Adam(1e-3),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  with pytest.raises(RuntimeError, match="chooses at the first fit"):
    pipe.plan_report()
  x, y = helpers.as_arrays(helpers.batches(n=8, batch_size=32))
  before = [w.numpy() for w in pipe.model.weights]
  history = pipe.fit(x, y, batch_size=32, epochs=3, initial_epoch=1, verbose=2)
  # The choice weighs start-up against the epochs this fit trains.
  assert horizons == [(32, 8, 2)]
  printed = capsys.readouterr().out
  chosen = pipe.chosen.candidate
  assert f"method='auto' chose {chosen.name}" in printed
  assert "s of start-up predicted" in printed and "to accuracy over 2 epochs" in printed
  assert pipe.method == chosen.method and len(history.history["loss"]) == 2
  if chosen.kind == "synchronous":
    assert pipe.micro_batches == chosen.micro_batches
  assert pipe.describe().endswith("chosen by method='auto'")
  summary = []
  pipe.summary(summary.append)
  assert summary[0].endswith("chosen by method='auto'") and f"method={chosen.method}" in summary[0]
  assert any(not np.allclose(a, b.numpy()) for a, b in zip(before, pipe.model.weights))
  lines = []
  pipe.plan_report(lines.append)
  assert lines[0].startswith("method='auto' chose") and "chosen" in lines[2]
  # Then the chosen pipeline's predicted peak per stage, its last line.
  assert len(lines) == 3 + len(pipe.chosen.rows)
  assert lines[-1] == summary[-1] and lines[-1].startswith(" Predicted peak memory per stage")
  # A second fit keeps the choice.
  pipe.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert pipe.chosen.candidate == chosen


def test_auto_trains_as_keras_when_it_chooses_a_synchronous_schedule(monkeypatch):
  # The profile's updates (weights, the optimizers' slots and steps) leave nothing behind: the
  # choice trains from the model's weights and fresh optimizers, as Keras does.
  from tfpipe.training import auto as auto_training, probe as probe_lib
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: {})
  monkeypatch.setattr(probe_lib, "trains_first", lambda *a: False)   # profiles first
  tfpipe.devices.ensure_logical_cpus(2)
  build = lambda: helpers.sequential_mlp(dtype="float64")
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  x, y = helpers.as_arrays(helpers.batches(20))
  optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9)
  expected = helpers.keras_fit_weights(build(), optimizer(), loss(), x, y, batch_size=16,
                                       shuffle=False, epochs=2, verbose=0)
  model = build()
  pipe = tfpipe.Pipeline(model, num_stages=2, method="auto")
  pipe.compile(optimizer(), loss())
  pipe.fit(x, y, batch_size=16, shuffle=False, epochs=2, verbose=0)
  assert pipe.chosen.kind == "synchronous"
  helpers.assert_weights_close(model.get_weights(), expected)


def test_the_compiled_executors_zero_bubble_backward_is_profiled_whole_in_its_input_half(
    compiled_pipe):
  # Traced into the compiled executor's windows, zb's B takes both gradients and W applies
  # them: a profile that split the backward in half had zb predicted up to 1.38x 1f1b's
  # samples/s on devices of their own, where it runs 1f1b's work in 1f1b's order.
  x, y = helpers.as_arrays(helpers.batches(n=1, batch_size=64))
  measured = costs_lib.measure(compiled_pipe, x, y, repeats=2, runs_per_call=2, quick=True,
                               update=0.5, cores=1.5)
  assert measured.input_share == 1.0
  rng = np.random.default_rng(0)
  for K in (2, 4, 8):
    forward = list(rng.uniform(1e-3, 3e-3, K))
    for cores, ordered in ((None, True), (None, False), (2.0, False)):
      costs = simulator.Costs(forward, [2 * f for f in forward], [1e-4] * (K - 1), 1e-4,
                              input_share=1.0, cores=cores, ordered=ordered)
      for M in (K, 2 * K):
        assert (costs_lib.predict(costs, "zb", 128, M)
                <= costs_lib.predict(costs, "1f1b", 128, M) * (1 + 1e-9))


def test_auto_trains_on_the_probes_stage_programs_where_its_choice_runs_their_tasks(
    monkeypatch):
  # The probe's programs (1f1b) run gpipe's and 1f1b's tasks at any M: the choice keeps them
  # (no second compile; the update the profile traced), and trains as Keras from them
  # (`test_auto_trains_as_keras_when_it_chooses_a_synchronous_schedule`).
  from tfpipe.training import auto as auto_training, probe as probe_lib
  monkeypatch.setattr(auto_training.epochs_lib, "factor", lambda family, K: {})
  found = auto_training.auto_plan.candidates   # zb's halves are other tasks: left out here
  monkeypatch.setattr(auto_training.auto_plan, "candidates", lambda *a: [
      c for c in found(*a) if c.method != "zb"])
  monkeypatch.setattr(probe_lib, "trains_first", lambda *a: False)   # profiles first
  tfpipe.devices.ensure_logical_cpus(2)
  pipe = tfpipe.Pipeline(helpers.mlp(width=32), num_stages=2, method="auto")
  pipe.compile(keras.optimizers.SGD(0.1),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  probe = list(pipe.programs)
  x, y = helpers.as_arrays(helpers.batches(n=8, batch_size=32))
  pipe.fit(x, y, batch_size=32, epochs=1, verbose=0)
  assert pipe.chosen.kind == "synchronous"
  assert pipe.programs == probe and pipe.programs[0].policy == pipe.options.policy
  assert pipe.runtime.programs == probe


def test_stage_programs_take_another_policy_only_where_their_tasks_and_updates_stay():
  tfpipe.devices.ensure_logical_cpus(2)
  pipe = tfpipe.Pipeline(helpers.mlp(width=16), num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  rules = [p.rule for p in pipe.programs]
  gpipe = policies.policy_for("gpipe")
  assert assemble.adopt(pipe.programs, gpipe, rules)
  assert all(p.policy == gpipe for p in pipe.programs)
  for method in ("spectrain", "2bw"):   # predicted weights; a second buffer
    assert not assemble.adopt(pipe.programs, policies.policy_for(method), rules)
    assert all(p.policy == gpipe for p in pipe.programs)   # nothing changed
  delayed = [dataclasses.replace(r, delay=1) for r in rules]
  assert not assemble.adopt(pipe.programs, policies.policy_for("1f1b"), delayed)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_the_simulator_plays_fewer_mini_batches_at_more_micro_batches_for_the_same_prediction(K):
  from tfpipe.training import auto as auto_training
  rng = np.random.default_rng(K)
  costs = simulator.Costs(list(rng.uniform(1e-4, 1e-3, K)), list(rng.uniform(2e-4, 2e-3, K)),
                          list(rng.uniform(0, 2e-4, K - 1)), 1e-4, cores=1.5, ordered=False)
  for method, M, tolerance in [("1f1b", K, 1e-9), ("gpipe", 2 * K, 1e-9), ("zb", K, 0.01),
                               ("spectrain", 1, 0.0), ("spectrain", 2 * K, 0.05)]:
    played = auto_training.simulated_batches(K, M)
    assert played <= 32 and played * M >= 32
    assert costs_lib.predict(costs, method, 64, M, num_batches=played) == pytest.approx(
        costs_lib.predict(costs, method, 64, M, num_batches=32), rel=tolerance)


@pytest.mark.parametrize("K", [2, 4, 8])
def test_whether_an_epoch_loops_over_one_mini_batch_shows_over_two_mini_batches(K):
  from tfpipe.plan import policies, windows
  for method in policies.PIPELINE_METHODS:
    for M in sorted({1, 2, K, 2 * K}):
      if (M > 1 and method not in policies.MICRO_BATCH_METHODS) or (
          method == "interleaved" and (M == 1 or M % K)):
        continue
      loops = [windows.flush_window(*policies.epoch(method, K, N, M)) is not None
               for N in (2, 2 * K, 32)]
      assert loops[0] == loops[1] == loops[2], (method, M)


def _sgd_mlp_fit(pipe_or_model, x, y, verbose=0):
  return pipe_or_model.fit(x, y, batch_size=16, shuffle=False, epochs=2, verbose=verbose)


def _auto_against_keras(metrics, **compile_options):
  """An auto pipeline of a float64 MLP on 2 devices compiled with momentum SGD (and
  `compile_options`), its model, the data, and Keras's weights and History on them."""
  tfpipe.devices.ensure_logical_cpus(2)
  build = lambda: helpers.sequential_mlp(dtype="float64")
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  optimizer = lambda: keras.optimizers.SGD(0.1, momentum=0.9)
  x, y = helpers.as_arrays(helpers.batches(20))
  expected = build()
  expected.compile(optimizer(), loss(), metrics=metrics)
  keras_history = _sgd_mlp_fit(expected, x, y).history
  model = build()
  pipe = tfpipe.Pipeline(model, num_stages=2, method="auto")
  pipe.compile(optimizer(), loss(), metrics=metrics, **compile_options)
  return pipe, model, (x, y), (expected.get_weights(), keras_history)


def test_auto_trains_its_probe_first_and_keeps_it_where_a_profile_would_not_pay(capsys,
                                                                               monkeypatch):
  # Momentum SGD: the epochs table rules out every asynchronous candidate, so the probe (1f1b,
  # M=2, a synchronous schedule) trains from the first batch; a 2-epoch fit of tiny steps
  # cannot pay for a profile (the probe's start-up) out of a tenth of its rest.
  def no_profile(*args, **kwargs):
    raise AssertionError("profiled")
  monkeypatch.setattr(costs_lib, "measure", no_profile)
  pipe, model, (x, y), (weights, keras_history) = _auto_against_keras(None)
  history = _sgd_mlp_fit(pipe, x, y, verbose=2).history
  printed = capsys.readouterr().out
  assert "method='auto' trains its probe, 1f1b M=2 (micro-batches of 8)" in printed
  assert "method='auto' kept its probe, 1f1b M=2" in printed and "rest of the fit" in printed
  assert pipe.chosen.kept and pipe.chosen.seconds == 0.0 and pipe.method == "1f1b"
  assert pipe.chosen.rows[0].samples_per_second > 0 and pipe.micro_batches == 2
  lines = []
  pipe.plan_report(lines.append)
  assert lines[0].startswith("method='auto' kept its probe") and "kept, measured" in lines[2]
  helpers.assert_weights_close(model.get_weights(), weights)
  np.testing.assert_allclose(history["loss"], keras_history["loss"], rtol=1e-6)


@pytest.mark.parametrize("offered,window", [([("gpipe", 4), ("1f1b", 1)], 2),
                                            ([("1f1b", 2)], 2), ([("1f1b", 4)], 1)])
def test_auto_profiles_at_its_probes_verdict_and_hands_the_rest_to_its_choice_as_keras_would(
    offered, window, monkeypatch):
  # A profile that pays (PROFILE_SHARE forced up) runs where the probe's second window ends,
  # mid-epoch; the choice takes over the rest of that epoch on the probe's stage programs
  # (momentum and the running metrics as they were): the weights and History are Keras's.
  from tfpipe.training import auto as auto_training, probe as probe_lib
  monkeypatch.setattr(probe_lib, "PROFILE_SHARE", 1e9)
  monkeypatch.setattr(auto_training.auto_plan, "candidates", lambda *a: [
      auto.Candidate(m, M, "synchronous") for m, M in offered])
  weighed = []
  choose = auto_training.choose

  def recorded(pipe, *args, **kwargs):
    weighed.append(kwargs)
    return choose(pipe, *args, **kwargs)
  monkeypatch.setattr(auto_training, "choose", recorded)
  pipe, model, (x, y), (weights, keras_history) = _auto_against_keras(
      ["accuracy"], steps_per_execution=window)
  history = _sgd_mlp_fit(pipe, x, y).history
  # The verdict at the end of the probe's second window; the profile weighs the rest of the
  # fit (40 mini-batches less those trained), the probe's start-up already paid.
  assert len(weighed) == 1 and weighed[0]["trained"].name == "1f1b M=2"
  chosen = pipe.chosen
  assert not chosen.kept and chosen.seconds > 0 and chosen.after >= 2 * window
  assert weighed[0]["samples"] == (40 - chosen.after) * 16
  assert (pipe.method, pipe.micro_batches) == (chosen.candidate.method,
                                               chosen.candidate.micro_batches)
  assert (pipe.method, pipe.micro_batches) in offered
  assert pipe.runtime.updates[-1] == 40   # every mini-batch updated once
  helpers.assert_weights_close(model.get_weights(), weights)
  for name in ("loss", "accuracy"):
    np.testing.assert_allclose(history[name], keras_history[name], rtol=1e-6)


def test_the_probe_profiles_where_its_start_up_costs_at_most_a_share_of_the_fits_rest(
    monkeypatch):
  from tfpipe.training import auto as auto_training
  from tfpipe.training import probe as probe_lib
  clock = [0.0]
  monkeypatch.setattr(auto_training.time, "perf_counter", lambda: clock[0])

  def run(first, later, rest, window=4, handed=None):
    """A probe whose first window takes `first` s and its second `later` s: its verdict."""
    probe = probe_lib.Probe(None, None, 16)
    probe.epoch_begins(100, window)
    for b in range(2 * window):
      if b == window - 1:
        clock[0] += first
      elif b == 2 * window - 1:
        clock[0] += later
      stop = probe.result(b, rest - b)
      assert stop == (probe.verdict == "profile") or b < 2 * window - 1
    return probe
  # Steady 0.01 s a mini-batch: 1 s of start-up, a profile of 1.5 s (PROFILE_PER_START),
  # against a tenth of the rest's 0.01 s x rest.
  probe = run(1.04, 0.04, rest=2000)   # 20 s left: 1.5 s <= 2 s
  assert probe.verdict == "profile" and probe.batch_seconds == pytest.approx(0.01)
  assert probe.start == pytest.approx(1.0) and probe.profile == pytest.approx(1.5)
  assert run(1.04, 0.04, rest=1400).verdict == "keep"   # 14 s left: 1.5 s > 1.4 s
  kept = auto_training.kept_probe(run(1.04, 0.04, rest=500), 2)
  assert kept.rows[0].samples_per_second == pytest.approx(1600)
  assert "over 10% of the rest of the fit (~4.9 s" in kept.summary()
  # Windows handed on together (a window's end within a millisecond of the last): one span.
  clock[0] = 0.0
  probe = probe_lib.Probe(None, None, 16)
  probe.epoch_begins(100, 2)
  for b, advance in enumerate([0, 1.0, 0, 0, 0, 0.04]):
    clock[0] += advance
    probe.result(b, 2000)
  assert probe.spans == [(1.0, 2), (pytest.approx(0.04), 4)] and probe.verdict == "profile"


def test_auto_trains_first_only_where_the_synchronous_schedules_alone_can_win():
  tfpipe.devices.ensure_logical_cpus(4)
  from tfpipe.training import probe as probe_lib
  for optimizer, first in ((keras.optimizers.SGD(0.1, momentum=0.9), True),
                           (keras.optimizers.Adam(1e-3), False)):   # spectrain advised: 0.81
    pipe = tfpipe.Pipeline(helpers.mlp(width=16), num_stages=4, method="auto")
    pipe.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert probe_lib.trains_first(pipe, 32) == first
  pipe.compile(keras.optimizers.Adam(1e-3, global_clipnorm=1.0),   # synchronous only
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  assert probe_lib.trains_first(pipe, 32)
  assert not probe_lib.trains_first(pipe, 33)   # the probe's M=2 does not divide it
  assert not probe_lib.trains_first(pipe, 32, last_batch=1)
  assert probe_lib.trains_first(pipe, 32, last_batch=3)
