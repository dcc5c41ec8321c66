"""`Pipeline.summary()`: a table as `keras.Model.summary()` prints one, a row per stage."""

import math
import textwrap

from tfpipe.training import memory_budget

__all__ = ["lines"]

_WIDTHS = (6, 44, 38, 11)   # stage, devices, layers, parameters
_HEADER = ("Stage", "Device", "Layers", "Param #")


def lines(pipe):
  """The summary's lines: the method line, a row per stage (its devices, layers and
  parameters), then the model's totals (a weight several stages hold counted once)."""
  width = sum(_WIDTHS) + len(_WIDTHS) - 1
  line = pipe.options.describe(pipe.num_stages, pipe.num_devices)
  if pipe.choosing or pipe.chosen is not None:   # method="auto": what it will do, or did
    line = pipe.describe() if pipe.choosing else line + "; chosen by method='auto'"
  out = [f'Pipeline "{pipe.model.name}": ' + line,
         "_" * width, _row(_HEADER), "=" * width]
  for k, (devices, layers) in enumerate(zip(pipe.stage_devices, pipe.partition.layer_names)):
    where = (devices[0] if len(devices) == 1
             else f"{len(devices)} replicas on {', '.join(devices)}")
    params = pipe.partition.stages[k].count_params()
    out += _rows((str(k), where, ", ".join(layers), f"{params:,}"))
    out.append(("_" if k < pipe.num_stages - 1 else "=") * width)
  trainable = sum(math.prod(w.shape) for w in pipe.model.trainable_weights)
  total = sum(math.prod(w.shape) for w in pipe.model.weights)
  out += [f" Total params: {total:,}", f" Trainable params: {trainable:,}",
          f" Non-trainable params: {total - trainable:,}"]
  return out + memory_lines(pipe)


def plan_lines(pipe):
  """`Pipeline.plan_report`'s lines: method="auto"'s choice, its candidates, and the chosen
  pipeline's predicted memory per stage."""
  if pipe.auto is None:
    raise ValueError(f"plan_report() describes method='auto's choice; this pipeline runs "
                     f"method={pipe.method!r}, which was not chosen")
  if pipe.chosen is None:
    raise RuntimeError("method='auto' chooses at the first fit: call fit first")
  return [pipe.chosen.summary()] + pipe.chosen.lines + memory_lines(pipe)


def memory_lines(pipe):
  """Each stage's predicted peak memory (`Pipeline.memory`), where the pipeline is compiled
  and its batch size and input shapes are known; else nothing."""
  if not getattr(pipe, "programs", None) or pipe.batch_size is None:
    return []
  try:
    rows = pipe.memory()
  except ValueError:   # an input dimension still unknown (fit once to know it)
    return []
  peaks = ", ".join(f"{k}: {memory_budget.size(row['total'])}" for k, row in enumerate(rows))
  return [f" Predicted peak memory per stage (batch {pipe.batch_size}): {peaks}"]



def _row(cells):
  return " ".join(cell.ljust(w) for cell, w in zip(cells, _WIDTHS)).rstrip()


def _rows(cells):
  """A stage's row, its devices and layers wrapped within their columns."""
  wrapped = [textwrap.wrap(cell, w - 1, break_on_hyphens=False) or [""]
             for cell, w in zip(cells, _WIDTHS)]
  depth = max(len(w) for w in wrapped)
  return [_row([w[i] if i < len(w) else "" for w in wrapped]) for i in range(depth)]
