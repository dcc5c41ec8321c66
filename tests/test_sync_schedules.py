"""The synchronous schedules production pipelines use: 1F1B with a flush and zero-bubble
(ZB-H1). Verified for every K <= 16 and M <= 64 on links of one item; each equals plain Keras
at the mini-batch size on both executors, and its reference rule."""

import functools
import re

import keras
import numpy as np
import pytest

from tests import helpers
from tests.conftest import DEVICES
from tests.test_pipeline import _assert_equals_keras, _dropout_pipe, _stage_weights, LR, MOMENTUM
from tfpipe.plan import schedules, simulator, verify
from tfpipe.rules import optimizers
import tfpipe

SYNC = {"1f1b": "1f1b_flush", "zb": "zb_h1"}


@pytest.mark.parametrize("name", sorted(SYNC.values()))
def test_every_schedule_verifies_up_to_16_stages_and_64_micro_batches(name):
  for K in range(1, 17):
    for M in (1, 2, 3, 4, 7, 8, 16, 31, 64):
      report = verify.verify(schedules.build(name, K, 2, M), capacity=1)
      assert report.staleness == [0] * K   # no update inside a mini-batch
      if name == "1f1b_flush":   # stage k keeps at most min(K-k, M) micro-batches
        assert report.peak_states[:K - 1] == [min(K - k, M) for k in range(K - 1)]
      else:   # ZB-H1's W tasks trail by k: more kept, but at most K (1F1B's stage-0 peak)
        for k in range(K):
          assert min(K - k, M) <= report.peak_states[k] <= min(K, M)


def _clock_rows(function):
  """The stage rows of the clock table in `function`'s docstring: task names in order."""
  rows = re.findall(r"stage \d: (.*)", function.__doc__)
  return [re.findall(r"[FBWU]\d+(?:\.\d+)?", row) for row in rows]


@pytest.mark.parametrize("function", [schedules.one_f_one_b_flush, schedules.zero_bubble_h1])
def test_the_clock_table_in_the_docstring_is_the_schedule(function):
  built = [[str(t) for t in tasks] for tasks in function(3, 1, 4)]
  assert _clock_rows(function) == built


def test_zero_bubble_splits_every_backward_and_trails_by_the_stage_index():
  schedule = schedules.zero_bubble_h1(4, 2, 8)
  for k, tasks in enumerate(schedule):
    halves = [t for t in tasks if t.kind == "W"]
    assert len(halves) == 16
    for w in halves:   # each W after its own B; k later backwards come between (fewer at the end)
      after = tasks.index(schedules.Task("B", w.batch, w.micro))
      between = [t for t in tasks[after + 1:tasks.index(w)] if t.kind == "B"]
      assert len(between) == min(k, 7 - w.micro)


@pytest.mark.parametrize("K,M", [(2, 8), (4, 4), (4, 8), (8, 16)])
def test_simulated_bubbles_equal_the_closed_forms(K, M):
  """Unit F, B and W (a backward is 2 forwards, half of it the input gradient): 1F1B and GPipe
  idle (K-1)/(M+K-1) of the time, ZB-H1 (K-1)/(3M+K-1) (a third when M >> K)."""
  costs = simulator.Costs([1.0] * K, [2.0] * K)
  bubble = lambda method: simulator.simulate_method(method, costs, 3, micro_batches=M).bubble
  assert bubble("gpipe") == pytest.approx((K - 1) / (M + K - 1))
  assert bubble("1f1b") == pytest.approx((K - 1) / (M + K - 1))
  assert bubble("zb") == pytest.approx((K - 1) / (3 * M + K - 1))


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,build,recompute", helpers.on_one_worker("keras-fit", [
    ("1f1b", helpers.sequential_mlp, False), ("1f1b", helpers.skip_model, True),
    ("zb", helpers.sequential_mlp, True), ("zb", helpers.skip_model, False)],
    key=lambda case: case[1].__name__))
