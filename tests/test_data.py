"""fit takes what keras.Model.fit takes: weights, validation options, dict and list inputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
import tfpipe

LOSS = "sparse_categorical_crossentropy"


def _compiled(model):
  model.compile(keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
  return model


def _pipe(model, method="sequential"):
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method)
  pipe.compile(keras.optimizers.SGD(0.05, momentum=0.9), LOSS, metrics=["accuracy"])
  return pipe


def _fit_both(build, *args, **kwargs):
  """Keras fit and a 2-stage `sequential` pipeline on the same arguments; both histories."""
  expected = _compiled(build())
  keras_history = expected.fit(*args, shuffle=False, verbose=0, **kwargs).history
  model = build()
  history = _pipe(model).fit(*args, shuffle=False, verbose=0, **kwargs).history
  helpers.assert_weights_close(model.get_weights(), expected.get_weights())
  return keras_history, history


def _weights(n, seed=3):
  return np.random.default_rng(seed).uniform(0.0, 2.0, n).astype("float32")


def test_sample_weight_equals_keras():
  x, y = helpers.as_arrays(helpers.batches(8))
  k, p = _fit_both(helpers.mlp, x, y, batch_size=16, epochs=2, sample_weight=_weights(len(x)))
  np.testing.assert_allclose(p["loss"], k["loss"], rtol=1e-5)


def test_class_weight_equals_keras():
  x, y = helpers.as_arrays(helpers.batches(8))
  k, p = _fit_both(helpers.mlp, x, y, batch_size=16, epochs=2, class_weight={0: 0.2, 2: 3.0})
  np.testing.assert_allclose(p["loss"], k["loss"], rtol=1e-5)


def test_dataset_of_x_y_sample_weight_equals_keras():
  x, y = helpers.as_arrays(helpers.batches(8))
  data = tf.data.Dataset.from_tensor_slices((x, y, _weights(len(x)))).batch(16)
  _fit_both(helpers.mlp, data, epochs=2)


def test_class_weight_on_a_dataset_equals_keras():
  x, y = helpers.as_arrays(helpers.batches(6))
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
  _fit_both(helpers.mlp, data, epochs=1, class_weight={0: 1.0, 1: 2.5, 2: 0.5})


@pytest.mark.parametrize("form", ["dict", "list"])
def test_multi_input_model_takes_dict_and_list_inputs(form):
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((64, 8), "float32"), rng.standard_normal((64, 4), "float32")
  y = rng.integers(0, 3, 64)
  x = {"b": b, "a": a} if form == "dict" else [a, b]
  _fit_both(helpers.two_input_model, x, y, batch_size=16, epochs=1, validation_data=(x, y))


def test_dict_inputs_in_a_dataset_by_name():
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((48, 8), "float32"), rng.standard_normal((48, 4), "float32")
  y = rng.integers(0, 3, 48)
  data = tf.data.Dataset.from_tensor_slices(({"a": a, "b": b}, y)).batch(16)
  _fit_both(helpers.two_input_model, data, epochs=1)
  model = helpers.two_input_model()
  pipe = _pipe(model)
  helpers.assert_close(pipe.predict({"a": a, "b": b}, batch_size=16, verbose=0),
                             model.predict({"a": a, "b": b}, batch_size=16, verbose=0),
                             rtol=1e-5)


def test_validation_split_takes_the_last_fraction_as_keras_does():
  x, y = helpers.as_arrays(helpers.batches(8))
  k, p = _fit_both(helpers.mlp, x, y, batch_size=16, epochs=2, validation_split=0.25)
  np.testing.assert_allclose(p["val_loss"], k["val_loss"], rtol=1e-5)
  np.testing.assert_allclose(p["val_accuracy"], k["val_accuracy"])


def test_validation_batch_size_and_freq():
  x, y = helpers.as_arrays(helpers.batches(4))
  expected, got = helpers.Recorder(), helpers.Recorder()
  options = dict(batch_size=16, epochs=4, validation_data=(x, y), validation_batch_size=32,
                 validation_freq=2)
  k, p = (_compiled(helpers.mlp()).fit(x, y, verbose=0, callbacks=[expected], **options).history,
          _pipe(helpers.mlp()).fit(x, y, verbose=0, callbacks=[got], **options).history)
  assert got.calls == expected.calls
  assert got.calls.count(("on_test_batch_end", 1)) == 2 and ("on_test_batch_end", 2) not in got.calls
  assert len(p["val_loss"]) == len(k["val_loss"]) == 2   # epochs 2 and 4


def test_validation_data_as_a_dataset_with_array_training_data():
  x, y = helpers.as_arrays(helpers.batches(4))
  val = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
  history = _pipe(helpers.mlp(), "pipedream").fit(x, y, batch_size=16, epochs=2, verbose=0,
                                                   validation_data=val)
  assert len(history.history["val_loss"]) == 2


def test_fit_arguments_keras_refuses_are_refused_by_name():
  x, y = helpers.as_arrays(helpers.batches(2))
  pipe = _pipe(helpers.mlp())
  with pytest.raises(ValueError, match="`sample_weight` and `class_weight` cannot both be given"):
    pipe.fit(x, y, sample_weight=np.ones(len(x)), class_weight={0: 1.0}, verbose=0)
  with pytest.raises(ValueError, match="`batch_size` must be None when `x` is a generator"):
    pipe.fit((b for b in helpers.batches(2)), batch_size=8, verbose=0)
  with pytest.raises(ValueError, match="`validation_split` splits arrays"):
    pipe.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), validation_split=0.5, verbose=0)
  with pytest.raises(ValueError, match="`validation_freq` must be a positive integer"):
    pipe.fit(x, y, validation_data=(x, y), validation_freq=0, verbose=0)


class _Batches(keras.utils.PyDataset):
  """A PyDataset of fixed batches that counts the passes begun over it."""

  def __init__(self, bs, **kwargs):
    super().__init__(**kwargs)
    self.bs, self.begins = bs, 0

  def __len__(self):
    return len(self.bs)

  def __getitem__(self, i):
    return self.bs[i]

  def on_epoch_begin(self):
    self.begins += 1


def _keras_and_pipe(fit, method="gpipe", micro_batches=2, executor=None):
  """The weights and History of `fit(trainer)` on Keras and on a pipeline of one mlp each."""
  out = []
  for make in (lambda m: m, lambda m: tfpipe.Pipeline(m, num_stages=2, method=method,
                                                      micro_batches=micro_batches,
                                                      executor=executor)):
    model = helpers.mlp()
    trainer = make(model)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    out.append((model.get_weights(), fit(trainer), trainer))
  return out


@pytest.mark.parametrize("workers,executor", [(1, "compiled"), (2, "threaded")],
                         ids=["inline-compiled", "two-workers-threaded"])
def test_py_dataset_trains_validates_and_evaluates_as_in_keras(workers, executor):
  bs = helpers.batches(6)
  train = lambda: _Batches(bs[:4], workers=workers)
  runs = _keras_and_pipe(lambda t: (t.fit(train(), epochs=2, shuffle=False, verbose=0,
                                          validation_data=_Batches(bs[4:])).history),
                         executor=executor)
  (k_init, k_history, k_model), (p_init, p_history, pipe) = runs
  for key, values in k_history.items():
    helpers.assert_close(p_history[key], values, rtol=1e-5, err_msg=key)
  for a, b in zip(k_model.get_weights(), pipe.model.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)
  data, k_data = _Batches(bs[4:]), _Batches(bs[4:])
  helpers.assert_close(pipe.evaluate(data, verbose=0), k_model.evaluate(k_data, verbose=0),
                             rtol=1e-5)
  assert data.begins == k_data.begins == 1   # one pass, as Keras's epoch iterator starts it
  inputs = _Batches([(x,) for x, _ in bs[4:]])
  helpers.assert_close(pipe.predict(inputs, verbose=0), k_model.predict(inputs, verbose=0),
                             rtol=1e-5)


def test_generator_with_steps_per_epoch_trains_as_in_keras():
  bs = helpers.batches(6)

  def forever():
    while True:
      yield from bs

  runs = _keras_and_pipe(lambda t: t.fit(forever(), steps_per_epoch=3, epochs=2,
                                         verbose=0).history, method="1f1b")
  (_, k_history, k_model), (_, p_history, pipe) = runs
  helpers.assert_close(p_history["loss"], k_history["loss"], rtol=1e-5)
  for a, b in zip(k_model.get_weights(), pipe.model.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)
  helpers.assert_close(pipe.evaluate((b for b in bs), verbose=0),
                             k_model.evaluate((b for b in bs), verbose=0), rtol=1e-5)
  assert np.all(np.isfinite(pipe.evaluate((b for b in bs), steps=2, verbose=0)))


def test_a_finite_generator_without_steps_feeds_one_epoch():
  bs = helpers.batches(3)
  runs = _keras_and_pipe(lambda t: t.fit((b for b in bs), epochs=1, verbose=0).history)
  (_, k_history, k_model), (_, p_history, pipe) = runs
  helpers.assert_close(p_history["loss"], k_history["loss"], rtol=1e-5)
  for a, b in zip(k_model.get_weights(), pipe.model.get_weights()):
    helpers.assert_close(a, b, rtol=1e-5)
  # Asked for more epochs, it stops after the one its batches fill, with Keras's warning
  # (Keras then feeds the two batches it peeked at again; README).
  with pytest.warns(UserWarning, match="ran out of data"):
    history = pipe.fit((b for b in bs), epochs=3, verbose=0)
  assert len(history.history["loss"]) == 1
