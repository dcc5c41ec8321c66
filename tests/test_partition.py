"""Partitioning: stage sub-models compose to the model; skip connections; profile balance."""

import keras
import numpy as np
import pytest

from tests import helpers
from tfpipe import compat
from tfpipe.stage import partition
from tfpipe.training import layer_profile


def _compose(stages, x):
  xs = [x]
  for stage in stages:
    out = stage(xs[0] if len(xs) == 1 else xs)
    xs = out if isinstance(out, (list, tuple)) else [out]
  return xs[0]


@pytest.mark.parametrize("K", [1, 2, 3, 5])
@pytest.mark.parametrize("build", [helpers.mlp, helpers.sequential_mlp, helpers.skip_model])
def test_stages_compose_to_the_model(build, K):
  model = build()
  result = partition.partition(model, K)
  assert len(result.stages) == K
  x = np.random.default_rng(0).standard_normal((4, 8)).astype("float32")
  helpers.assert_close(_compose(result.stages, x), model(x), rtol=1e-6)
  names = [n for stage in result.layer_names for n in stage]
  assert len(names) == len(set(names)) == len(partition.graph_nodes(model)[2])


def test_skip_connection_crossing_a_cut_carries_two_tensors():
  model = helpers.skip_model()
  result = partition.partition(model, 2)  # dense0, dense1, dense2 | add, logits
  assert result.layer_names == [["dense0", "dense1", "dense2"], ["add", "logits"]]
  assert len(result.stages[0].outputs) == 2 and len(result.stages[1].inputs) == 2
  # Three stages: the skip passes through the middle stage.
  three = partition.split(model, [0, 1, 2, 5])
  assert [len(s.inputs) for s in three] == [1, 1, 2]
  assert [len(s.outputs) for s in three] == [1, 2, 1]  # stage 1 passes dense0's output on


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_a_skip_passing_through_a_stage_keeps_its_dtype_and_values(dtype):
  """The pass-through runs in the tensor's dtype (a float32 layer would round float64 to
  float32 and back: 1e-9 gaps that 20 steps amplify to 5e-2)."""
  model = helpers.skip_model(dtype=dtype)
  stages = partition.split(model, [0, 2, 3, 4, 5])   # dense0's output passes through stage 1
  assert stages[1].get_layer("stage1_pass0").compute_dtype == dtype
  assert [t.dtype for t in stages[1].outputs] == [dtype, dtype]
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(dtype)
  np.testing.assert_array_equal(_compose(stages, x), model(x))


def test_stages_share_the_model_variables():
  model = helpers.mlp()
  result = partition.partition(model, 2)
  ids = {id(v) for s in result.stages for v in s.trainable_variables}
  assert ids == {id(v) for v in model.trainable_variables}


def test_params_balance():
  keras.utils.set_random_seed(0)
  x = keras.Input((64,))
  h = keras.layers.Dense(256)(x)   # 16,640 parameters
  for _ in range(4):
    h = keras.layers.Dense(8)(h)   # small
  model = keras.Model(x, h)
  assert partition.partition(model, 2, "params").cuts == [0, 1, 5]


def test_profile_moves_the_cut_toward_cheap_layers():
  keras.utils.set_random_seed(0)
  x = keras.Input((1024,))
  h = keras.layers.Dense(1024, name="big0")(x)
  h = keras.layers.Dense(1024, name="big1")(h)
  for i in range(6):
    h = keras.layers.Dense(16, name=f"small{i}")(h)
  model = keras.Model(x, h)
  # Costs differ >10x between the 1024x1024 layers and the others.
  profiler = layer_profile.Profiler(batch_size=256, device="/device:CPU:0", repeats=5)
  forward, backward = profiler(partition.graph_nodes(model)[2])
  total = [f + b for f, b in zip(forward, backward)]
  assert min(total[:2]) > 3 * max(total[2:])
  result = partition.partition(model, 2, "profile", profile=lambda nodes: (forward, backward))
  uniform = partition.partition(model, 2, "uniform")
  assert uniform.cuts == [0, 4, 8]
  # The two big layers must be split: the first cut moves toward the cheap end.
  assert result.cuts[1] < uniform.cuts[1]
  assert result.layer_names[0][0] == "big0" and "big1" not in result.layer_names[0]


