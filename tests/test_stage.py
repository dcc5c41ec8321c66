"""Stage programs: a recomputed forward replays the random draws of the forward it recomputes."""

import keras
import pytest
import numpy as np
import tensorflow as tf

from tests import helpers
from tests.conftest import DEVICES
from tfpipe.plan import policies
from tfpipe.stage import program as stage, tracing


def _program(method="vanilla"):
  model = helpers.dropout_mlp(rate=0.5)
  return stage.StageProgram(0, 2, model, DEVICES[0], keras.optimizers.SGD(0.1),
                            policies.policy_for(method))


def test_recomputed_activations_equal_the_forward_bit_for_bit():
  program = _program()
  x = [tf.constant(np.random.default_rng(0).standard_normal((16, 8)), tf.float32)]
  first, kept = program.forward(x, 0)
  second, _ = program.forward(x, 0)   # the seed state has moved on: other masks
  assert not np.array_equal(first[0].numpy(), second[0].numpy())
  # Compiled as the forward is (eager ops round differently from the fused graph).
  replay = tf.function(lambda xs, st: program._call(program.sources.read(0, "current"), xs, training=True,
                                                    update_state=False, state=st)[0])
  replayed = replay(x, kept.state)
  np.testing.assert_array_equal(replayed[0].numpy(), first[0].numpy())


def test_a_recompute_does_not_advance_the_seed_state():
  program = _program()
  x = [tf.ones((4, 8))]
  _, kept = program.forward(x, 0)
  before = [v.numpy() for v in program.non_trainable]
  program.backward([kept], [tf.ones((4, 3))], 0, tf.constant(1.0, tf.float64), False)
  for a, b in zip(before, program.non_trainable):
    np.testing.assert_array_equal(a, b.numpy())


def _whole_backward(method):
  """Two like stages of `method` (stage 1 of 3 of a dropout MLP, momentum SGD), a batch, its
  output gradients, the share 1, and the input gradients of one whole backward on the first
  (which updates it)."""
  def program():
    return stage.StageProgram(1, 3, helpers.dropout_mlp(rate=0.5), DEVICES[0],
                              keras.optimizers.SGD(0.1, momentum=0.9),
                              policies.policy_for(method))
  whole, split = program(), program()
  x = [tf.constant(np.random.default_rng(1).standard_normal((6, 8)), tf.float32)]
  dys = [tf.constant(np.random.default_rng(2).standard_normal((6, 3)), tf.float32)]
  one = tf.constant(1.0, tf.float64)
  _, kept = whole.forward(x, 1)
  return whole, split, x, dys, one, whole.backward([kept], dys, 1, one, False).dxs


@pytest.mark.parametrize("inline", [False, True], ids=["calls", "inline"])
@pytest.mark.parametrize("method", ["pipedream", "vanilla", "i_timeprest", "spectrain"])
def test_backward_halves_equal_the_whole_backward(method, inline):
  """A zero-bubble split: input gradients first (no update), then the weight gradients and the
  update, give the input gradients and weights of one backward, for every kind of kept state.
  Traced inline (both halves in one graph), a kept tape is not persistent: the input half
  takes the weight gradients in the same walk and hands them to the weight half."""
  whole, split, x, dys, one, expected = _whole_backward(method)
  with split.inlined(inline):
    _, kept = split.forward(x, 1, split=True)
    tape = whole.ops["F"].keeps == "tape"
    assert (kept.tape is not None) == tape
    if tape:
      assert kept.tape._persistent == (not inline)
    before = [v.numpy() for v in split.trainable]
    done = split.backward_input([kept], dys, 1, one)
    got = done.dxs
    for a, b in zip(before, split.trainable):   # no update yet
      np.testing.assert_array_equal(a, b.numpy())
    if inline and tape:
      assert len(done.kept.grads) == len(split.trainable) and done.kept.tape is None
      kept = done.kept
    else:
      assert done.kept is None
    assert split.backward_weights([kept], dys, 1, one, False) is None
  helpers.assert_close(got[0].numpy(), expected[0].numpy(), rtol=1e-6)
  helpers.assert_weights_close([v.numpy() for v in split.trainable],
                               [v.numpy() for v in whole.trainable], rtol=1e-6)