def test_synchronous_schedules_equal_keras_at_the_mini_batch_size(method, build, recompute,
                                                                  runtime):
  # In float64, as gpipe's case says: micro-batch sums round differently from one mean.
  pipe = _assert_equals_keras(functools.partial(build, dtype="float64"), 3, method,
                              loss_dtype="float64", micro_batches=4, recompute=recompute,
                              runtime=runtime)
  assert pipe.policy.schedule == SYNC[method] and pipe.policy.recompute == recompute


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method", helpers.on_one_worker("sync-dropout-rule",
                                                          sorted(SYNC) + ["interleaved", "zbv"]))
def test_synchronous_schedules_with_dropout_recompute_equal_their_reference_rule(method, runtime):
  bs = helpers.batches(8)
  x, y = helpers.as_arrays(bs)
  options = {"micro_batches": 2, "recompute": True}
  if method in ("interleaved", "zbv"):   # 4 stages on 2 devices, the first three drawing masks
    pipe, compile_ = helpers.pipeline(helpers.dropout_mlp(dtype="float64"), runtime,
                                      num_stages=2, method=method, partition=[0, 2, 4, 6, 7],
                                      **options)
  else:
    pipe, compile_ = _dropout_pipe(method, options, dtype="float64", runtime=runtime)
  loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  expected, _ = helpers.reference_train(pipe.stage_models, loss, bs, method,
                                        float(np.float32(LR)), MOMENTUM, **options)
  compile_(optimizers.SpecTrain(LR, MOMENTUM), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, rtol=1e-12, atol=1e-14)


def test_interleaved_verifies_for_every_device_count_chunk_count_and_micro_batches():
  for K in (1, 2, 3, 4, 8, 16):
    for V in (1, 2, 3, 4):
      for M in sorted({K, 2 * K, 3 * K, 64 - 64 % K}):
        schedule = schedules.interleaved(K * V, 2, M, V)
        report = verify.verify(schedule, capacity=1)
        assert report.staleness == [0] * (K * V)
        assert [k % K for lane in schedule.lanes for k, _ in lane[:1]] == list(range(K))


def test_interleaved_lanes_are_the_clock_table_and_the_stages_their_projection():
  schedule = schedules.interleaved(4, 1, 2, 2)
  rows = re.findall(r"device \d: (.*)", schedules.interleaved.__doc__)
  assert [row.split() for row in rows] == [[f"{k}.{t}" for k, t in lane]
                                           for lane in schedule.lanes]
  for k, tasks in enumerate(schedule):
    assert tasks == [t for lane in schedule.lanes for s, t in lane if s == k]


def test_interleaved_needs_micro_batches_in_groups_of_the_devices():
  with pytest.raises(ValueError, match="multiple of the 2 devices. Received: micro_batches=3"):
    schedules.interleaved(4, 1, 3, 2)
  with pytest.raises(ValueError, match="virtual stages work with interleaved"):
    tfpipe.Pipeline(helpers.sequential_mlp(), num_stages=2, method="1f1b", virtual_stages=2)


@pytest.mark.parametrize("K,V,M", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)])
def test_simulated_interleaved_bubble_equals_the_closed_form(K, V, M):
  """Each of the K x V chunks takes 1/V of a stage's time: idle (K-1)/(VM+K-1), V times less
  than 1F1B's (K-1)/(M+K-1) for M >> K."""
  costs = simulator.Costs([1.0 / V] * (K * V), [2.0 / V] * (K * V))
  timeline = simulator.simulate(schedules.interleaved(K * V, 3, M, V), costs)
  assert timeline.bubble == pytest.approx((K - 1) / (V * M + K - 1))


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("build", helpers.on_one_worker("keras-fit", [helpers.sequential_mlp, helpers.skip_model],
                                            key=lambda build: build.__name__))
