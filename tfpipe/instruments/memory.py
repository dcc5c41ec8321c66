"""Per-stage memory of a trained pipeline: weights, weight versions, activations, optimizer.

k: stage index, M: micro-batches. Bytes are counted from what the run held:
  weights:      the stage's variables;
  versions:     copies of the trainable weights kept for backwards beyond the
                current weights, at the peak the runtime measured: PipeDream's
                stashed older versions (the newest kept forward read the
                current weights), or SpecTrain's reused predictions (each its
                own tensor);
  activations:  the peak count of kept forward states the runtime measured,
                times one state: the outputs of every layer of the stage
                (a gradient tape's saved tensors) or, for methods that
                recompute, the stage's inputs and, while a backward runs, the
                one tape it rebuilds (a unit's layer outputs); one unit is a
                micro-batch. The last stage runs forward and backward as one
                step, which holds the tape of every forward it joins (one unit,
                or a mini-batch's M);
  optimizer:    the optimizer's slots (SpecTrain's smoothed gradient,
                momentum) and counters;
  accumulators: gradient accumulators of micro-batched methods.
The per-sample sizes come from the layers' static output shapes.
"""

import keras
import numpy as np

from tfpipe.plan import tasks as task_table

__all__ = ["FIELDS", "stage_memory", "format_memory", "variable_bytes"]

FIELDS = ("weights", "versions", "activations", "optimizer", "accumulators")


def _itemsize(dtype):
  return np.dtype(getattr(dtype, "as_numpy_dtype", dtype)).itemsize  # numpy, Keras or tf dtypes


def variable_bytes(variables):
  """Bytes of `variables` (Keras or TensorFlow variables)."""
  return sum(int(np.prod(v.shape)) * _itemsize(v.dtype) for v in variables)


def _per_sample(tensors):
  """Bytes per sample of symbolic tensors (the batch axis left out)."""
  total = 0
  for t in tensors:
    shape = [d if d is not None else 1 for d in t.shape[1:]]
    total += int(np.prod(shape)) * _itemsize(t.dtype)
  return total


def _layer_outputs(model):
  """The outputs of every layer of a stage but its inputs (what a tape keeps, at most)."""
  outputs = []
  for layer in model.layers:
    if isinstance(layer, keras.layers.InputLayer):
      continue
    try:
      outputs += keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):  # a layer used more than once or without a node
      continue
  return outputs


def stage_memory(pipeline, batch_size):
  """Per stage, {field: bytes} and "total", after `pipeline.fit` at `batch_size`."""
  if pipeline.runtime is None:
    raise RuntimeError("compile and fit the pipeline first: the peaks are measured by the run")
  unit = -(-batch_size // pipeline.micro_batches)
  ops = task_table.ops(pipeline.policy)
  extra_current = 0 if ops["F"].reads == "predicted" else 1
  result = []
  for k, program in enumerate(pipeline.programs):
    weights = variable_bytes(program.trainable) + variable_bytes(program.non_trainable)
    trainable = variable_bytes(program.trainable)
    # A forward keeps its tape, or its inputs only, and then the backward rebuilds one tape
    # (held while it runs, on top of the inputs kept); the last stage's step builds the tape
    # of every forward it joins, whatever the method keeps.
    inputs, outputs = _per_sample(program.model.inputs), _per_sample(_layer_outputs(program.model))
    kept = pipeline.runtime.peak_saved[k]
    if ops["F"].keeps != "tape" and not program.is_last:
      activations = (kept * inputs + (outputs if kept else 0)) * unit
    else:
      activations = kept * (inputs + outputs) * unit
    row = {
        "weights": weights,
        "versions": max(0, pipeline.runtime.peak_versions[k] - extra_current) * trainable,
        "activations": activations,
        "optimizer": variable_bytes(program.optimizer.variables),
        "accumulators": variable_bytes(program.updates.accumulators or []),
    }
    row["total"] = sum(row.values())
    result.append(row)
  return result


def format_memory(rows_by_method, unit=1024.0, label="KiB"):
  """A table: one row per method and stage, one column per field, in `label`."""
  head = f"{'method':<16}{'stage':>6}" + "".join(f"{f:>14}" for f in FIELDS + ("total",))
  lines = [f"per-stage memory ({label})", head]
  for method, rows in rows_by_method.items():
    for k, row in enumerate(rows):
      lines.append(f"{method:<16}{k:>6}" +
                   "".join(f"{row[f] / unit:>14.1f}" for f in FIELDS + ("total",)))
  return "\n".join(lines)
