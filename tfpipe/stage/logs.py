"""What the last stage reports: Keras's loss and metrics, and the running logs of a step.

The loss and metric containers are those `keras.Model.compile` builds
(`tfpipe.stage.keras_step.KerasStep`); the logged loss adds the regularisation the earlier
stages' forwards recorded (`reg_trackers`), as Keras adds every layer's losses to its loss.
"""

from typing import Any, Dict, Optional, Sequence, Tuple

import keras
import tensorflow as tf

__all__ = ["Logs"]


class Logs:
  """The last stage's `loss`, `metrics` and `loss_tracker`; `output_structure`: the model's
  outputs (one tensor, or a list or dict of several) as Keras's loss and metrics take them;
  `in_xla`: its tasks run under XLA, which reads no variable of another device."""

  def __init__(self, loss: Any, metrics: Sequence[Any], loss_tracker: Any,
               reg_trackers: Optional[Sequence[Any]], output_structure: Any, in_xla: bool) -> None:
    self.loss, self.metrics, self.loss_tracker = loss, list(metrics), loss_tracker
    self.reg_trackers, self.output_structure = list(reg_trackers or []), output_structure
    self.in_xla = in_xla

  def structured(self, ys: Sequence[Any], y: Any) -> Tuple[Any, Any]:
    """(labels, outputs) as Keras's loss and metrics take them: for one output the tensors
    themselves, for several the model's output structure of each."""
    if self.output_structure is None or len(ys) == 1:
      return (y[0] if isinstance(y, (list, tuple)) and len(ys) == 1 and len(y) == 1 else y,
              ys[0])

    def pack(values: Any) -> Any:
      return keras.tree.pack_sequence_as(self.output_structure, list(values))
    return pack(y), pack(ys)

  def update(self, y: Any, y_pred: Any, loss: Any, sample_weight: Any) -> None:
    """The running loss and metrics after a batch."""
    if self.loss_tracker is not None:
      first = keras.tree.flatten(y_pred)[0]
      self.loss_tracker.update_state(loss, sample_weight=tf.shape(first)[0])
    for metric in self.metrics:
      metric.update_state(y, y_pred, sample_weight=sample_weight)

  def results(self, in_task: bool = False) -> Dict[str, Any]:
    """The running loss and metric results (what Keras passes to batch hooks). The loss adds
    the earlier stages' regularisation; in an XLA task (`in_task`) that is added outside it
    (`completed`)."""
    loss = self.loss_tracker.result()
    if not (in_task and self.in_xla):
      loss = self._with_reg(loss)
    logs = {"loss": loss}
    # Keras's order: the loss, the compiled metrics, then each output's loss (several outputs).
    for metric in self.metrics + list(getattr(self.loss, "metrics", None) or []):
      result = metric.result()
      if isinstance(result, dict):
        logs.update(result)
      else:
        logs[metric.name] = result
    return logs

  def completed(self, out: Any) -> Any:
    """`out` (a task's logs, or a tuple ending with them) with the other stages'
    regularisation added to the loss outside an XLA task; as it is otherwise (the task
    added it)."""
    if not (self.in_xla and self.reg_trackers):
      return out
    logs = out if isinstance(out, dict) else out[-1]
    logs = dict(logs, loss=self._with_reg(logs["loss"]))
    return logs if isinstance(out, dict) else tuple(out[:-1]) + (logs,)

  def _with_reg(self, loss: Any) -> Any:
    for tracker in self.reg_trackers:
      loss = loss + tf.cast(tracker.result(), loss.dtype)
    return loss
