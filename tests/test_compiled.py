"""The compiled executor: windows cut schedules soundly, trace once, stop and infer as promised.

The weight rules on this executor are checked with every method in test_pipeline.py
(parametrised over the executors, with windows smaller than the epoch).
"""

import collections

import keras
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tfpipe.plan import policies, schedules, windows
from tfpipe.rules import optimizers
import tfpipe
from tfpipe.runtime import grouped as grouped_lib

SCHEDULES = [("sequential", 3, 1), ("1f1b", 3, 1), ("1f1b", 4, 2), ("gpipe", 3, 3),
             ("ddg", 3, 1), ("ddg_lockstep", 3, 1), ("timeprest", 3, 2), ("timeprest", 2, 4),
             ("1f1b", 1, 1)]


def _plan(name, K, M, N, W, aligned=True):
  schedule = schedules.build(name, K, N, M)
  diffs = [{t: 0 for t in tasks} for tasks in schedule]
  return schedule, windows.plan(schedule, diffs, W, aligned)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("W", [1, 3, 16])
@pytest.mark.parametrize("name,K,M", SCHEDULES)
def test_windows_hold_every_task_once_in_stage_order_after_its_data(name, K, M, W, aligned):
  schedule, plan = _plan(name, K, M, N=11 if aligned else 40, W=W, aligned=aligned)
  ran = [[t for win in plan for k, t, _, _ in win.tasks if k == j] for j in range(K)]
  assert ran == [[t for t in tasks if t.kind != "S"] for tasks in schedule]
  done = set()
  for win in plan:
    for k, t, _, units in win.tasks:
      if t.kind == "F" and k > 0:
        assert (k - 1, t) in done
      if t.kind == "B":
        assert all((k, schedules.Task("F", *u)) in done for u in units)
        if k < K - 1:
          assert (k + 1, schedules.Task("B", t.batch, t.micro)) in done
      done.add((k, t))


@pytest.mark.parametrize("W", [1, 3, 4])
@pytest.mark.parametrize("name,K,M", SCHEDULES)
def test_each_window_finishes_its_batches(name, K, M, W):
  schedule, plan = _plan(name, K, M, N=11, W=W)
  starts = windows.firsts(11, W)
  assert [(w.first, w.last) for w in plan] == list(zip(starts, [b - 1 for b in starts[1:]] + [10]))
  for win in plan:
    finished = {t.batch for k, t, _, _ in win.tasks if k == K - 1 and schedules.is_update(t)}
    assert finished == set(range(win.first, win.last + 1))


@pytest.mark.parametrize("N,W,expected", [
    (11, 3, [0, 3, 6, 9]), (12, 3, [0, 3, 6, 9]), (3, 3, [0]), (1, 3, [0]), (4, 3, [0, 3]),
    (40, 16, [0, 16, 32]), (5, 1, [0, 1, 2, 3, 4])])
def test_windows_of_w_the_last_one_shorter(N, W, expected):
  assert windows.firsts(N, W) == expected


@pytest.mark.parametrize("N,W,lead,expected", [
    (42, 4, 4, [0, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39]),   # windows 3, 4 x 9, the drain of 3
    (128, 16, 4, [0, 13] + list(range(29, 125, 16)) + [125]), (40, 4, 1, list(range(0, 40, 4))),
    (41, 4, 1, [0, 1] + list(range(5, 41, 4))), (20, 16, 4, None), (11, 4, 3, [0, 1, 5, 9]),
    (11, 4, 4, None)])
def test_unaligned_windows_end_where_the_steady_state_can_and_the_drain_runs_alone(
    N, W, lead, expected):
  assert windows.drained_firsts(N, W, lead) == expected


@pytest.mark.parametrize("name,K,M", [s for s in SCHEDULES if s[0] not in ("sequential",
                                                                               "gpipe")])
