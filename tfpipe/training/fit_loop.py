"""A Pipeline's epoch loop: Keras callbacks around the executor's epochs, validation, resume.

What `tfpipe.Pipeline.fit`, `evaluate` and `predict` run once their data and
arguments are checked (`tfpipe.training.fit_data`): the hooks in Keras's order in the
caller's thread, the compiled executor's window for the call, the data put
where a resumed run left it, and the trained weights into the user's model.
"""

import os
import time

import keras
import numpy as np

from tfpipe import runtime
from tfpipe.instruments import breakdown as breakdown_lib, trace
from tfpipe.plan import policies
from tfpipe.runtime import iterators
from tfpipe.training import checkpoint as checkpoint_lib

__all__ = ["train", "epoch_plan", "evaluate", "predict", "choose_window", "restore",
           "reads_batches", "fit_records"]

_BATCH_HOOKS = {"train": ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin",
                           "on_batch_end"),
                "test": ("on_test_batch_begin", "on_test_batch_end"),
                "predict": ("on_predict_batch_begin", "on_predict_batch_end")}


def _has_batch_hooks(callback, mode="train"):
  """True when the callback overrides a `mode` batch hook of `keras.callbacks.Callback`: in
  its class, or on the instance (`keras.callbacks.LambdaCallback` sets the hooks it is given)."""
  base = keras.callbacks.Callback
  for name in _BATCH_HOOKS[mode]:
    hook = getattr(callback, name, None)
    if getattr(hook, "__func__", hook) is not getattr(base, name):
      return True
  return False


def reads_batches(cbs, mode):
  """True when a callback besides the progress bar has `mode` batch hooks."""
  return any(_has_batch_hooks(cb, mode) and not isinstance(cb, keras.callbacks.ProgbarLogger)
             for cb in cbs.callbacks)


# Callbacks that never read the Keras model's weights. With only these (and those that say so
# with `reads_weights = False`), an epoch's end leaves the weights on the stages' devices:
# copying them to the client costs the whole model on the links, each epoch. `fit`'s end
# always copies them.
_WEIGHT_BLIND = (keras.callbacks.History, keras.callbacks.ProgbarLogger,
                 keras.callbacks.CSVLogger, keras.callbacks.TerminateOnNaN,
                 keras.callbacks.LearningRateScheduler, keras.callbacks.ReduceLROnPlateau)


def reads_weights(callback):
  """Whether `callback` may read the Keras model's weights at an epoch's end: unless it says
  otherwise (`reads_weights`) or is one of Keras's callbacks that never do."""
  said = getattr(callback, "reads_weights", None)
  if said is not None:
    return bool(said)
  if isinstance(callback, keras.callbacks.EarlyStopping):
    return bool(callback.restore_best_weights)
  return not isinstance(callback, _WEIGHT_BLIND)


def write_to_model(pipe):
  """Every stage's weights into the user's Keras model."""
  for p in pipe.programs:
    p.write_to_model()


def _should_validate(epoch, validation_freq):
  if isinstance(validation_freq, int):
    return (epoch + 1) % validation_freq == 0
  return epoch + 1 in validation_freq


def epoch_plan(pipe, num_batches):
  """The schedule of `num_batches` mini-batches of `pipe`'s method and its version
  differences."""
  schedule = policies.build_schedule(pipe.policy, pipe.num_stages, num_batches,
                                     pipe.micro_batches,
                                     joint=pipe.programs[0].updates.joint is not None)
  return schedule, policies.version_differences(pipe.policy, schedule,
                                                pipe.options.version_difference)


class _Hooks:
  """The fit's callbacks (`cbs`) as the loop calls them: `hook(name, ...)` with the
  learning-rate `link` synced around it; batch hooks with the link only when a callback
  besides the progress bar has batch hooks (that eager work in the caller thread slows the
  stage threads: 7% of a tiny model's throughput, measured), and as floats only if read."""

  def __init__(self, cbs, link):
    self.cbs, self.link = cbs, link
    self.batch_readers = [cb for cb in cbs.callbacks if _has_batch_hooks(cb)]
    self.linked = any(not isinstance(cb, keras.callbacks.ProgbarLogger)
                      for cb in self.batch_readers)

  def __call__(self, name, *args):
    self.link.sync()
    getattr(self.cbs, name)(*args)
    self.link.push()

  def batch(self, name, *args):
    if self.linked:
      self(name, *args)
    elif self.batch_readers:
      getattr(self.cbs, name)(*args)

  def choose_window(self, pipe):
    """The executor's window: window ends fall on multiples of it only where a batch hook
    reads them."""
    choose_window(pipe, self.linked or reads_batches(self.cbs, "test"), aligned=self.linked)


