"""A stage's memory predicted before training: traced activations, unknown axes, the summary,
and `memory_budget` (the plan's counts against a run's: `tests/test_memory.py`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe.stage import partition as partition_lib
from tfpipe.training import footprint, memory_budget
from tests import helpers


def _relu_stack():
  keras.utils.set_random_seed(0)
  x = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu", name="a")(x)
  h = keras.layers.Reshape((4, 4), name="view")(h)
  h = keras.layers.Flatten(name="flat")(h)
  h = keras.layers.Dense(16, activation="relu", name="b")(h)
  return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def test_a_forward_keeps_what_its_backward_reads_each_buffer_once():
  # Per sample: a's ReLU output (which b's and a's gradients read: the reshape and flatten
  # are views of it) and b's ReLU output (read by its gradient and the head's); the input is
  # counted apart, the weights not at all.
  inputs, kept = footprint.kept_per_unit(_relu_stack(), [tf.TensorSpec((5, 8), tf.float32)])
  assert inputs == 5 * 8 * 4
  assert kept == 5 * (16 + 16) * 4


def test_an_embeddings_table_gets_rows_so_only_dense_weights_count_toward_temporaries():
  tokens = keras.Input((6,), dtype="int32")
  h = keras.layers.Embedding(50, 4, name="table")(tokens)
  model = keras.Model(tokens, keras.layers.Dense(3, name="head")(h))
  specs = [tf.TensorSpec((2, 6), tf.int32)]
  assert footprint.sparse_bytes(model, specs) == 50 * 4 * 4
  nodes = partition_lib.graph_nodes(model)[2]
  kept = [footprint.node_traced(node, [tf.TensorSpec((2, 6), tf.int32)] if i == 0 else
                                [tf.TensorSpec((2, 6, 4), tf.float32)])
          for i, node in enumerate(nodes)]
  assert [sparse for _, sparse in kept] == [50 * 4 * 4, 0]
  pipe = tfpipe.Pipeline(model, num_stages=2, method="1f1b", micro_batches=2,
                         partition=["head"])
  pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  rows = pipe.memory(4)
  head = (4 * 3 + 3) * 4   # the dense head's weight bytes
  assert [row["temporaries"] for row in rows] == [0, int(footprint.TEMPORARIES * head)]
  assert [row["runtime"] for row in rows] == [footprint.RUNTIME] * 2   # a device each


@pytest.mark.parametrize("method, micro_batches, clipped, as_rows", [
    ("1f1b", 2, False, True),        # a synchronous schedule keeps the micro-batches' rows
    ("pipedream", 1, False, True),   # applied at once: the optimizer takes the rows
    ("pipedream", 2, False, False),  # accumulated dense: the asynchronous rules' sum
    ("1f1b", 2, True, False),        # global-norm clipping makes it dense
])
def test_an_embeddings_table_counts_as_dense_where_its_gradient_reaches_the_optimizer_dense(
    method, micro_batches, clipped, as_rows):
  keras.utils.set_random_seed(0)
  tokens = keras.Input((6,), dtype="int32")
  h = keras.layers.Embedding(50, 4, name="table")(tokens)
  h = keras.layers.Flatten(name="flat")(h)
  model = keras.Model(tokens, keras.layers.Dense(3, name="head")(h))
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=micro_batches,
                         partition=["flat"])
  optimizer = (keras.optimizers.SGD(0.1, global_clipnorm=1.0) if clipped
               else keras.optimizers.SGD(0.1))
  pipe.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  accumulating = footprint.counts(pipe)[2]
  assert accumulating == (micro_batches > 1)
  assert footprint.rows_reach_optimizer(pipe, accumulating) == as_rows
  table = 50 * 4 * 4
  assert pipe.memory(4)[0]["temporaries"] == (0 if as_rows else int(footprint.TEMPORARIES * table))
  # As the stage runs it: the micro-batches' rows kept, or added to the dense accumulator.
  x = np.random.default_rng(0).integers(0, 50, (8, 6)).astype("int32")
  pipe.fit(x, np.arange(8) % 3, batch_size=4, epochs=1, verbose=0, shuffle=False)
  if accumulating:
    assert bool(pipe.programs[0].updates.seen_rows) == as_rows


def test_unknown_dimensions_come_from_the_given_shapes_or_are_refused_by_name():
  tokens = keras.Input((None,), dtype="int32", name="tokens")
  model = keras.Model(tokens, keras.layers.Embedding(50, 4)(tokens), name="lm")
  assert footprint.unit_shapes(model, 2, [(8, 12)])[0].shape == (2, 12)
  with pytest.raises(ValueError, match=r"input 0 of 'lm' has unknown dimensions"):
    footprint.unit_shapes(model, 2)
  images = keras.Input((None, None, 3), name="images")
  convolved = keras.Model(images, keras.layers.Conv2D(4, 3)(images), name="cnn")
  # The first stage's inputs are the model's: each axis from its own shape.
  assert footprint.unit_shapes(convolved, 2, [(8, 32, 24, 3)], first=True)[0].shape == (
      2, 32, 24, 3)
  with pytest.raises(ValueError, match=r"input 0 of 'cnn' has unknown dimensions"):
    footprint.unit_shapes(convolved, 2, [(8, 32, 24, 3)])   # a later stage: no one length


def test_predicting_needs_a_compiled_pipeline():
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2)
  with pytest.raises(RuntimeError, match="compile the pipeline first"):
    footprint.predict(pipe, 16)


def test_the_summary_shows_each_stages_predicted_peak_once_compiled_with_a_batch_size():
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="1f1b", micro_batches=2)
  printed = []
  pipe.summary(print_fn=printed.append)
  assert not any("Predicted peak memory" in line for line in printed)
  pipe.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy())
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe.fit(x, y, batch_size=16, verbose=0)
  printed = []
  pipe.summary(print_fn=printed.append)
  totals = [row["total"] for row in pipe.memory()]
  assert printed[-1] == ("Predicted peak memory per stage (batch 16): " + ", ".join(
      f"{k}: {memory_budget.size(t)}" for k, t in enumerate(totals))).join([" ", ""])
  assert pipe.memory(32)[0]["activations"] == 2 * pipe.memory()[0]["activations"]
  with pytest.raises(ValueError, match="batch_size"):
    pipe.memory(0)


def _wide_then_narrow(seed=0):
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,))
  h = x
  for i in range(3):
    h = keras.layers.Dense(128, activation="relu", name=f"wide{i}")(h)
  for i in range(4):
    h = keras.layers.Dense(8, activation="relu", name=f"narrow{i}")(h)
  return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def test_a_budget_moves_uniform_cuts_to_the_fastest_that_fit_and_trains_as_keras():
  x, y = helpers.as_arrays(helpers.batches(4))
  free = tfpipe.Pipeline(_wide_then_narrow(), num_stages=2, method="gpipe", micro_batches=2)
  free.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  peaks = [row["total"] for row in free.memory(16)]
  assert free.partition.cuts == [0, 4, 8]
  assert peaks[0] - footprint.RUNTIME > 2 * (peaks[1] - footprint.RUNTIME)
  budget = footprint.RUNTIME + int(0.8 * (peaks[0] - footprint.RUNTIME))
  pipe = tfpipe.Pipeline(_wide_then_narrow(), num_stages=2, method="gpipe", micro_batches=2,
                         memory_budget=budget)
  pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  history = pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  assert pipe.partition.cuts[1] < 3   # the wide layers split across the stages
  assert all(row["total"] <= budget for row in pipe.memory())
  keras_model = _wide_then_narrow()
  keras_model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  expected = keras_model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  helpers.assert_close(history.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("partition, budget, words", [
    ("uniform", 1000, r"memory_budget=1000 B: stage 0 is predicted to peak at .* with the "
                      r"cuts \[0, 4, 8\] .* and no cuts of its 8 layers into 2 stages fit"),
    ([0, 2, 8], "0.2m", r"memory_budget=204.8 KiB: stage 0 .*; these cuts are yours, so "
                        r"they stay"),
])
def test_a_budget_no_cuts_meet_is_refused_in_one_line(partition, budget, words):
  x, y = helpers.as_arrays(helpers.batches(2))
  pipe = tfpipe.Pipeline(_wide_then_narrow(), num_stages=2, method="gpipe", micro_batches=2,
                         partition=partition, memory_budget=budget)
  pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  with pytest.raises(ValueError, match=words) as error:
    pipe.fit(x, y, batch_size=16, verbose=0)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("budget", [0, -3, "lots", True, 1.5])
def test_a_budget_that_is_not_bytes_is_refused_by_value(budget):
  with pytest.raises(ValueError, match=r"`memory_budget` must be a number of bytes > 0"):
    tfpipe.Pipeline(helpers.mlp(), num_stages=2, memory_budget=budget)


def test_a_budget_only_recomputation_meets_is_named_in_the_refusal():
  # Six Dense(64) layers at batch 1024: kept activations dominate. The best cuts peak at
  # 1.64 MiB keeping the forwards' tensors, at 1.30 MiB recomputing them, beside the runtime.
  keras.utils.set_random_seed(0)
  x = keras.Input((64,))
  h = x
  for i in range(6):
    h = keras.layers.Dense(64, activation="relu", name=f"d{i}")(h)
  model = keras.Model(x, keras.layers.Dense(3, name="out")(h))
  pipe = tfpipe.Pipeline(model, num_stages=2, method="gpipe", micro_batches=2,
                         memory_budget=footprint.RUNTIME + 1_500_000)
  pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  data = np.random.default_rng(0)
  with pytest.raises(ValueError, match=r"fit; with recompute=True some would; use more"):
    pipe.fit(data.standard_normal((1024, 64)).astype("float32"),
             data.integers(0, 3, 1024), batch_size=1024, verbose=0)


def test_a_budget_is_per_device_where_a_device_holds_several_stages():
  from tfpipe.training import memory_budget
  pipe = tfpipe.Pipeline(_wide_then_narrow(), num_stages=2, method="interleaved",
                         micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
  rows = pipe.memory(16)
  assert len(rows) == 4 and len(set(pipe.devices)) == 2
  pipe.memory_budget = max(row["total"] for row in rows) + 1   # each stage alone fits
  peak, stage = memory_budget.over(pipe, rows)
  device = pipe.devices[stage]
  assert peak == sum(r["total"] for r, d in zip(rows, pipe.devices) if d == device)
  assert peak > pipe.memory_budget