def test_unaligned_windows_trace_no_more_tasks_than_aligned_and_finish_their_batches(name, K, M):
  _, aligned = _plan(name, K, M, N=42, W=4)
  _, plan = _plan(name, K, M, N=42, W=4, aligned=False)
  distinct = lambda p: {w.key: len(w.tasks) for w in p}
  assert len(distinct(plan)) <= 3 and sum(distinct(plan).values()) <= sum(
      distinct(aligned).values())
  for win in plan:
    finished = {t.batch for k, t, _, _ in win.tasks if k == K - 1 and schedules.is_update(t)}
    assert finished == set(range(win.first, win.last + 1))
  # 1F1B at K=4: the last window is the drain alone (3 batches, 18 tasks), not 4 + the drain.
  if (name, K, M) == ("1f1b", 4, 1):
    assert (plan[-1].first, plan[-1].last, len(plan[-1].tasks)) == (39, 41, 18)
    assert sum(distinct(plan).values()) == 80 and sum(distinct(aligned).values()) == 112


def test_the_steady_state_windows_trace_alike():
  _, plan = _plan("1f1b", 4, 1, N=40, W=4)
  keys = collections.Counter(w.key for w in plan)
  # warm-up, 8 alike of 4 batches, and the last, which drains the pipeline: 3 traces
  assert len(plan) == 10 and len(keys) == 3
  assert keys[plan[1].key] == 8
  # The last window shorter (2 batches, fewer than the K - 1 = 3 the drain spans): the
  # window before it already starts no forward past batch 41, so 4 traces.
  _, plan = _plan("1f1b", 4, 1, N=42, W=4)
  assert len(plan) == 11 and len(collections.Counter(w.key for w in plan)) == 4
  assert (plan[-1].first, plan[-1].last) == (40, 41)


def test_an_epoch_traces_the_forwards_of_its_distinct_windows_whatever_its_length():
  _, whole = _plan("1f1b", 4, 1, N=40, W=40)
  assert windows.traced_forwards(whole, 4) == [40] * 4   # one window: every forward traced
  _, plan = _plan("1f1b", 4, 1, N=40, W=4)
  traced = windows.traced_forwards(plan, 4)
  # The warm-up, one of the steady windows and the last.
  by_stage = [sum(t.kind == "F" for w in (plan[0], plan[1], plan[-1]) for j, t, _, _ in w.tasks
                  if j == k) for k in range(4)]
  assert traced == by_stage and all(n < 40 for n in traced)
  assert windows.traced_forwards(_plan("1f1b", 4, 1, N=80, W=4)[1], 4) == traced


def test_a_backward_recomputes_its_forward_where_an_earlier_window_ran_it():
  crossing = lambda name, M, N, W: windows.crossing(_plan(name, 3, M, N=N, W=W)[1], 3)
  assert crossing("1f1b", 1, 40, 40) == [0.0, 0.0, 0.0]   # one window: every tape kept
  # A window per batch: each stage's first backward finds its forward; the others' ran in
  # the window before. The last stage's step holds its forward.
  assert crossing("1f1b", 1, 40, 1) == pytest.approx([39 / 40, 39 / 40, 0.0])
  shares = [crossing("1f1b", 1, 40, W) for W in (1, 4, 16)]
  for fewer, more in zip(shares[1:], shares):
    assert all(a <= b for a, b in zip(fewer, more))
  assert shares[2][0] < shares[1][0] < shares[0][0]
  assert crossing("gpipe", 3, 8, 1) == [0.0, 0.0, 0.0]   # each window holds its batches


def test_a_drain_window_finishes_exactly_the_started_batches():
  schedule, plan = _plan("1f1b", 3, 1, N=12, W=2)
  last = windows.drain(plan, 1)    # stopped after batches 0..3; stage 0 started 4 and 5
  assert (last.first, last.last) == (4, 5)
  assert collections.Counter(k for k, _, _, _ in last.tasks) == {0: 2, 1: 3, 2: 4}   # B4 B5; F5 B4 B5; F4B4 F5B5
  assert {t.batch for _, t, _, _ in last.tasks} == {4, 5}


def _train(executor, window, method="pipedream", n=24, callbacks=None, K=3, inline=None,
           **options):
  x, y = helpers.as_arrays(helpers.batches(n))
  model = helpers.mlp()
  runtime = {"executor": executor, "steps_per_execution": window}
  if inline is not None:
    runtime["inline"] = inline
  pipe, compile_ = helpers.pipeline(model, runtime, num_stages=K, method=method, **options)
  compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
  history = pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=callbacks)
  return pipe, model, history


@pytest.mark.parametrize("inline, traces", [
    # 10 windows of 4: warm-up, steady state (8), the last with the drain. Inlined: a function
    # each. Of stage calls: one function holding the three as branches (`runtime.groups`).
    (False, 1),
    (True, 3)])
