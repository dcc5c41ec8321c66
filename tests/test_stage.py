"""Stage programs: a recomputed forward replays the random draws of the forward it recomputes."""

import keras
import numpy as np
import tensorflow as tf

from tests import helpers
from tests.conftest import DEVICES
from tfpipe import stage
from tfpipe.plan import policies


def _program(method="vanilla"):
  model = helpers.dropout_mlp(rate=0.5)
  return stage.StageProgram(0, 2, model, DEVICES[0], keras.optimizers.SGD(0.1),
                            policies.policy_for(method))


def test_recomputed_activations_equal_the_forward_bit_for_bit():
  program = _program()
  x = [tf.constant(np.random.default_rng(0).standard_normal((16, 8)), tf.float32)]
  first, _, state = program.forward(x, 0)
  second, _, _ = program.forward(x, 0)   # the seed state has moved on: other masks
  assert not np.array_equal(first[0].numpy(), second[0].numpy())
  # Compiled as the forward is (eager ops round differently from the fused graph).
  replay = tf.function(lambda xs, st: program._call(program.weights(0, False), xs, training=True,
                                                    update_state=False, state=st)[0])
  replayed = replay(x, state)
  np.testing.assert_array_equal(replayed[0].numpy(), first[0].numpy())


def test_a_recompute_does_not_advance_the_seed_state():
  program = _program()
  x = [tf.ones((4, 8))]
  _, _, state = program.forward(x, 0)
  before = [v.numpy() for v in program.non_trainable]
  program.backward_recompute([(x, state)], [tf.ones((4, 3))], 0, tf.constant(1.0, tf.float64),
                             False)
  for a, b in zip(before, program.non_trainable):
    np.testing.assert_array_equal(a, b.numpy())
