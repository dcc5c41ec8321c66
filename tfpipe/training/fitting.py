"""What `Pipeline.fit`, `evaluate` and `predict` run once their arguments are checked: the
data made ready (a KerasHub task's preprocessor, Keras's adapters, a validation split,
`method="auto"`'s choice, a memory budget's cuts), the callbacks, the learning-rate link,
a resumed checkpoint, and the remote calls watched; the epochs themselves are
`tfpipe.training.fit_loop`'s.
"""

import contextlib

import keras
import tensorflow as tf

from tfpipe.cluster import servers as cluster
from tfpipe.training import checkpoint as checkpoint_lib, data, fit_data, fit_loop
from tfpipe.training import learning_rate, preprocessing

__all__ = ["fit_once", "evaluate", "predict", "forward_only", "load_weights", "watched"]


def load_weights(pipe):
  """Every stage takes the user model's current weights (they may have changed since the
  last call)."""
  for p in pipe.programs:
    p.load_from_model()


@contextlib.contextmanager
def watched(pipe):
  """The body's remote calls: a hung server is named within seconds (`cluster.guard`), a
  task that died raises `cluster.WorkerLost` naming it."""
  try:
    with cluster.guard(pipe.remote_stages()):
      yield
  except tf.errors.OpError as e:
    lost = cluster.describe_lost(e, pipe.remote_stages()) if pipe.remote_stages() else None
    if lost is None:
      raise
    raise lost from e


def fit_once(pipe, x, y, batch_size, epochs, verbose, callbacks, validation_split,
             validation_data, shuffle, class_weight, sample_weight, initial_epoch,
             steps_per_epoch, validation_steps, validation_batch_size, validation_freq, seed):
  """One attempt of `Pipeline.fit` (`tfpipe.training.restarts` makes several); returns the
  History."""
  # A KerasHub task's preprocessor: strings in, as task.fit takes them.
  validation_data = preprocessing.validation(pipe.model, validation_data,
                                             validation_batch_size or batch_size)
  x, y, sample_weight, batch_size = preprocessing.preprocessed(pipe.model, x, y,
                                                               sample_weight, batch_size)
  fit_data.check_fit_arguments(pipe, epochs, initial_epoch, validation_freq, batch_size)
  if pipe.choosing and data.is_iterable_data(x):
    raise ValueError(f"method='auto' reads the first batch before training (to profile it), "
                     f"which would take it from the {type(x).__name__}: give the first fit "
                     "arrays or a tf.data.Dataset, or name a method")
  x, class_weight, data_hooks = data.adapted(x, y, sample_weight, batch_size, steps_per_epoch,
                                             shuffle, class_weight)
  if validation_split and validation_data is None:
    (x, y, sample_weight), validation_data = data.validation_split(
        x, y, sample_weight, validation_split)
  if pipe.auto is not None:
    pipe.auto.before_fit(pipe, x, y, batch_size, steps_per_epoch, sample_weight, class_weight,
                         verbose, epochs - initial_epoch)
  dataset, num_batches = fit_data.dataset(pipe, x, y, batch_size, steps_per_epoch, shuffle,
                                          seed, sample_weight=sample_weight,
                                          class_weight=class_weight,
                                          micro_batches=pipe.micro_batches)
  pipe.batch_size = batch_size or fit_data.batch_size_of(dataset) or pipe.batch_size
  pipe.input_shapes = fit_data.input_shapes(dataset) or pipe.input_shapes
  pipe.check_memory_budget(verbose)
  validation = None
  if validation_data is not None:
    validation, validation_hooks = fit_data.validation(
        pipe, validation_data, batch_size, validation_batch_size, validation_steps)
    data_hooks += validation_hooks
  verbose = 1 if verbose == "auto" else verbose
  callbacks = [checkpoint_lib.BackupAndRestore.from_keras(cb)
               if isinstance(cb, keras.callbacks.BackupAndRestore) else cb
               for cb in callbacks or []]
  callbacks = data_hooks + callbacks
  with learning_rate.driving(pipe.model, pipe.optimizer, pipe.metrics):
    cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                       model=pipe.model, verbose=verbose, epochs=epochs,
                                       steps=num_batches)
    with watched(pipe):   # remote assignments: a task lost meanwhile is named too
      load_weights(pipe)
      initial_epoch = max(initial_epoch, fit_loop.restore(pipe, callbacks))
    link = learning_rate.LearningRateLink(pipe.optimizer, [p.optimizer for p in pipe.programs],
                                          lambda: pipe.runtime.updates[-1])
    with link, watched(pipe):
      history = fit_loop.train(pipe, dataset, num_batches, cbs, link, epochs,
                               initial_epoch, steps_per_epoch, validation, validation_freq,
                               watch=pipe.auto and pipe.auto.watch())
  if pipe.auto is not None:
    pipe.auto.after_fit(pipe, num_batches)
  return history


def forward_only(pipe, run, dataset, num_batches, callbacks, verbose, test_hooks=False):
  """`run` (`fit_loop.evaluate` or `fit_loop.predict`) over `dataset` with the user model's
  weights, Keras's progress bar and `callbacks`; `test_hooks`: the window follows whether
  a callback reads every test batch."""
  load_weights(pipe)
  verbose = 1 if verbose == "auto" else verbose
  with learning_rate.driving(pipe.model, pipe.optimizer, pipe.metrics):
    cbs = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, model=pipe.model,
                                       verbose=verbose, epochs=1, steps=num_batches)
    if test_hooks:
      fit_loop.choose_window(pipe, fit_loop.reads_batches(cbs, "test"))
    with watched(pipe):
      return run(pipe, dataset, num_batches, cbs)


def evaluate(pipe, x, y, batch_size, verbose, sample_weight, steps, callbacks):
  """`Pipeline.evaluate`'s logs (a dict) over the data."""
  x, y, sample_weight, batch_size = preprocessing.preprocessed(pipe.model, x, y,
                                                               sample_weight, batch_size)
  x, _, data_hooks = data.adapted(x, y, sample_weight, batch_size, steps, use="test")
  dataset, num_batches = fit_data.dataset(pipe, x, y, batch_size, steps,
                                          sample_weight=sample_weight)
  return forward_only(pipe, fit_loop.evaluate, dataset, num_batches,
                      data_hooks + list(callbacks or []), verbose, test_hooks=True)


def predict(pipe, x, batch_size, verbose, steps, callbacks):
  """`Pipeline.predict`'s outputs for `x`."""
  x, _, _, batch_size = preprocessing.preprocessed(pipe.model, x, batch_size=batch_size)
  x, _, data_hooks = data.adapted(x, batch_size=batch_size, steps=steps, use="predict")
  if isinstance(x, tf.data.Dataset) and isinstance(x.element_spec, tuple):
    x = x.map(lambda *element: element[0])   # Keras: a tuple element is (x, y, sample_weight)
  dataset, num_batches = fit_data.dataset(pipe, x, None, batch_size, steps, labels=False)
  return forward_only(pipe, fit_loop.predict, dataset, num_batches,
                      data_hooks + list(callbacks or []), verbose)