def test_a_window_traces_once_and_is_reused_across_epochs(inline, traces):
  pipe, _, _ = _train("compiled", 4, n=40, inline=inline)
  assert pipe.runtime.traces == traces
  x, y = helpers.as_arrays(helpers.batches(40))
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=2)
  assert pipe.runtime.traces == traces


@pytest.mark.parametrize("executor", ["compiled", "threaded"])
def test_an_epoch_of_the_schedule_verified_last_is_not_verified_again(executor, monkeypatch):
  from tfpipe.plan import verify
  reports, real = [], verify.verify
  monkeypatch.setattr(verify, "verify", lambda *a: reports.append(real(*a)) or reports[-1])
  pipe, _, _ = _train(executor, 4, n=24)
  x, y = helpers.as_arrays(helpers.batches(24))
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=2)   # the same schedule
  assert len(reports) == 1 and pipe.runtime.report is reports[0]
  pipe.fit(x[:8 * 16], y[:8 * 16], batch_size=16, shuffle=False, verbose=0)   # another one
  assert len(reports) == 2 and pipe.runtime.report is reports[1]
  assert len(reports[1].order) < len(reports[0].order)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)   # the first again: verified lately
  assert len(reports) == 2 and pipe.runtime.report is reports[0]


def test_recent_keeps_the_values_of_the_last_keys_used():
  from tfpipe.runtime import base
  recent, made = base.Recent(size=2), []
  make = lambda key: lambda: made.append(key) or key * 10
  assert [recent.get(k, make(k)) for k in (1, 2, 1, 3, 1, 2)] == [10, 20, 10, 30, 10, 20]
  assert made == [1, 2, 3, 2]   # 2 was the least recently used when 3 came


@pytest.mark.parametrize("inline", [False, True])
def test_windows_of_stage_calls_and_evaluate_windows_mark_their_calls(inline, monkeypatch):
  """`compat.calls_marked` (a control input sparing TensorFlow a scan per call) wraps the
  trace of every window of calls, for the stages' devices; an inlined window has no calls."""
  from tfpipe import compat
  marked, real = [], compat.calls_marked
  monkeypatch.setattr(compat, "calls_marked",
                      lambda devices: marked.append(list(devices)) or real(devices))
  pipe, _, _ = _train("compiled", 4, "spectrain", n=24, inline=inline)
  devices = [p.device for p in pipe.programs]
  assert marked == ([] if inline else [devices] * 3)   # the group's three windows, traced once
  x, y = helpers.as_arrays(helpers.batches(8))
  pipe.evaluate(x, y, batch_size=16, verbose=0)
  assert marked[-1] == devices


@pytest.mark.parametrize("inline", [False, True])
def test_windows_leave_the_window_multiples_only_when_no_batch_hook_reads_them(inline):
  """A batch hook reads every 4th batch, so windows end there; without one the last window
  is the drain alone. The weights and losses are the same."""
  ends = []
  reader = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: ends.append(b))
  read, model, history = _train("compiled", 4, "spectrain", n=24, callbacks=[reader],
                                inline=inline)
  free, free_model, free_history = _train("compiled", 4, "spectrain", n=24, inline=inline)
  assert [w.first for w in read.runtime._plan[1]] == windows.firsts(24, 4)
  assert [w.first for w in free.runtime._plan[1]] == windows.drained_firsts(24, 4, 3) == [
      0, 2, 6, 10, 14, 18, 22]
  assert ends == list(range(24))
  np.testing.assert_allclose(history.history["loss"], free_history.history["loss"], rtol=1e-6)
  for a, b in zip(model.get_weights(), free_model.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)


@pytest.mark.parametrize("method,options", [("pipedream", {}), ("vanilla", {}),
                                            ("spectrain", {}),
                                            ("gpipe", {"micro_batches": 2})])
def test_kept_state_peaks_equal_the_threaded_executors(method, options):
  compiled = _train("compiled", 3, method, n=12, **options)[0].runtime
  threaded = _train("threaded", "auto", method, n=12, **options)[0].runtime
  assert compiled.peak_saved == threaded.peak_saved
  assert compiled.peak_versions == threaded.peak_versions


