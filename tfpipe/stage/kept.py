"""What a stage's forward keeps for its backward (`Kept`), what a backward returns
(`Backward`), and the gradient arithmetic every part of a stage shares.
"""

import collections
from typing import Any, List, Sequence

import keras
import tensorflow as tf

from tfpipe import compat

__all__ = ["Kept", "Backward", "joined", "scaled", "summed", "is_float", "embeds",
           "embedding_layers"]

Kept = collections.namedtuple(
    "Kept", ["xs", "state", "weights", "tape", "ys", "reg", "labels", "grads", "residuals"],
    defaults=(None, None, None, None, None, None, None, None))
Kept.__doc__ = """What a forward keeps for its backward (`tfpipe.plan.tasks` `keeps`): its
inputs `xs` and the non-trainable `state` it read (its random draws, which a recompute replays);
the `weights` it read (for "tape" and "weights"); for "tape" also the gradient `tape`
(persistent when the backward runs as two halves) with its outputs `ys` and regularisation
`reg`, or, for a forward called from a compiled window's graph, its `residuals`: the forward's
tensors its gradient reads, which the call output (`compat.ResidualCall`), so the backward needs
no tape and may run in a later window. `StageProgram.carried` is what a compiled window carries
across its boundary: the residuals packed into one tensor, or without a tape the inputs, state
and weights, from which the backward then recomputes the forward (the same values). The last
stage's forward keeps its inputs and `labels` ((labels, sample weights)) for its step. After a
split backward's input half traced into one graph with its weight half (`StageProgram.inlined`),
`grads`: the weight gradients it took in the same walk of the tape, which the weight half
applies."""

Backward = collections.namedtuple("Backward", ["dxs", "loss", "logs", "kept"],
                                  defaults=(None, None, None))
Backward.__doc__ = """What a backward returns: the input gradients `dxs`; at the last stage
also the step's `loss` and the running `logs`, and after a split step's input half the
`kept` tape its weight half reads."""


def joined(parts: Sequence[Kept]) -> Kept:
  """The last stage's kept forwards `parts` as one batch (a TiMePReSt mini-batch's step
  covers several): their inputs and labels concatenated along the batch axis."""
  if len(parts) == 1:
    return parts[0]

  def cat(values: Sequence[Any]) -> Any:
    if values[0] is None:
      return None
    if isinstance(values[0], (list, tuple)):
      return [None if p[0] is None else tf.concat(p, 0) for p in zip(*values)]
    return tf.concat(values, 0)
  return parts[0]._replace(xs=cat([p.xs for p in parts]),
                           labels=tuple(cat([p.labels[i] for p in parts]) for i in (0, 1)))


def scaled(grad: Any, scale: Any) -> Any:
  """`grad` (a tensor or IndexedSlices) times `scale`, in the gradient's dtype."""
  if isinstance(scale, (int, float)) and scale == 1:
    return grad
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * tf.cast(scale, grad.values.dtype), grad.indices,
                            grad.dense_shape)
  return grad * tf.cast(scale, grad.dtype)


def summed(grads: Sequence[Any]) -> Any:
  """The sum of one weight's gradients from several parts; IndexedSlices (an embedding's)
  join as the tape joins them (their rows concatenated)."""
  if all(isinstance(g, tf.IndexedSlices) for g in grads):
    return tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                            tf.concat([g.indices for g in grads], 0), grads[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def is_float(t: Any) -> bool:
  return bool(tf.as_dtype(t.dtype).is_floating)


def embedding_layers(model: Any) -> List[Any]:
  """The trainable `Embedding` layers of `model`, nested ones too."""
  return [layer for layer in compat.all_layers(model)
          if isinstance(layer, keras.layers.Embedding) and layer.trainable]


def embeds(model: Any) -> bool:
  """Whether `model` (a stage) has a trainable embedding, whose gradient comes as rows."""
  return bool(embedding_layers(model))