def train(pipe, dataset, num_batches, cbs, link, epochs, initial_epoch, steps_per_epoch,
          validation, validation_freq, watch=None):
  """Trains epochs `initial_epoch` .. `epochs`-1 of `pipe`'s method on its executor with the
  hooks of `cbs` (the learning-rate `link` synced around them); returns the History.
  `watch`: `method="auto"`'s probe training first (`tfpipe.training.chooser.Chooser.watch`),
  told each epoch's start and each result; once it is `due`, `watch.hand_over(pipe, trained,
  rest, num_batches)` (mini-batches trained in the fit, left in it) may hand the rest of the
  fit to a choice: where the epoch stopped there to profile, its rest runs on the choice's
  schedule, as the same epoch of the executor."""
  options = pipe.options
  hooks = _Hooks(cbs, link)
  hooks.choose_window(pipe)
  # Stages on TF servers keep their weights until something reads them (or `fit` ends).
  readers = not pipe.remote_stages() or any(reads_weights(cb) for cb in cbs.callbacks)
  pipe.model.stop_training = False
  pipe.fit_epochs = (pipe.runtime.epoch + 1, num_batches, initial_epoch)
  profiled = pipe.runtime.profiles   # the runtime runs the profiler
  tracer = (trace.StepTracer(options.trace_dir, options.trace_steps)
            if options.trace_steps is not None and not profiled else None)
  if tracer:
    tracer.begin(initial_epoch * num_batches)
  hooks("on_train_begin")
  logs, iterator = {}, None
  epoch_loop = _EpochLoop(pipe, hooks, num_batches, epochs, initial_epoch, tracer, watch)
  try:
    iterator = _replay_data(dataset, initial_epoch, steps_per_epoch, num_batches)
    for epoch in range(initial_epoch, epochs):
      if steps_per_epoch is None or iterator is None:
        iterator = iterators.release(iterator)   # the last epoch's, deleted off this thread
        iterator = iter(dataset)
      _reset_metrics(pipe)
      if profiled and options.trace_steps is not None:   # its profile of the traced epochs
        first, last = options.trace_steps
        traced = epoch * num_batches <= last and (epoch + 1) * num_batches > first
        pipe.runtime.profile_dir = options.trace_dir if traced else None
      hooks("on_epoch_begin", epoch)
      start = time.perf_counter()
      epoch_loop.run(epoch, iterator)
      seconds = time.perf_counter() - start
      logs = _metric_logs(pipe)
      samples = float(pipe.step.loss_tracker.count.numpy())
      logs["samples_per_second"] = samples / seconds if seconds > 0 else 0.0
      if readers:
        write_to_model(pipe)
      if validation is not None and _should_validate(epoch, validation_freq):
        logs.update(evaluate(pipe, *validation, cbs, prefix="val_"))
      hooks("on_epoch_end", epoch, logs)
      if pipe.model.stop_training:
        break
  finally:
    iterator = iterators.release(iterator)
    if tracer:
      tracer.end()
  if not _finalize_weights(pipe) and not readers:
    write_to_model(pipe)
  if options.trace_steps is not None:
    trace.write_chrome_trace(os.path.join(options.trace_dir, trace.TRACE_FILE),
                             fit_records(pipe), pipe.devices, num_batches, options.trace_steps)
  hooks("on_train_end", logs)
  return pipe.model.history