class _StopAt(keras.callbacks.Callback):
  def __init__(self, batch):
    super().__init__()
    self.batch, self.ends = batch, []

  def on_train_batch_end(self, batch, logs=None):
    self.ends.append(batch)
    if batch == self.batch:
      self.model.stop_training = True


def test_a_stop_takes_effect_at_the_window_end_and_drains_the_started_batches():
  # Window of 4: a stop in batch 5's hook lands after the window of 4..7 ran (6 and 7 train
  # without hooks, as drained batches do); 1F1B at K=3 had started batches 8 and 9, which
  # finish their updates: 10 on every stage.
  stop = _StopAt(5)
  pipe, _, _ = _train("compiled", 4, callbacks=[stop])
  assert stop.ends == list(range(6))
  assert pipe.runtime.updates == [10, 10, 10]


@pytest.mark.parametrize("method,options,small,most,updates", [
    ("pipedream", {}, False, "CALL_WINDOW", 10),
    ("pipedream", {}, True, None, 10),
    ("spectrain", {"micro_batches": 2}, True, "CALL_WINDOW_MICRO", 9)])
def test_a_window_of_stage_calls_runs_as_calls_of_at_most_call_window_batches(
    method, options, small, most, updates, monkeypatch):
  # Window of 8 on the call path: traced and run 4 mini-batches at a time (CALL_WINDOW; 2 with
  # micro-batches), the hooks of all 8 after the calls; a stop in batch 5's hook drains as a
  # window of 8 does. Small stages with one batch per update (`INLINE_OPS`) call whole
  # windows of 8.
  if not small:
    monkeypatch.setattr(tfpipe.runtime.CompiledRuntime, "INLINE_OPS", 0)
  runs = {}
  x, y = helpers.as_arrays(helpers.batches(24))
  for inline in (False, True):
    stop, model = _StopAt(5), helpers.mlp()
    pipe, compile_ = helpers.pipeline(model, {"executor": "compiled", "steps_per_execution": 8,
                                              "inline": inline}, num_stages=3, method=method,
                                      **options)
    compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[stop])
    sizes = {w.last - w.first + 1 for w in pipe.runtime._plan[1]}   # pylint: disable=protected-access
    runs[inline] = (stop.ends, list(pipe.runtime.updates), model.get_weights(), max(sizes))
  assert runs[False][3] == (getattr(tfpipe.runtime.CompiledRuntime, most) if most else 8)
  assert runs[True][3] == 8
  assert runs[False][0] == runs[True][0] == list(range(6))
  assert runs[False][1] == runs[True][1] == [updates] * 3   # the drain's updates too
  for a, b in zip(runs[False][2], runs[True][2]):
    helpers.assert_close(a, b, rtol=1e-5)


def test_auto_window_gives_batch_hooks_every_batch():
  # With a batch hook the window is one mini-batch: the stop drains exactly L-1 = 2.
  stop = _StopAt(5)
  pipe, _, _ = _train("compiled", "auto", callbacks=[stop])
  assert pipe.runtime.window == 1
  assert stop.ends == list(range(6)) and pipe.runtime.updates == [8, 8, 8]


def test_windowed_evaluate_and_predict_equal_the_threaded_executor():
  x, y = helpers.as_arrays(helpers.batches(7))   # 7 batches in windows of 3: 3 + 3 + 1
  results = {}
  for executor, window in (("compiled", 3), ("threaded", "auto")):
    model = helpers.mlp()
    pipe, compile_ = helpers.pipeline(model, {"executor": executor, "steps_per_execution": window},
                                      num_stages=3, method="pipedream")
    compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy",
             metrics=["accuracy"])
    results[executor] = (pipe.evaluate(x, y, batch_size=16, verbose=0, return_dict=True),
                         pipe.predict(x, batch_size=16, verbose=0))
  (c_logs, c_out), (t_logs, t_out) = results["compiled"], results["threaded"]
  assert c_logs == pytest.approx(t_logs, rel=1e-6)
  helpers.assert_close(c_out, t_out, rtol=1e-6)
  assert c_out.shape == (7 * 16, 3)


