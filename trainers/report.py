"""What the trainer shows: a line per epoch, TensorBoard scalars, a summary table."""

import os

import keras
import tensorflow as tf

__all__ = ["EpochReport", "format_table"]


class EpochReport(keras.callbacks.Callback):
  """Prints each epoch's logs (verbose >= 2) and writes them as scalars under `logdir/method`."""

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


def format_table(config, history):
  """The last epoch's numbers as a two-column table."""
  rows = [("method", config.method), ("model", config.model), ("dataset", config.dataset),
          ("stages", str(config.num_stages))]
  for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
    if key in history:
      rows.append((key, f"{history[key][-1]:.4f}"))
  if "samples_per_second" in history:
    rows.append(("samples/s, whole last epoch",
                 f"{history['samples_per_second'][-1]:.1f}"))
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