class _EpochLoop:
  """One training epoch at a time on `pipe`'s executor, its batch hooks through `hooks`; a
  stop asked in a hook (`model.stop_training`) drains the batches already due; `watch` (see
  `train`) is timed until its hand-over, after which the epoch goes on where it stopped."""

  def __init__(self, pipe, hooks, num_batches, epochs, initial_epoch, tracer, watch):
    self.pipe, self.hooks, self.num_batches = pipe, hooks, num_batches
    self.epochs, self.initial_epoch = epochs, initial_epoch
    self.tracer, self.watch = tracer, watch
    self.plan = epoch_plan(pipe, num_batches)

  def run(self, epoch, iterator):
    """Trains epoch `epoch` from `iterator`."""
    pipe, num_batches = self.pipe, self.num_batches
    stopping = []
    if self.watch is not None:   # timed by the executor's windows
      self.watch.epoch_begins(num_batches, pipe.runtime.window)
    trained, now = 0, self.plan   # this epoch's mini-batches so far; its schedule
    while True:
      on_result, before = self._results(epoch, trained, stopping)
      try:
        trained += pipe.runtime.train_epoch(*now, iterator, num_batches - trained,
                                            on_result, before, continuing=trained > 0)
      except runtime.OutOfData:
        raise ValueError(
            f"the data ran out before {num_batches} batches in epoch {epoch}; give a "
            "`steps_per_epoch` the data can fill, or repeat the dataset") from None
      if self.watch is None or not self.watch.due:
        return
      done = (epoch - self.initial_epoch) * num_batches + trained
      changed, goes_on = self.watch.hand_over(
          pipe, done, (self.epochs - epoch) * num_batches - trained, num_batches)
      self.watch = None
      if changed:
        self.hooks.choose_window(pipe)
      self.plan = epoch_plan(pipe, num_batches)
      if not goes_on or stopping or trained >= num_batches:
        return
      now = epoch_plan(pipe, num_batches - trained)   # the rest of this epoch

  def _results(self, epoch, offset, stopping):
    """The executor's `on_result` and `before` for epoch `epoch`'s mini-batches from
    `offset`; a stop is appended to `stopping`."""
    hooks, tracer, watch, pipe = self.hooks, self.tracer, self.watch, self.pipe
    num_batches = self.num_batches

    def before(b):
      if not stopping:
        hooks.batch("on_train_batch_begin", b + offset)

    def on_result(b, loss, batch_logs):
      b += offset
      if tracer:
        tracer.on_step_end(epoch * num_batches + b)
      if stopping:
        return True   # drained after a stop: trained, no hooks
      if hooks.batch_readers:
        hooks.batch("on_train_batch_end", b, {k: float(v) for k, v in batch_logs.items()})
      if pipe.model.stop_training:
        stopping.append(b)
      if watch is not None and watch.result(b, (self.epochs - epoch) * num_batches - b - 1):
        return True   # stops here to profile
      return bool(stopping)

    return on_result, before


def _reset_metrics(pipe):
  pipe.step.reset()
  for p in pipe.programs[:-1]:
    if p.reg_tracker is not None:
      p.reg_tracker.reset_state()


def _metric_logs(pipe, prefix=""):
  return {prefix + k: float(v) for k, v in pipe.programs[-1].reports.results().items()}


def _finalize_weights(pipe):
  """What Keras's `fit` does at its end: each optimizer's `finalize_variable_values`
  (with `use_ema`, the weights become their moving average), then into the model; returns
  whether it wrote them."""
  if not any(p.optimizer.use_ema for p in pipe.programs):
    return False
  for p in pipe.programs:
    p.finalize()
  write_to_model(pipe)
  return True


def choose_window(pipe, batch_hooks, aligned=True):
  """The compiled executor's window for this call (see `tfpipe.Pipeline.compile`); `aligned`:
  its training windows end on multiples of it (`tfpipe.runtime.CompiledRuntime`)."""
  if pipe.runtime.windowed:
    window = pipe.steps_per_execution
    prediction_error = pipe.options.prediction_error
    if window == "auto":
      window = (1 if batch_hooks or prediction_error is not None else
                pipe.AUTO_REMOTE_WINDOW if pipe.remote_stages() else pipe.AUTO_WINDOW)
    elif window > 1 and prediction_error is not None:
      raise ValueError(
          "the prediction error compares weights update by update, and a compiled window of "
          f"{window} mini-batches updates several times per call: use steps_per_execution=1 "
          "(or 'auto') with prediction_error")
    # The prediction error compares weights update by update: windows of one, the drain too.
    pipe.runtime.set_window(window, aligned or prediction_error is not None)