def test_bad_executor_settings_are_refused_with_the_value():
  model = helpers.mlp()
  with pytest.raises(ValueError, match="fast"):
    tfpipe.Pipeline(model, num_stages=2, executor="fast")
  pipe = tfpipe.Pipeline(model, num_stages=2)
  assert pipe.executor == "compiled"
  assert tfpipe.Pipeline(model, num_stages=2, record=True).executor == "compiled"
  with pytest.raises(ValueError, match="steps_per_execution=0"):
    pipe.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=0)
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, prediction_error=True)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy",
               steps_per_execution=4)
  with pytest.raises(ValueError, match="steps_per_execution=1"):
    pipe.fit(x, y, batch_size=16, verbose=0)


def test_every_pipeline_method_compiles_for_the_compiled_executor_by_default():
  # Each then trains on it: tests/test_trainer.py::test_every_method_trains_a_few_steps.
  for method in policies.PIPELINE_METHODS:
    pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method=method)
    pipe.compile(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
    assert pipe.executor == "compiled", method
    assert isinstance(pipe.runtime, tfpipe.runtime.CompiledRuntime), method


def _fit_windows(model, inline, num_stages, method="spectrain", n=12):
  """`model` trained one epoch of `n` batches of 16 on the compiled executor, windows of 4
  mini-batches, inlined or not; returns the Pipeline."""
  x, y = helpers.as_arrays(helpers.batches(n))
  pipe, compile_ = helpers.pipeline(model, {"executor": "compiled", "steps_per_execution": 4,
                                            "inline": inline}, num_stages=num_stages,
                                    method=method)
  compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  return pipe


@pytest.mark.parametrize("method", ["spectrain", "gpipe"])
def test_small_stages_inline_windows_of_micro_batches_others_call_the_stage_functions_alike(
    method):
  inlined, model_a, _ = _train("compiled", 4, method, n=12, inline=True)
  runtime = inlined.runtime
  runtime.inline = "auto"
  # 4 x Dense(16), a few hundred ops per window: small. Windows of micro-batches trace their
  # tasks inline; with one batch per update they call the stage functions.
  assert runtime._small(12, 1) and runtime._inlined(12, 2) and not runtime._inlined(12, 1)
  assert runtime._local_cpus
  runtime._local_cpus = False   # a stage on a TF server or a GPU: its task calls cost more
  assert runtime._inlined(12, 1)
  runtime._local_cpus = True
  # An epoch shorter than the window (4) counts its own size; a window holds each
  # mini-batch's M micro-batches.
  runtime.INLINE_OPS = 3 * runtime._forward_ops * 4
  assert runtime._inlined(2, 2) and not runtime._inlined(3, 2)
  assert runtime._inlined(1, 4) and not runtime._inlined(2, 4)
  runtime.INLINE_OPS = 3 * runtime._forward_ops * 3
  assert runtime._small(3, 1) and not runtime._small(4, 1)
  runtime.INLINE_OPS = 1
  assert not runtime._inlined(12, 2)
  model_b = helpers.mlp()
  called = _fit_windows(model_b, False, 3, method)
  assert all(key[1] is False for key in called.runtime._keys)
  for a, b in zip(model_a.get_weights(), model_b.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)


def test_windows_call_stages_on_tf_servers_that_run_a_while_loop():
  # Inlined on TF servers, the residual LSTM's stages moved 3.1 GB a step (spectrain) and held
  # 11-13 GB (1f1b): there, windows and loop windows call stages whose forward loops.
  x = np.random.default_rng(0).standard_normal((16, 5, 3)).astype("float32")
  y = np.arange(16) % 2
  results = {}
  for recurrent in (True, False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 3))
    h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(inputs) if recurrent else (
        keras.layers.Dense(4, name="lstm")(inputs))
    h = keras.layers.Dense(4, name="dense")(keras.layers.Flatten(name="flat")(h))
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(h))
    pipe = tfpipe.Pipeline(model, devices=tfpipe.default_devices()[:2], method="1f1b",
                           micro_batches=2, partition=["flat"])
    pipe.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    pipe.fit(x, y, batch_size=8, epochs=1, verbose=0)
    runtime = pipe.runtime
    local = runtime._inlined_loop(2), runtime._inlined(4, 2)
    runtime.remote = True   # as when the stages run on TF servers
    results[recurrent] = ([p.forward_loops() for p in pipe.programs], local,
                          (runtime._inlined_loop(2), runtime._inlined(4, 2)))
  assert results[True] == ([True, False], (True, True), (False, False))
  assert results[False] == ([False, False], (True, True), (True, True))