@pytest.mark.parametrize("method", ["pipedream", "spectrain"])
def test_backward_halves_of_a_call_in_a_window_run_its_backward_once(method):
  """In a window's graph a stage's forward call keeps its residuals, not a tape: a
  zero-bubble split takes the input and weight gradients in one call of the forward's
  backward (two walks of a persistent tape ran the call's whole backward twice) and
  equals the whole backward."""
  whole, split, x, dys, one, expected = _whole_backward(method)

  @tf.function(autograph=False)
  def window(x, dys):
    _, kept = split.forward(x, 1, split=True)
    assert kept.tape is None and kept.residuals is not None
    done = split.backward_input([kept], dys, 1, one)
    assert len(done.kept.grads) == len(split.trainable) and done.kept.residuals is None
    split.backward_weights([done.kept], dys, 1, one, False)
    return done.dxs

  got = window(x, dys)
  graph = window.get_concrete_function(x, dys).graph
  calls = [op.get_attr("f").name for op in graph.get_operations()
           if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
  assert sum("backward" in name for name in calls) == 1, calls
  helpers.assert_close(got[0].numpy(), expected[0].numpy(), rtol=1e-6)
  helpers.assert_weights_close([v.numpy() for v in split.trainable],
                               [v.numpy() for v in whole.trainable], rtol=1e-6)


def _ancestors(op):
  seen, todo = set(), [op]
  while todo:
    o = todo.pop()
    for parent in [t.op for t in o.inputs] + list(o.control_inputs):
      if parent.name not in seen:
        seen.add(parent.name)
        todo.append(parent)
  return seen


@pytest.mark.parametrize("method", ["vanilla", "i_timeprest"])
def test_a_backward_updates_only_after_its_input_gradients(method):
  """Inside one backward the update waits for the input gradients: otherwise TensorFlow may
  run it first and the input gradients read the updated weights."""
  program = stage.StageProgram(1, 3, helpers.dropout_mlp(rate=0.5), DEVICES[0],
                               keras.optimizers.SGD(0.1, momentum=0.9),
                               policies.policy_for(method))
  x = [tf.ones((6, 8))]
  _, kept = program.forward(x, 1)
  args = ([] if kept.weights is None else kept.weights, [(kept.xs, kept.state)],
          [tf.ones((6, 3))], tf.constant(1.0, tf.float64), tf.constant(1.0, tf.float64),
          False, "both")
  graph = program.functions.functions["backward_on"].get_concrete_function(*args).graph
  outputs = [t.op.inputs[0].op.name if t.op.type == "Identity" else t.op.name
             for t in graph.outputs if t.dtype == tf.float32]   # the input gradients
  # The variable writes: assignments, and the calls of the optimizer step (`_apply_step`).
  writes = [op for op in graph.get_operations()
            if op.type in ("AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp")
            or op.type == "StatefulPartitionedCall" and "inference__step_" in op.get_attr("f").name]
  assert outputs and writes
  for op in writes:
    before = _ancestors(op)
    assert all(name in before for name in outputs), op.name


def test_a_kept_forwards_input_gradients_have_the_inputs_static_shape():
  """Through a call of the forward traced for any batch size, TensorFlow loses the batch
  size of a kept forward's input gradients (from its residuals, in a window's graph); the
  backward restores it, so the stage before (whose backward takes them) traces once for
  them and for a recompute's alike."""
  program = stage.StageProgram(1, 3, helpers.dropout_mlp(rate=0.5), DEVICES[0],
                               keras.optimizers.SGD(0.1), policies.policy_for("pipedream"))
  tracing.check_kept_tapes(program)   # traces the forward for any batch size, as compile does

  @tf.function(autograph=False)
  def window(x, dy):
    _, kept = program.forward([x], 0)
    assert kept.tape is None and kept.residuals is not None
    return program.backward([kept], [dy], 0, tf.constant(1.0, tf.float64), False).dxs

  shapes = window.get_concrete_function(tf.TensorSpec((6, 8)), tf.TensorSpec((6, 3)))
  assert [tuple(t.shape) for t in shapes.outputs] == [(6, 8)]


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("wrt", ["both", "inputs", "weights"])
def test_a_backward_of_several_parts_traces_the_stage_once_and_equals_the_parts_side_by_side(
    wrt, inline):
  """A TiMePReSt mini-batch's backward recomputes its micro-batches as calls of one traced
  function (one trace for all of them, not one per part), in a window of stage calls and in
  an inlined window (where TensorFlow inlines the calls). Its gradients equal those of the
  parts recomputed side by side in one tape: dropout masks replayed per part, weight
  penalties and activity regularisation counted once (the first part's)."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1),
                         activity_regularizer=keras.regularizers.L2(0.01)),
      keras.layers.Dropout(0.5, seed=1), keras.layers.Dense(3)])
  program = stage.StageProgram(1, 3, model, DEVICES[0], keras.optimizers.SGD(0.1),
                               policies.policy_for("timeprest"))
  rng = np.random.default_rng(3)
  kept = [program.forward([tf.constant(rng.standard_normal((4, 8)), tf.float32)], 0)[1]
          for _ in range(3)]
  parts = [(k.xs, k.state) for k in kept]
  dys = [tf.constant(rng.standard_normal((12, 3)), tf.float32)]
  weights = [tf.convert_to_tensor(v) for v in program.trainable]
  scale = tf.constant(0.5, tf.float64)
  summed = tf.function(lambda: program._summed_grads(weights, parts, dys, scale, wrt, inline))()
  joined = tf.function(lambda: program._joined_grads(weights, parts, dys, scale, wrt))()
  traced = program.functions.inlinable["part_grads"] if inline else program.functions.traced["part_grads"]
  assert traced.experimental_get_tracing_count() == 1
  counts = [0 if wrt == "inputs" else len(weights), 0 if wrt == "weights" else 1]
  assert [len(g) for g in summed] == [len(g) for g in joined] == counts
  for got, expected in zip(summed[0] + summed[1], joined[0] + joined[1]):
    helpers.assert_close(got.numpy(), expected.numpy(), rtol=1e-6)


def test_a_pipeline_compiled_again_traces_no_forward_to_learn_its_stages_again():
  # What a stage's forward shows (its ops, a tf.py_function) is kept per stage model: a second
  # compile (auto's choice after its probe, a Keras user's after unfreezing) traces none.
  import tfpipe
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="1f1b", micro_batches=2)
  counts = lambda: [p.functions.traced["forward_on"].experimental_get_tracing_count()
                    for p in pipe.programs]
  pipe.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
  assert counts()[0] == 1   # stage 0 keeps its tape: its forward traced to check it
  ops = [p.forward_ops() for p in pipe.programs]
  pipe.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
  assert [p.forward_ops() for p in pipe.programs] == ops and counts() == [0, 0]
  x, y = helpers.as_arrays(helpers.batches(2))
  assert np.isfinite(pipe.fit(x, y, batch_size=16, verbose=0).history["loss"][0])
