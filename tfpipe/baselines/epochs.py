"""The epoch loop of trainers that run their own steps (tfpipe.asgd, tfpipe.multi_worker).

Keras callbacks (History, progress bar, the user's) around the epochs; each
epoch's logs are its mean loss and samples/s, then the trained weights are
copied into the user's model.
"""

import time

import keras
import numpy as np

__all__ = ["run_epochs"]


def run_epochs(model, trained, epochs, num_batches, callbacks, verbose, train_epoch,
               extra_logs=None, asynchronous_steps=False):
  """Runs `train_epoch(cbs)` -> (per-step losses, samples) `epochs` times; returns History.

  `trained`: the model the steps update (its weights go to `model` after
  each epoch); `extra_logs()`: more logs once they are there (validation).
  `asynchronous_steps`: the steps run on their own and report their ends as their
  results arrive, after their traffic (the callbacks' `params["asynchronous_steps"]`:
  a per-step counter then counts from the epoch's start).
  """
  cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                     model=model, verbose=verbose, epochs=epochs,
                                     steps=num_batches, asynchronous_steps=asynchronous_steps)
  cbs.on_train_begin()
  logs = {}
  for epoch in range(epochs):
    cbs.on_epoch_begin(epoch)
    start = time.perf_counter()
    losses, samples = train_epoch(cbs)
    seconds = time.perf_counter() - start
    logs = {"loss": float(np.mean(losses)),
            "samples_per_second": samples / seconds if seconds > 0 else 0.0}
    model.set_weights(trained.get_weights())
    if extra_logs is not None:
      logs.update(extra_logs())
    cbs.on_epoch_end(epoch, logs)
  cbs.on_train_end(logs)
  return model.history