@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_a_loop_window_inlines_its_one_mini_batch_by_its_own_size(method, monkeypatch):
  # A schedule that finishes each mini-batch first runs as a loop over one mini-batch's tasks:
  # its graph holds M micro-batches on every stage whatever the window, so it inlines by
  # INLINE_LOOP_OPS even where a window of W mini-batches would be too large (INLINE_OPS).
  monkeypatch.setattr(tfpipe.runtime.CompiledRuntime, "INLINE_OPS", 1)
  looped, model_a, _ = _train("compiled", 4, method, n=12, micro_batches=2)
  runtime = looped.runtime
  assert not runtime._inlined(12, 2)
  # The loop's window is the last numbered (after the plan's windows, numbered as calls).
  assert runtime._inlined_loop(2) and runtime.numbered[-1].inline
  assert not any(n.inline for n in runtime.numbered[:-1])
  runtime.INLINE_LOOP_OPS = 3 * runtime._forward_ops * 2 - 1
  assert not runtime._inlined_loop(2) and runtime._inlined_loop(1)
  # As calls, the same weights.
  monkeypatch.setattr(tfpipe.runtime.CompiledRuntime, "INLINE_LOOP_OPS", 1)
  called, model_b, _ = _train("compiled", 4, method, n=12, micro_batches=2)
  assert not any(n.inline for n in called.runtime.numbered)
  for a, b in zip(model_a.get_weights(), model_b.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)


@pytest.mark.parametrize("method", ["1f1b", "gpipe", "zb", "interleaved", "zbv"])
def test_a_loop_windows_kept_forwards_are_one_trace_called_per_micro_batch_and_train_as_keras(
    method):
  # Inlined, a loop window's M forwards whose backwards read them are calls of one forward
  # traced per signature that outputs its residuals (TensorFlow inlines the calls when the
  # graph runs), their backwards calls of its backward (zero-bubble's input half takes both
  # gradients from them): one trace, not M, and Keras's weights.
  x, y = helpers.as_arrays(helpers.batches(12))
  build = lambda: helpers.sequential_mlp(dtype="float64")
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  model = build()
  pipe, compile_ = helpers.pipeline(model, {"executor": "compiled", "steps_per_execution": 4},
                                    num_stages=2 if method in ("interleaved", "zbv") else 3,
                                    method=method, micro_batches=4)
  compile_(keras.optimizers.SGD(0.05, momentum=0.9), loss())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=2)
  assert all(n.inline for n in pipe.runtime.numbered)   # the loop window, inlined
  kept = [p for p in pipe.programs if p.ops["F"].keeps == "tape"]
  traces = [p.functions.inlined_forward.experimental_get_tracing_count() for p in kept]
  assert kept and traces == [1] * len(kept) and all(p._residual_calls for p in kept)
  expected = helpers.keras_fit_weights(build(), keras.optimizers.SGD(0.05, momentum=0.9),
                                       loss(), x, y, batch_size=16, shuffle=False, verbose=0,
                                       epochs=2)
  helpers.assert_weights_close(model.get_weights(), expected)


def test_inlined_windows_run_under_the_lighter_grappler_without_layout_on_cpus(monkeypatch):
  from tfpipe import compat
  seen, light = [], compat.light_calls
  monkeypatch.setattr(compat, "light_calls", lambda layout: seen.append(layout) or light(layout))
  _fit_windows(helpers.mlp(), True, 2, n=8)
  assert seen and set(seen) == {False}   # every window call; CPU stages: no layout optimizer


def test_the_task_calls_of_a_window_traced_on_its_unoptimised_call_optimise_their_functions(
    grappler):
  del grappler
  from tensorflow.core.protobuf import config_pb2
  pipe = _fit_windows(helpers.mlp(), False, 3)
  # The windows are the branches of one group function (`tfpipe.runtime.groups`): their
  # task calls sit in its branch functions.
  graphs = [concrete.graph.as_graph_def()
            for concrete in pipe.runtime.grouped.function._list_all_concrete_functions()]
  assert graphs
  calls = [node for graph in graphs
           for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]
           if node.op in ("PartitionedCall", "StatefulPartitionedCall")]
  assert len(calls) > 10
  for node in calls:   # every task call optimises its function
    config = config_pb2.ConfigProto.FromString(node.attr["config_proto"].s)
    assert not config.graph_options.rewrite_options.disable_meta_optimizer, node.name



