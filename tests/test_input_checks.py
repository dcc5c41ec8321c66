"""Bad input is refused before any work, in one line that names the problem and the value."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.conftest import DEVICES
import tfpipe


def _pipe(loss="sparse_categorical_crossentropy"):
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=2, method="pipedream")
  pipe.compile(keras.optimizers.SGD(0.05), loss)
  return pipe


def _refused(pipe, match, *args, **kwargs):
  with pytest.raises(ValueError, match=match) as error:
    pipe.fit(*args, verbose=0, **kwargs)
  assert "\n" not in str(error.value)
  assert [int(p.optimizer.iterations.numpy()) for p in pipe.programs] == [0, 0]  # no work done


def test_an_unbatched_dataset_is_refused_with_batch_it():
  x, y = helpers.as_arrays(helpers.batches(2))
  data = tf.data.Dataset.from_tensor_slices((x, y))
  _refused(_pipe(), r"unbatched elements \(input '\w+' has shape \(8\).*batch it", data)


def test_inputs_of_another_shape_are_refused():
  _refused(_pipe(), r"has shape \(None, 7\); the model expects \(None, 8\)",
           np.zeros((32, 7), "float32"), np.zeros(32, "int64"))
  data = tf.data.Dataset.from_tensor_slices((np.zeros((32, 5), "float32"), np.zeros(32))).batch(8)
  _refused(_pipe(), r"has shape \(None, 5\); the model expects \(None, 8\)", data)


def test_labels_outside_the_classes_are_refused():
  x = np.zeros((32, 8), "float32")
  _refused(_pipe(), r"class indices in \[0, 3\).*Received: labels from 0 to 5", x,
           np.array([0, 5] * 16))
  _refused(_pipe(), r"class indices in \[0, 3\).*from -1 to 0", x, np.array([0, -1] * 16))
  _refused(_pipe("categorical_crossentropy"), r"one-hot labels of width 4 do not fit the "
           r"model's 3 outputs", x, np.eye(4)[np.zeros(32, "int64")])


def test_empty_arrays_are_refused():
  _refused(_pipe(), r"`x` is empty \(0 samples\)", np.zeros((0, 8), "float32"), np.zeros(0))


def test_the_same_device_twice_is_refused():
  with pytest.raises(ValueError, match=r"'/device:CPU:1' \(position 0\) and '/CPU:1' "
                                       r"\(position 1\) are the same device: two stages on one "
                                       r"device run one at a time"):
    tfpipe.Pipeline(helpers.mlp(), devices=["/device:CPU:1", "/CPU:1"])
  with pytest.raises(ValueError, match="are the same device"):
    tfpipe.Pipeline(helpers.mlp(), devices=DEVICES[:2] + [DEVICES[1]], stage_replicas={1: 2})


class _PyFunctionLayer(keras.layers.Layer):
  def call(self, x):
    y = tf.py_function(lambda t: t * 2.0, [x], tf.float32)
    y.set_shape(x.shape)
    return y


def _py_function_model():
  keras.utils.set_random_seed(0)
  x = keras.Input((8,))
  h = _PyFunctionLayer(name="py_layer")(keras.layers.Dense(16)(x))
  return keras.Model(x, keras.layers.Dense(3)(keras.layers.Dense(16)(h)))


def test_a_py_function_in_a_stage_that_keeps_tapes_is_refused_at_compile():
  pipe = tfpipe.Pipeline(_py_function_model(), num_stages=2, method="pipedream",
                         partition=[0, 3, 4])
  for _ in range(2):   # compiled again: what the first trace found is refused again
    with pytest.raises(ValueError, match=r"stage 0 runs a tf.py_function \(in 'py_layer'\), "
                                         r"and method 'pipedream' keeps each forward's tape"):
      pipe.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")


def test_a_py_function_trains_with_a_method_that_recomputes():
  x, y = helpers.as_arrays(helpers.batches(6))
  pipe = tfpipe.Pipeline(_py_function_model(), num_stages=2, method="vanilla",
                         partition=[0, 3, 4])
  pipe.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
  history = pipe.fit(x, y, batch_size=16, verbose=0)
  assert np.isfinite(history.history["loss"][0])
