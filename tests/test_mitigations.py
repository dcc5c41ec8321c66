"""Staleness mitigations: each equals its rule (tfpipe.rules.reference) on both executors; errors."""

import keras
import numpy as np
import pytest

from tests import helpers
import tfpipe
from tfpipe.plan import schedules, versions
from tfpipe.rules import mitigations, optimizers

LR, MOMENTUM = 0.05, 0.9


def _optimizer(name):
  return {"spectrain": lambda: optimizers.SpecTrain(LR, MOMENTUM),
          "sgd": lambda: keras.optimizers.SGD(LR, momentum=MOMENTUM),
          "adam": lambda: keras.optimizers.Adam(0.01),
          "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05)}[name]()


CASES = [
    ("pipemare", {}, "spectrain"),
    ("pipemare", {"lr_rescheduling": 6, "discrepancy_decay": 0.5}, "sgd"),
    ("pipemare", {"micro_batches": 2, "spike_compensation": True}, "spectrain"),
    ("i_timeprest", {"micro_batches": 2}, "spectrain"),
    ("i_timeprest", {"micro_batches": 4}, "sgd"),
    ("vanilla", {"spike_compensation": True}, "spectrain"),
    ("pipedream", {"spike_compensation": True}, "sgd"),
    ("spectrain", {"spike_compensation": True}, "spectrain"),
    ("pipedream", {"delay_momentum": True}, "spectrain"),
    ("spectrain", {"delay_momentum": True, "spike_compensation": True}, "sgd"),
    ("vanilla", {"lr_rescheduling": 8}, "spectrain"),
    ("spectrain", {}, "sgd"),
    ("spectrain", {"version_difference": "exact"}, "adam"),
    ("spectrain", {"spectrain_backward": "repredict"}, "adamw"),
    ("spectrain", {"micro_batches": 2, "version_difference": "exact"}, "adam"),
]


def _run_both(method, options, optimizer, runtime, K=3, n=10):
  # In float64: these random-label nets amplify round-off chaotically once a rule changes the
  # order of float operations (float32 differences of 1e-8 grew to 1e-1 in 16 steps, measured),
  # while in float64 every rule here agrees with its reference to 1e-12.
  bs = [(x.astype("float64"), y) for x, y in helpers.batches(n)]
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(helpers.sequential_mlp(dtype="float64"), runtime, num_stages=K,
                                    method=method, record=runtime["executor"] == "threaded",
                                    **options)
  loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  expected, log = helpers.reference_train(pipe.stage_models, loss, bs, method, LR, MOMENTUM,
                                          optimizer=_optimizer(optimizer), **options)
  compile_(_optimizer(optimizer), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  return pipe, expected, log


# Every case on the threaded executor; on the compiled one, a case per code path the rules take
# there (corrected and blended backward weights, the rule in the accumulated update, each
# optimizer's prediction), to keep the suite's time.
COMPILED_CASES = (1, 2, 3, 9, 12, 13)
# A case's runs on the two executors run on one pytest-xdist worker, where one reference rule
# serves both (`helpers.on_one_worker`).
RUN_CASES = [pytest.param(runtime, *CASES[i], id=f"{runtime_id}-{CASES[i][0]}-{i}-{CASES[i][2]}",
                          marks=pytest.mark.xdist_group(f"mitigation-rule-{i}"))
             for i in range(len(CASES))
             for runtime, runtime_id in zip(helpers.RUNTIMES, helpers.RUNTIME_IDS)
             if runtime["executor"] == "threaded" or i in COMPILED_CASES]


@pytest.mark.parametrize("runtime,method,options,optimizer", RUN_CASES)
def test_mitigation_equals_its_rule(method, options, optimizer, runtime):
  pipe, expected, log = _run_both(method, options, optimizer, runtime)
  for program, ref in zip(pipe.programs, expected):
    helpers.assert_weights_close([v.numpy() for v in program.trainable], ref, rtol=1e-7,
                                 atol=1e-9)
  if runtime["executor"] == "threaded":
    seen = {}
    for r in pipe.records:
      for kind in {"FB": ("F", "B"), "F": ("F",), "B": ("B",)}.get(r.kind, ()):
        seen[(r.stage, kind, r.batch, r.micro)] = r.version
    assert seen == {(k, kind, b, i): v for k, kind, b, i, v in log}


@pytest.mark.parametrize("method,options,base", [
    ("pipemare", {}, "vanilla"),
    ("i_timeprest", {"micro_batches": 2}, "timeprest"),
    ("vanilla", {"spike_compensation": True}, "vanilla"),
    ("pipedream", {"delay_momentum": True}, "pipedream"),
    ("vanilla", {"lr_rescheduling": 8}, "vanilla"),
])
def test_each_mitigation_changes_the_weights(method, options, base):
  # The rules above are not the unmitigated rule in disguise: the equivalences bite.
  bs = helpers.batches(12)
  model = helpers.mlp()
  stages = tfpipe.Pipeline(model, num_stages=3, method=method, **options).stage_models
  loss = keras.losses.SparseCategoricalCrossentropy()
  base_options = {"micro_batches": options["micro_batches"]} if "micro_batches" in options else {}
  got = helpers.reference_train(stages, loss, bs, method, LR, MOMENTUM, **options)[0]
  plain = helpers.reference_train(stages, loss, bs, base, LR, MOMENTUM, **base_options)[0]
  assert not np.allclose(got[0][0], plain[0][0], rtol=1e-6)


def test_stage_delays_of_1f1b_are_k_to_the_end():
  assert mitigations.delays_for("1f1b", 4) == [3, 2, 1, 0]
  assert mitigations.delays_for("sequential", 3) == [0, 0, 0]


def test_updates_since_forward_count_the_stage_updates_between():
  schedule = schedules.build("1f1b", 3, 6)
  counts = versions.updates_since_forward(schedule)
  # Stage k's backward of batch b comes min(b, K-1-k) updates after its forward (warm-up, then
  # the steady state); every other task reads no such count.
  for k, tasks in enumerate(schedule):
    for task in tasks:
      expected = min(task.batch, 2 - k) if task.kind == "B" else 0
      assert counts[k][task] == expected, (k, task)


def test_rule_helpers():
  assert mitigations.delay_momentum(0.9, 3) == pytest.approx(0.15)
  assert mitigations.delay_momentum(0.5, 3) == 0.0
  assert mitigations.lr_factor(4, 0, 100) == pytest.approx(0.25)
  assert mitigations.lr_factor(4, 100, 100) == 1.0
  a, b = mitigations.spike_coefficients(0.9, 2)
  assert a == pytest.approx(0.81) and b == pytest.approx(1.9)   # 1 + 0.9: the missed share
  assert mitigations.blend_factor(0) == 1.0


@pytest.mark.parametrize("options,optimizer,message", [
    ({"method": "vanilla", "spike_compensation": True}, keras.optimizers.Adam(0.01),
     "momentum SGD update"),
    ({"method": "vanilla", "delay_momentum": True},
     keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=1.0), "without clipnorm"),
    ({"method": "gpipe", "spike_compensation": True}, optimizers.SpecTrain(0.1),
     "delays none"),
    ({"method": "spectrain"}, keras.optimizers.SGD(0.1), "momentum > 0"),
    ({"method": "spectrain"}, keras.optimizers.RMSprop(0.1), "Received: RMSprop"),
])
def test_unsupported_combinations_are_refused_at_compile(options, optimizer, message):
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, **options)
  with pytest.raises(ValueError, match=message):
    pipe.compile(optimizer, keras.losses.SparseCategoricalCrossentropy())


@pytest.mark.parametrize("options,message", [
    ({"method": "vanilla", "discrepancy_decay": 0.5}, "method='pipemare'"),
    ({"method": "pipemare", "discrepancy_decay": 1.0}, r"\[0, 1\)"),
    ({"method": "vanilla", "lr_rescheduling": -1}, "lr_rescheduling=-1"),
    ({"method": "vanilla", "spike_compensation": "yes"}, "spike_compensation='yes'"),
])
def test_bad_options_are_refused(options, message):
  with pytest.raises(ValueError, match=message):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, **options)
