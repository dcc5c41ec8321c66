"""Memory per stage: weight versions, activations, optimizer slots, from a run, and as the
plan predicted them before it."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe.instruments import memory
from tfpipe.training import footprint
from tfpipe.rules import optimizers
from tests import helpers


def _memory(method, **options):
  x, y = helpers.as_arrays(helpers.batches(8))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=3, method=method, **options)
  pipe.compile(optimizers.SpecTrain(0.05, 0.9), keras.losses.SparseCategoricalCrossentropy())
  before = footprint.predict(pipe, 16)   # before anything trains
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  rows = memory.stage_memory(pipe, 16)
  _the_prediction_held(pipe, before, rows)
  return pipe, rows


def _the_prediction_held(pipe, before, after):
  """The plan predicted the kept forwards and weight versions the run counted, and the
  variables it then held (`tfpipe.training.footprint`)."""
  states, versions, _ = footprint.counts(pipe)
  assert (states, versions) == (pipe.runtime.peak_saved, pipe.runtime.peak_versions)
  for field in ("weights", "optimizer", "accumulators", "versions"):
    assert [row[field] for row in before] == [row[field] for row in after], field
  trainable = [sum(v.numpy().nbytes for v in p.trainable) for p in pipe.programs]
  assert [row["gradients"] for row in before] == trainable
  assert all(row["total"] == sum(row[f] for f in footprint.FIELDS) for row in before)


def test_memory_follows_each_methods_rule():
  pipe, stash = _memory("pipedream")
  weight_bytes = [sum(int(v.numpy().nbytes) for v in p.trainable) for p in pipe.programs]
  # helpers.mlp: dense0..3 (16 units) and logits; 3 stages of (2, 2, 1) layers.
  assert [row["weights"] for row in stash] == weight_bytes
  assert [row["optimizer"] >= w for row, w in zip(stash, weight_bytes)] == [True] * 3  # v slot
  # PipeDream keeps K-k versions and K-k activation sets at stage k (no copy at the last
  # stage, which runs forward and backward as one step): K-k-1 beyond the current weights.
  assert [row["versions"] for row in stash] == [2 * weight_bytes[0], weight_bytes[1], 0]
  _, predicted = _memory("spectrain")   # each reused prediction is a tensor of its own
  assert [row["versions"] for row in predicted] == [3 * weight_bytes[0], 2 * weight_bytes[1], 0]
  per_sample_0 = 4 * (8 + 16 + 16)  # float32 inputs + two dense outputs
  assert stash[0]["activations"] == 3 * per_sample_0 * 16
  _, vanilla = _memory("vanilla")
  assert [row["versions"] for row in vanilla] == [0, 0, 0]
  # Inputs only, and the one tape a backward rebuilds while it runs (a unit's layer outputs).
  assert vanilla[0]["activations"] == 3 * 4 * 8 * 16 + 4 * (16 + 16) * 16
  _, gpipe = _memory("gpipe", micro_batches=4)
  assert gpipe[0]["accumulators"] == weight_bytes[0]
  assert gpipe[0]["versions"] == 0     # no update inside a mini-batch: the current weights
  assert gpipe[0]["activations"] == 4 * per_sample_0 * 4          # M micro-batches of 4
  _, again = _memory("gpipe", micro_batches=4, recompute=True)   # M inputs, one tape rebuilt
  assert again[0]["activations"] == 4 * 4 * 8 * 4 + 4 * (16 + 16) * 4
  # The last stage's step holds the tape of every unit it joins: a mini-batch, a micro-batch.
  per_sample_2 = 4 * (16 + 3)   # its inputs + the logits
  assert stash[2]["activations"] == per_sample_2 * 16
  assert gpipe[2]["activations"] == per_sample_2 * 4
  for method in ("1f1b", "zb"):   # the plan's counts for the other synchronous schedules
    _memory(method, micro_batches=4)
  joining, joined = _memory("timeprest", micro_batches=4)   # a step over 4 micro-batches of 4
  assert joining.runtime.peak_saved[2] == 4 and joined[2]["activations"] == 4 * per_sample_2 * 4
  for rows in (stash, vanilla, gpipe):
    assert all(row["total"] == sum(row[f] for f in memory.FIELDS) for row in rows)
  text = memory.format_memory({"pipedream": stash, "vanilla": vanilla})
  assert "pipedream" in text and "versions" in text


def test_memory_needs_a_run():
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2)
  with pytest.raises(RuntimeError, match="compile and fit"):
    memory.stage_memory(pipe, 16)


def test_a_per_token_heads_logits_count_at_the_last_stage():
  # Outputs (batch, sequence, vocabulary): the last stage's step holds every token's logits.
  batch, length, vocab, width = 8, 6, 40, 8
  keras.utils.set_random_seed(0)
  tokens = keras.Input((length,), dtype="int32")
  h = keras.layers.Embedding(vocab, width, name="embed")(tokens)
  h = keras.layers.Dense(width, activation="relu", name="mix")(h)
  model = keras.Model(tokens, keras.layers.Dense(vocab, name="head")(h))
  pipe = tfpipe.Pipeline(model, num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1),
               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  predicted = footprint.predict(pipe, batch)   # before training: the loss keeps them too
  x = np.random.RandomState(0).randint(0, vocab, (4 * batch, length)).astype("int32")
  pipe.fit(x, np.roll(x, -1, axis=1), batch_size=batch, verbose=0)
  rows = memory.stage_memory(pipe, batch)
  logits = (batch // 2) * length * vocab * 4   # a micro-batch's, float32
  assert rows[1]["activations"] >= logits
  assert predicted[1]["activations"] >= pipe.runtime.peak_saved[1] * logits