def test_interleaved_equals_keras_at_the_mini_batch_size(build, runtime):
  # 2 devices x 2 chunks: stages 0 and 2 share a device, 1 and 3 the other.
  pipe = _assert_equals_keras(functools.partial(build, dtype="float64"), 2, "interleaved",
                              loss_dtype="float64", micro_batches=4, runtime=runtime,
                              virtual_stages=2)
  assert pipe.num_stages == 4 and pipe.devices == [DEVICES[0], DEVICES[1]] * 2


@pytest.mark.parametrize("method,options", [
    ("zb", {}), ("interleaved", {"virtual_stages": 2, "data_parallel": 2})],
    ids=["zb", "interleaved-R2"])
def test_synchronous_schedules_train_a_keras_hub_backbone_as_keras(method, options):
  """KerasHub's Llama backbone (from config, random weights) with a pooled head: weights,
  history, evaluation and predictions as Keras's own fit. Momentum SGD: its step on the
  embedding is the same for Keras's sparse gradient and the micro-batches' summed dense one
  (Adam's is not: README, the Keras contract)."""
  from tests import conformance_cases as cc
  from tests.test_conformance import _fit_args, _llama, _run_keras, _token_data, assert_same
  names = [t.name for t in _llama().inputs]
  case = cc.Case("hub", "hub", model=_llama, data=lambda: _token_data(names),
                 compile=cc.compiled(optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
                 fit=lambda x, y: {"batch_size": 8})
  x, y = case.data()
  model = case.model()
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=2, **options)
  pipe.compile(**case.compile())
  history = pipe.fit(x, y, **_fit_args(case, x, y))
  logs = pipe.evaluate(x, y, verbose=0, return_dict=True)
  assert_same(_run_keras(case), (model.get_weights(), history.history, logs,
                                 pipe.predict(x, verbose=0)), 5e-5)


def test_zero_bubble_v_verifies_keeps_1f1b_memory_and_idles_near_zero():
  for K in (1, 2, 3, 4, 8, 16):
    for M in (1, 2, 3, 8, 64):
      schedule = schedules.zero_bubble_v(2 * K, 2, M)
      report = verify.verify(schedule, capacity=1)
      assert report.staleness == [0] * (2 * K)
      for d, lane in enumerate(schedule.lanes):   # device d holds stages d and 2K-1-d
        assert {k for k, _ in lane} == {d, 2 * K - 1 - d}
        kept = [0]   # forwards run whose W has not: at most 2K chunks, 1F1B's K micro-batches
        for _, task in lane:
          kept.append(kept[-1] + {"F": 1, "W": -1}.get(task.kind, 0))
        assert max(kept) <= 2 * K
  for K, M in ((2, 4), (4, 8), (4, 16), (8, 16)):
    zbv = simulator.simulate(schedules.zero_bubble_v(2 * K, 3, M),
                             simulator.Costs([0.5] * (2 * K), [1.0] * (2 * K))).bubble
    assert zbv < (K - 1) / (3 * M + K - 1) / 3   # under a third of ZB-H1's with equal F, B, W


def test_zero_bubble_v_lanes_are_the_clock_table():
  rows = re.findall(r"device \d: (.*)", schedules.zero_bubble_v.__doc__)
  assert [row.split() for row in rows] == [[f"{k}.{t}" for k, t in lane]
                                           for lane in schedules.zero_bubble_v(4, 1, 2).lanes]


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("build", helpers.on_one_worker("keras-fit", [helpers.sequential_mlp, helpers.skip_model],
                                            key=lambda build: build.__name__))
def test_zero_bubble_v_equals_keras_at_the_mini_batch_size(build, runtime):
  # 2 devices in a V: stages 0 and 3 on the first, 1 and 2 on the second.
  pipe = _assert_equals_keras(functools.partial(build, dtype="float64"), 2, "zbv",
                              loss_dtype="float64", micro_batches=4, runtime=runtime)
  assert pipe.devices == [DEVICES[0], DEVICES[1], DEVICES[1], DEVICES[0]]