def restore(pipe, callbacks):
  """Resumes from the latest checkpoint of a BackupAndRestore callback; returns epochs done."""
  done = 0
  for cb in callbacks or []:
    if isinstance(cb, checkpoint_lib.BackupAndRestore):
      cb.attach(pipe)
      done = max(done, cb.restore())
  if done:
    write_to_model(pipe)
  return done


def _replay_data(dataset, epochs_done, steps_per_epoch, num_batches):
  """Puts the data where an uninterrupted run would be after `epochs_done` epochs.

  Returns the persistent iterator (steps_per_epoch) advanced past the
  batches trained, or None after advancing a reshuffling dataset by one
  unread iterator per epoch done.
  """
  if not epochs_done:
    return None
  if steps_per_epoch is None:
    for _ in range(epochs_done):
      iterators.release(iter(dataset))
    return None
  iterator = iter(dataset)
  for _ in range(epochs_done * num_batches):
    next(iterator)
  return iterator


def evaluate(pipe, dataset, num_batches, cbs, prefix=""):
  """Loss and metrics over `dataset`, with the `on_test_*` hooks (validation, evaluate)."""
  _reset_metrics(pipe)
  cbs.on_test_begin()
  iterator = iter(dataset)
  try:
    pipe.runtime.infer_epoch(
        iterator, num_batches,
        lambda b, logs: cbs.on_test_batch_end(b, {k: float(v) for k, v in logs.items()}),
        with_labels=True, before=cbs.on_test_batch_begin)
  finally:
    iterator = iterators.release(iterator)
  logs = _metric_logs(pipe)
  cbs.on_test_end(logs)
  return {prefix + k: v for k, v in logs.items()}


def predict(pipe, dataset, num_batches, cbs):
  """The model's outputs over `dataset` as one numpy array, with the `on_predict_*` hooks."""
  outputs = {}
  cbs.on_predict_begin()
  choose_window(pipe, reads_batches(cbs, "predict"))

  def on_result(b, ys):
    outputs[b] = [y.numpy() for y in ys]
    cbs.on_predict_batch_end(b, {"outputs": pipe.step.structured(outputs[b])})

  iterator = iter(dataset)
  try:
    pipe.runtime.infer_epoch(iterator, num_batches, on_result, with_labels=False,
                             before=cbs.on_predict_batch_begin)
  finally:
    iterator = iterators.release(iterator)
  cbs.on_predict_end()
  joined = [np.concatenate([outputs[b][i] for b in range(num_batches)], axis=0)
            for i in range(len(outputs[0]))]
  return pipe.step.structured(joined)   # as Keras's predict: an array, or a list or dict


def fit_records(pipe, steps=None):
  """Records of `pipe`'s last fit, with the fit's epoch index (from `initial_epoch`), within
  `steps` (epoch * batches per epoch + batch) if given."""
  if pipe.fit_epochs is None:
    raise RuntimeError("no timeline yet: call `fit` first")
  first, per_epoch, initial = pipe.fit_epochs
  chosen = [r._replace(epoch=r.epoch - first + initial) for r in pipe.records if r.epoch >= first]
  if steps is not None:
    chosen = [r for r in chosen if steps[0] <= r.epoch * per_epoch + r.batch <= steps[1]]
  return chosen


def breakdown(pipe, steps=None):
  """`Pipeline.breakdown`: per-stage shares of the last fit's training time, or its `steps`."""
  if not pipe.record:
    raise RuntimeError("the breakdown reads the recorded timeline: build the Pipeline with "
                       "record=True")
  records = fit_records(pipe)
  if not records and pipe.runtime.profiles and pipe.remote_stages():
    raise ValueError(
        "no recorded task: the compiled executor reads its timeline from this process's "
        f"profiler, and stages on TF servers ({', '.join(pipe.remote_stages())}) run in other "
        "processes. Use executor='threaded' for their timeline")
  steps = trace.parse_steps(steps)
  chosen = fit_records(pipe, steps)
  if not chosen:
    raise ValueError(f"no recorded task in steps {steps}")
  return breakdown_lib.of_epochs(records, chosen, pipe.num_stages)
