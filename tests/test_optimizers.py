"""SpecTrain optimizer: the update and prediction rules by hand, in plain Keras fit."""

import keras
import numpy as np
import pytest

from tfpipe.rules import optimizers


def test_two_steps_by_hand():
  # w0 = 1, gamma = 0.5, eta = 0.1, g1 = 2, g2 = 4:
  # v1 = 0.5*0 + 0.5*2 = 1;     w1 = 1 - 0.1*1 = 0.9
  # v2 = 0.5*1 + 0.5*4 = 2.5;   w2 = 0.9 - 0.1*2.5 = 0.65
  w = keras.Variable(np.array([1.0], "float32"))
  opt = optimizers.SpecTrain(learning_rate=0.1, momentum=0.5)
  opt.apply([np.array([2.0], "float32")], [w])
  np.testing.assert_allclose(w.numpy(), [0.9], rtol=1e-6)
  np.testing.assert_allclose(opt.smoothed_gradient(w).numpy(), [1.0], rtol=1e-6)
  opt.apply([np.array([4.0], "float32")], [w])
  np.testing.assert_allclose(w.numpy(), [0.65], rtol=1e-6)
  # predict(w, 3) = 0.65 - 3*0.1*2.5 = -0.1
  np.testing.assert_allclose(opt.predict(w, 3).numpy(), [-0.1], atol=1e-6)


def test_predict_zero_is_the_weights():
  w = keras.Variable(np.array([1.5, -2.0], "float32"))
  opt = optimizers.SpecTrain(learning_rate=0.3, momentum=0.9)
  opt.apply([np.array([1.0, 3.0], "float32")], [w])
  np.testing.assert_array_equal(opt.predict(w, 0).numpy(), w.numpy())


def test_prediction_exact_for_constant_gradient_with_zero_momentum():
  # gamma = 0: v = g; with a constant gradient, s updates move w by s*eta*g exactly.
  w = keras.Variable(np.array([1.0], "float32"))
  opt = optimizers.SpecTrain(learning_rate=0.1, momentum=0.0)
  g = [np.array([0.5], "float32")]
  opt.apply(g, [w])
  predicted = opt.predict(w, 3).numpy()
  for _ in range(3):
    opt.apply(g, [w])
  np.testing.assert_allclose(predicted, w.numpy(), rtol=1e-6)


def test_plain_keras_fit_matches_the_rule():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
  w = model.get_weights()[0].astype(np.float64)
  x = np.random.default_rng(0).standard_normal((4, 3)).astype("float32")
  y = np.zeros((4, 1), "float32")
  model.compile(optimizer=optimizers.SpecTrain(learning_rate=0.1, momentum=0.8), loss="mse")
  model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0)
  v = np.zeros_like(w)
  for _ in range(3):  # d/dw mean((xw)^2) = 2 x^T (x w) / 4
    g = 2.0 * x.T.astype(np.float64) @ (x @ w) / 4
    v = 0.8 * v + 0.2 * g
    w = w - 0.1 * v
  np.testing.assert_allclose(model.get_weights()[0], w, rtol=1e-5)


def test_config_round_trip():
  opt = optimizers.SpecTrain(learning_rate=0.02, momentum=0.7, clipnorm=1.0)
  clone = optimizers.SpecTrain.from_config(opt.get_config())
  assert clone.momentum == 0.7
  assert clone.get_config()["learning_rate"] == pytest.approx(0.02)
  assert clone.clipnorm == 1.0


@pytest.mark.parametrize("momentum", [1.0, -0.1, 2.0])
def test_rejects_bad_momentum(momentum):
  with pytest.raises(ValueError, match=r"`momentum` must be in \[0, 1\). Received: momentum="):
    optimizers.SpecTrain(momentum=momentum)


def test_rejects_negative_learning_rate():
  with pytest.raises(ValueError, match="learning_rate=-1"):
    optimizers.SpecTrain(learning_rate=-1.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_update_and_prediction_equal_the_rule_bit_for_bit(dtype):
  # v = m v + (1 - m) g, w = w - lr v, in this order, in a graph: equal to the last bit.
  import tensorflow as tf
  rng = np.random.default_rng(3)
  w0, g1, g2 = (rng.standard_normal((64, 32)).astype(dtype) for _ in range(3))
  w = keras.Variable(w0)
  opt = optimizers.SpecTrain(learning_rate=0.037, momentum=0.9)
  opt.build([w])
  step = tf.function(lambda g: opt.apply([g], [w]))
  # The constants as the optimizer forms them: 1 - m in Python, the rate from its float32 variable.
  m, keep, lr = (np.asarray(c, dtype) for c in (0.9, 1.0 - 0.9, np.float32(0.037)))
  v, expected = np.zeros_like(w0), w0.copy()
  for g in (g1, g2):
    step(tf.constant(g))
    v = v * m + g * keep
    expected = expected - v * lr
  np.testing.assert_array_equal(opt.smoothed_gradient(w).numpy(), v)
  np.testing.assert_array_equal(w.numpy(), expected)
  # The prediction forms s * lr once per dtype (a stage predicts all its weights): w - (s lr) v.
  np.testing.assert_array_equal(opt.predict_all([w, w], 2)[1].numpy(),
                                expected - (np.asarray(2, dtype) * lr) * v)
