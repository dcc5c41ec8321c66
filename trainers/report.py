"""What the trainer shows: a line per epoch, TensorBoard scalars, a summary table."""

import math
import os

import keras
import tensorflow as tf

__all__ = ["EpochReport", "StopOnNonFinite", "ResumeReport", "format_table"]


class EpochReport(keras.callbacks.Callback):
  """Prints each epoch's logs (verbose >= 2) and writes them as scalars under `logdir/method`."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self, config):
    super().__init__()
    self.config = config
    self.writer = (tf.summary.create_file_writer(os.path.join(config.logdir, config.method))
                   if config.logdir else None)

  def on_epoch_end(self, epoch, logs=None):
    logs = dict(logs or {})
    if self.config.verbose >= 2:
      print(f"epoch {epoch + 1}/{self.config.epochs}: " + "  ".join(
          f"samples/s={v:.1f}" if k == "samples_per_second" else f"{k}={v:.4f}"
          for k, v in sorted(logs.items())), flush=True)
    if self.writer is not None:
      with self.writer.as_default():
        for key, value in logs.items():
          tf.summary.scalar(key, value, step=epoch)
      self.writer.flush()


class StopOnNonFinite(keras.callbacks.Callback):
  """Stops training after an epoch whose loss is not finite (--stop_on_nan); placed before
  the checkpoint callback, which does not save such an epoch either. `stopped`: (epoch, loss)."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self):
    super().__init__()
    self.stopped = None

  def on_epoch_end(self, epoch, logs=None):
    loss = (logs or {}).get("loss")
    if loss is not None and not math.isfinite(float(loss)) and self.stopped is None:
      self.stopped = (epoch + 1, float(loss))
      self.model.stop_training = True


class ResumeReport(keras.callbacks.Callback):
  """Says, when training starts, that it resumes from a checkpoint (`saver`, restored before
  the first hook) and which saved settings override the command line."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self, config, saver):
    super().__init__()
    self.config, self.saver = config, saver

  def on_train_begin(self, logs=None):
    done = getattr(self.saver, "restored_epoch", None)
    if not done:
      return
    print(f"resuming from {self.saver.restored_path} after epoch {done} of "
          f"{self.config.epochs}", flush=True)
    rate = self.saver.restored_rate
    if rate is not None and not math.isclose(rate, self.config.learning_rate, rel_tol=1e-6):
      print(f"the saved learning rate {rate:g} overrides --learning_rate="
            f"{self.config.learning_rate:g} (the rate in force when the checkpoint was saved; "
            "use a new --checkpoint_dir to start over with yours)", flush=True)


def format_table(config, history, trainer=None, language_model=False):
  """The last epoch's numbers as a two-column table. Its stages are the trainer's, as its
  summary counts them ("interleaved" and "zbv" place several on each device). A
  `language_model`'s loss is per token: its perplexity (exp of the loss) and tokens/s
  (samples/s times --sequence_length) follow."""
  stages, devices = (getattr(trainer, "num_stages", config.num_stages),
                     getattr(trainer, "num_devices", None))
  where = f" on {devices} devices" if devices not in (None, stages) else ""
  rows = [("method", config.method), ("model", config.model), ("dataset", config.dataset),
          ("stages", f"{stages}{where}")]
  for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
    if key in history:
      rows.append((key, f"{history[key][-1]:.4f}"))
  if language_model:
    for key, name in (("loss", "perplexity"), ("val_loss", "val_perplexity")):
      if key in history:
        rows.append((name, f"{math.exp(min(history[key][-1], 700.0)):.3f}"))
  if "samples_per_second" in history:
    rows.append(("samples/s, whole last epoch",
                 f"{history['samples_per_second'][-1]:.1f}"))
    if language_model:
      rows.append(("tokens/s, whole last epoch",
                   f"{history['samples_per_second'][-1] * config.sequence_length:.1f}"))
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