def test_errors():
  model = helpers.mlp(depth=2)  # 3 layers
  with pytest.raises(ValueError, match="cannot cut model 'mlp' into 4 stages: it has 3 cuttable layers"):
    partition.partition(model, 4)
  with pytest.raises(ValueError, match="did you mean 'profile'"):
    partition.partition(model, 2, "profil")

  class Sub(keras.Model):
    def call(self, x):
      return x
  with pytest.raises(ValueError, match="subclassed"):
    partition.partition(Sub(), 2)
  with pytest.raises(ValueError, match="no input shape"):
    partition.partition(keras.Sequential([keras.layers.Dense(2)]), 1)
  x = keras.Input((4,))
  shared = keras.layers.Dense(4, name="shared")
  # A layer called twice: on one stage nothing is shared; across two its weights are held by
  # both (trained as one weight on the synchronous schedules, tfpipe.rules.joint).
  model = keras.Model(x, keras.layers.Dense(2, name="head")(shared(shared(x))))
  assert partition.partition(model, 2, ["head"]).shared == ()
  assert partition.partition(model, 2, ["shared"]).shared == (((0, 0), (1, 0)),
                                                               ((0, 1), (1, 1)))
  # Called on two stages but reading its own weight on each (an untied embedding and its
  # head): nothing shared, each stage holds the other's weight unread.
  two_way = helpers.two_way_lm()
  assert partition.partition(two_way, 2, ["block"]).shared == ()
  assert partition.partition(two_way, 2, ["block"]).unread == ((1,), (2,))   # after block's
  # Integer cuts count layer calls: the layer called twice twice.
  assert partition.partition(model, 2, [0, 1, 3]).cuts == [0, 1, 3]
  with pytest.raises(ValueError, match=r"rise strictly from 0 to 3 \(the layer count"):
    partition.partition(model, 2, [0, 2, 4])


def _masked(mask_zero):
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((6,), dtype="int32"),
                           keras.layers.Embedding(5, 8, mask_zero=mask_zero),
                           keras.layers.LSTM(4), keras.layers.Dense(8), keras.layers.Dense(3)])


@pytest.mark.parametrize("cuts,first", [([0, 1, 4], ["embedding"]),
                                        ([0, 2, 4], ["embedding", "lstm"]),
                                        ([0, 1, 3, 4], ["embedding"])])
def test_integer_cuts_count_the_layers_the_user_wrote_whatever_masks_keras_adds(cuts, first):
  # Keras's names aside (embedding_3, ...), and its mask op (not_equal) aside.
  strip = lambda stages: [[n.rstrip("0123456789").rstrip("_") for n in stage
                           if not n.startswith("not_equal")] for stage in stages]
  names = {}
  for mask_zero in (False, True):
    model = _masked(mask_zero)
    got = partition.partition(model, len(cuts) - 1, cuts)
    names[mask_zero] = strip(got.layer_names)
    assert names[mask_zero][0] == first
    x = np.random.default_rng(0).integers(0, 5, (4, 6)).astype("int32")
    y = x
    for stage in got.stages:   # the stages compose to the model, the mask crossing the cut
      y = stage(y)
    np.testing.assert_allclose(np.asarray(y), np.asarray(model(x)), rtol=1e-5, atol=1e-6)
  assert names[False] == names[True]   # the same layers on each stage, mask or not


def test_a_call_that_cannot_be_traced_apart_counts_as_reading_all_its_layers_weights(
    monkeypatch):
  def untraceable(node):
    raise ValueError(f"cannot trace {node.operation.name} apart")
  monkeypatch.setattr(compat, "variables_read", untraceable)
  cut = partition.partition(helpers.two_way_lm(), 2, ["block"])
  assert cut.shared == (((0, 0), (1, 2)), ((0, 1), (1, 3))) and cut.unread == ((), ())
