"""Tracing: a TensorBoard profile and a Chrome trace of chosen steps, matching the schedule."""

import glob
import json
import os
import warnings

import keras
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.instruments import trace
from tfpipe.plan import schedules
from tfpipe.rules import optimizers
from tests import helpers


def _traced_fit(tmp_path, method="pipedream", steps="3,5", n=4, epochs=2, **options):
  x, y = helpers.as_arrays(helpers.batches(n))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=3, method=method, trace_steps=steps,
                         trace_dir=str(tmp_path), **options)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0, epochs=epochs)
  return pipe


def _expected(schedule, k, epoch, batches):
  """Stage k's tasks for `batches` of one epoch as the runtime logs them (the last stage's
  forward runs inside its FB step)."""
  K, out = len(schedule), []
  for t in schedule[k]:
    if t.batch in batches and not (k == K - 1 and t.kind == "F"):
      kind = "FB" if k == K - 1 and t.kind == "B" else t.kind
      out.append((epoch, f"{kind}{t.batch}" + ("" if t.micro is None else f".{t.micro}")))
  return out


@pytest.mark.parametrize("method,options", [("pipedream", {}), ("gpipe", {"micro_batches": 2}),
                                            ("ddg", {"lockstep": True})])
def test_traced_run_writes_a_profile_and_a_trace_matching_the_schedule(tmp_path, method, options):
  # Steps 3..5 of 2 epochs of 4 batches: batch 3 of epoch 0, batches 0 and 1 of epoch 1.
  _traced_fit(tmp_path, method, executor="threaded", **options)
  assert glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))
  with open(os.path.join(tmp_path, trace.TRACE_FILE)) as f:
    events = json.load(f)["traceEvents"]
  tasks = [e for e in events if e["ph"] == "X"]
  assert {e["args"]["step"] for e in tasks} == {3, 4, 5}
  policy = tfpipe.plan.policies.policy_for(method, lockstep=options.get("lockstep", False))
  schedule = schedules.build(policy.schedule, 3, 4, options.get("micro_batches", 1))
  tids = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
  for k in range(3):
    track = next(t for name, t in tids.items() if name.startswith(f"stage {k} "))
    got = [(e["args"]["epoch"], e["name"]) for e in sorted(tasks, key=lambda e: e["ts"])
           if e["tid"] == track]
    assert got == _expected(schedule, k, 0, {3}) + _expected(schedule, k, 1, {0, 1}), k
  # Every forward crossing a cut and every gradient coming back is one transfer event.
  M = options.get("micro_batches", 1)
  for name in ("link 0 -> 1", "link 1 -> 2", "link 1 -> 0", "link 2 -> 1"):
    assert sum(e["tid"] == tids[name] for e in tasks) == 3 * M, name


def test_compiled_trace_holds_the_traced_steps_tasks_from_the_profile(tmp_path):
  # The compiled executor profiles the epochs holding steps 3..5 (both) into trace_dir; its
  # records hold each task once or more (one per run of its ops), in graph order.
  _traced_fit(tmp_path, "pipedream", executor="compiled")
  assert len(glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb"))) == 2
  with open(os.path.join(tmp_path, trace.TRACE_FILE)) as f:
    events = json.load(f)["traceEvents"]
  tasks = [e for e in events if e["ph"] == "X"]
  assert {e["args"]["step"] for e in tasks} == {3, 4, 5}
  schedule = schedules.build("1f1b", 3, 4)
  tids = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
  for k in range(3):
    track = next(t for name, t in tids.items() if name.startswith(f"stage {k} "))
    got = {(e["args"]["epoch"], e["name"]) for e in tasks if e["tid"] == track}
    assert got == set(_expected(schedule, k, 0, {3}) + _expected(schedule, k, 1, {0, 1})), k


def test_a_profiler_that_fails_warns_and_training_goes_on(tmp_path):
  tf.profiler.experimental.start(str(tmp_path / "other"))  # a profile already running
  try:
    with pytest.warns(RuntimeWarning, match="profiler did not start"):
      pipe = _traced_fit(tmp_path, steps="0,2", epochs=1)
  finally:
    tf.profiler.experimental.stop()
  assert len(pipe.model.history.history["loss"]) == 1
  assert os.path.exists(os.path.join(tmp_path, trace.TRACE_FILE))


def test_tracing_off_records_nothing_and_bad_steps_are_refused(tmp_path):
  x, y = helpers.as_arrays(helpers.batches(2))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="vanilla")
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pipe.fit(x, y, batch_size=16, verbose=0)
  assert pipe.records == [] and not os.listdir(tmp_path)
  with pytest.raises(RuntimeError, match="record=True"):
    pipe.breakdown()
  with pytest.raises(ValueError, match="needs a `trace_dir`"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, trace_steps="1,2")
  with pytest.raises(ValueError, match=r"need 0 <= FIRST <= LAST. Received: '5,2'"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, trace_steps="5,2", trace_dir=str(tmp_path))
  with pytest.raises(ValueError, match="two integers FIRST,LAST. Received: 'a'"):
    trace.parse_steps("a")


def test_breakdown_of_a_real_run_sums_to_one(tmp_path):
  pipe = _traced_fit(tmp_path, steps="0,7", epochs=2)
  for result in (pipe.breakdown(), pipe.breakdown("2,5")):
    assert len(result.shares) == 3
    for shares in result.shares:
      assert sum(shares.values()) == pytest.approx(1.0)
      assert shares["compute"] > 0
