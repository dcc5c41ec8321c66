"""Weight-prediction error (SpecTrain paper fig. 8): how close the weight prediction comes.

s: updates ahead, W_t: a stage's weights after its t-th update, d_t: the step
its optimizer predicts with then (`tfpipe.rules.prediction`: eta * v_t for SpecTrain,
v_t its smoothed gradient and eta the learning rate; -m_t for momentum SGD;
Adam's bias-corrected m / (sqrt(v) + eps) step). After every update t the
recorder compares, for each s in `horizons`,
  predicted: RMSE(W_{t-s} - s * d_{t-s}, W_t)   (the SpecTrain paper eq. 4; PipeOptim)
  stale:     RMSE(W_{t-s}, W_t)                  (what vanilla reads)
over all of the stage's weights. Works in a `Pipeline(prediction_error=...)`
(per stage, after each of its updates) and in plain `model.fit` through
`PredictionErrorCallback` (key "model"), with any optimizer `tfpipe.rules.prediction`
predicts with.
"""

import collections
import threading

import keras
import numpy as np
import tensorflow as tf

from tfpipe.rules import prediction

__all__ = ["PredictionError", "PredictionErrorCallback", "check"]


def check(optimizer):
  """Raises a clear error when `optimizer` has no step to predict with."""
  try:
    prediction.check(optimizer)
  except ValueError as error:
    raise ValueError(f"the prediction error measures weight prediction: {error}") from None


def _rmse(a, b):
  squares = sum(float(np.sum(np.square(x.astype(np.float64) - y))) for x, y in zip(a, b))
  count = sum(x.size for x in a)
  return float(np.sqrt(squares / count)) if count else 0.0


class PredictionError:
  """Records predicted and stale RMSE for each key (a stage index) and horizon s."""

  def __init__(self, horizons=(1, 2, 3)):
    horizons = tuple(horizons)
    if not horizons or any(not isinstance(s, int) or isinstance(s, bool) or s < 1
                           for s in horizons):
      raise ValueError(f"`horizons` must be positive integers. Received: {horizons!r}")
    self.horizons = horizons
    self._history = collections.defaultdict(lambda: collections.deque(maxlen=max(horizons) + 1))
    self._updates = collections.Counter()
    self.series = collections.defaultdict(list)   # (key, s) -> [(t, predicted, stale)]
    self._lock = threading.Lock()                  # stages observe from their own threads

  def observe_steps(self, key, weights, steps):
    """After update t of `key`: its weights and the step d each would be predicted with."""
    weights = [np.array(w, copy=True) for w in weights]
    steps = [np.array(d, copy=True) for d in steps]
    with self._lock:
      self._observe(key, weights, steps)

  def _observe(self, key, weights, steps):
    history = self._history[key]
    self._updates[key] += 1
    t = self._updates[key]
    for s in self.horizons:
      if len(history) >= s:
        old_w, old_d = history[-s]
        predicted = [w - s * d for w, d in zip(old_w, old_d)]
        self.series[(key, s)].append((t, _rmse(predicted, weights), _rmse(old_w, weights)))
    history.append((weights, steps))

  def observe_optimizer(self, key, variables, optimizer):
    """`observe_steps` from Keras variables and their optimizer: the step is the one
    `tfpipe.rules.prediction` predicts with (W minus the weights predicted one update ahead)."""
    check(optimizer)
    weights = [v.numpy() for v in variables]
    ahead = prediction.predict_all(optimizer, variables, 1)
    self.observe_steps(key, weights,
                       [w - keras.ops.convert_to_numpy(p) for w, p in zip(weights, ahead)])

  def summary(self):
    """{s: (mean predicted RMSE, mean stale RMSE)} over every key and update."""
    result = {}
    for s in self.horizons:
      rows = [r for (key, h), rs in self.series.items() if h == s for r in rs]
      if rows:
        result[s] = (float(np.mean([r[1] for r in rows])), float(np.mean([r[2] for r in rows])))
    return result

  def write_summaries(self, logdir):
    """TensorBoard scalars prediction_error/{key}/s{s}/{predicted,stale} per update."""
    with tf.summary.create_file_writer(logdir).as_default():
      for (key, s), rows in sorted(self.series.items(), key=str):
        for t, predicted, stale in rows:
          tf.summary.scalar(f"prediction_error/{key}/s{s}/predicted", predicted, step=t)
          tf.summary.scalar(f"prediction_error/{key}/s{s}/stale", stale, step=t)

  def plot(self, path, title="weight prediction error (SpecTrain fig. 8)"):
    """A PNG: RMSE per update, predicted (solid) and stale (dashed), per horizon s."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    keys = sorted({key for key, _ in self.series}, key=str)
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.5),
                             squeeze=False)
    for ax, key in zip(axes[0], keys):
      for s in self.horizons:
        rows = self.series.get((key, s), [])
        if rows:
          t = [r[0] for r in rows]
          line, = ax.plot(t, [r[1] for r in rows], label=f"predicted, s={s}")
          ax.plot(t, [r[2] for r in rows], "--", color=line.get_color(), label=f"stale, s={s}")
      ax.set_title(f"stage {key}" if isinstance(key, int) else str(key))
      ax.set_xlabel("update")
      ax.set_ylabel("RMSE to the weights reached")
      ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class PredictionErrorCallback(keras.callbacks.Callback):
  """Feeds a `PredictionError` after each batch of `model.fit` (an optimizer that
  `tfpipe.rules.prediction` predicts with: SpecTrain, momentum SGD, Adam, AdamW)."""

  def __init__(self, recorder):
    super().__init__()
    self.recorder = recorder

  def on_train_batch_end(self, batch, logs=None):
    self.recorder.observe_optimizer("model", self.model.trainable_variables,
                                    self.model.optimizer)