def _grouped_and_not(method, samples, monkeypatch, K=3):
  """Trains `method` with windows of 3 stage calls, run as one group function and (patched
  off) a function per window; returns (runtime, weights) of each."""
  x, y = helpers.as_arrays(helpers.batches(samples // 16 + 1))
  x, y = x[:samples], y[:samples]
  runs = []
  for grouped in (True, False):
    if not grouped:
      monkeypatch.setattr(grouped_lib.GroupedWindows, "group_of", lambda *_: None)
    model = helpers.mlp()
    pipe, compile_ = helpers.pipeline(model, helpers.RUNTIMES[1], num_stages=K, method=method)
    compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
    pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=2)
    runs.append((pipe.runtime, model.get_weights()))
  return runs


@pytest.mark.parametrize("method", ["vanilla", "spectrain", "timeprest", "2bw"])
def test_a_plans_windows_run_as_branches_of_one_function_as_they_run_apart(method, monkeypatch):
  (grouped, ours), (_, apart) = _grouped_and_not(method, 16 * 14, monkeypatch)
  # One group: its function traces once for every window of both epochs.
  assert list(grouped.grouped.groups.values()) != [] and None not in grouped.grouped.groups.values()
  assert grouped.traces == 1
  helpers.assert_weights_close(ours, apart)


def test_a_smaller_last_batch_leaves_the_group_for_the_rest_of_its_epoch(monkeypatch):
  (grouped, ours), (_, apart) = _grouped_and_not("spectrain", 16 * 13 + 5, monkeypatch)
  # The group's function; then the window whose stage 0 forwards the batch of 5 (batch 13,
  # in the window finishing 9..11) and the last one, each traced on its own.
  assert None not in grouped.grouped.groups.values() and grouped.traces == 3
  helpers.assert_weights_close(ours, apart)


@pytest.mark.parametrize("method", ["spectrain", "pipedream"])
def test_kept_forwards_cross_windows_of_calls_with_their_residuals_not_recomputed(method):
  """A forward whose backward reads its tape, called from a window of stage calls, outputs
  what its gradient reads (`compat.ResidualCall`): its backward, in that window or a later
  one, runs no recompute (the stages' recomputing backward is never traced) and gives the
  weights of the inlined windows, which recompute the forwards crossing a window (dropout
  draws included: a recompute replays them, residuals hold them). A kept forward crosses as
  its inputs, its state and one tensor packing its weights with its residuals."""
  from tfpipe.runtime import grouped, groups
  carried, carry_values = [], grouped.Group.carry_values

  def recorded(group):
    if group.carry is not None:
      carried.extend((len(groups.flat(kept.weights)), len(kept.weights),
                      len(tf.nest.flatten(kept.residuals)))
                     for kept, _ in group.carry["saved"].values())
    return carry_values(group)
  weights = {}
  for inline in (False, True):
    model = helpers.dropout_mlp()
    x, y = helpers.as_arrays(helpers.batches(12))
    pipe, compile_ = helpers.pipeline(
        model, {"executor": "compiled", "steps_per_execution": 3, "inline": inline},
        num_stages=3, method=method, partition=helpers.DROPOUT_CUTS[3])
    compile_(optimizers.SpecTrain(0.05, 0.9), "sparse_categorical_crossentropy")
    with mock.patch.object(grouped.Group, "carry_values", recorded):
      pipe.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    weights[inline] = model.get_weights()
    if not inline:   # windows of 3 mini-batches: forwards of 3 stages cross every boundary
      # Each kept forward's weights cross packed with its residuals in one tensor, not one
      # tensor per weight.
      assert carried and all(w == 0 and n > 0 and r == 1 for w, n, r in carried), carried
      kept = [p for p in pipe.programs if p.ops["F"].keeps == "tape"]
      assert kept and all(p._residual_calls for p in kept)
      assert sum(p.functions.traced["backward_on"].experimental_get_tracing_count()
                 for p in pipe.programs) == 0
  for a, b in zip(weights[False], weights[True]):
    helpers.assert_close(a, b, rtol=1e-5)
