"""`Pipeline(memory_budget=...)`: cuts whose every device's predicted peak fits its memory.

At the first fit (the batch size and input shapes known) each stage's peak is predicted
(`tfpipe.training.footprint`). Where a device's stages are over the budget, the partitioner's
dynamic program (`tfpipe.plan.balance.min_max`, on the strategy's own layer costs) takes the
fastest cuts among those whose every stage fits, from each layer's predicted share
(`footprint.LayerCosts`); the pipeline is then compiled again on them, and the prediction
for the new stages is checked once more. Cuts the user named are never changed: they are
refused, as is a budget no cuts meet, in one line naming the stage and its predicted peak.
"""

import re

from tfpipe.plan import balance, policies, tasks as task_table
from tfpipe.stage import partition as partition_lib
from tfpipe.training import footprint

__all__ = ["parse", "plan", "check", "recut", "size", "over"]

_UNITS = {"": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def parse(budget):
  """Bytes of `budget`: an integer, or a string such as "3g", "512MiB", "1.5 GB" (binary
  units); None stays None."""
  if budget is None:
    return None
  value = None
  if isinstance(budget, int) and not isinstance(budget, bool):
    value = budget
  elif isinstance(budget, str):
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", budget.lower())
    if found:
      value = int(float(found.group(1)) * _UNITS[found.group(2)])
  if value is None or value <= 0:
    raise ValueError(f"`memory_budget` must be a number of bytes > 0, or a string such as "
                     f"'3g' or '512MiB'. Received: {budget!r}")
  return value


def size(n):
  """`n` bytes in GiB, MiB or KiB, one decimal."""
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{n} B"


def _per_device(pipe, rows):
  """[(device, predicted bytes of its stages, the stage with the largest share)]."""
  totals = {}
  for k, (device, row) in enumerate(zip(pipe.devices, rows)):
    total, top = totals.get(device, (0, k))
    totals[device] = (total + row["total"], top if rows[top]["total"] >= row["total"] else k)
  return [(device, total, top) for device, (total, top) in totals.items()]


def over(pipe, rows):
  """(the largest predicted peak of a device over the budget, its stage with the largest
  share), or None where every device fits; `rows` are `Pipeline.memory`'s."""
  found = [(total, top) for _, total, top in _per_device(pipe, rows)
           if total > pipe.memory_budget]
  return max(found) if found else None


def _parts(row):
  return ", ".join(f"{field} {size(row[field])}" for field in footprint.FIELDS if row[field])


def plan(pipe, batch_size, input_shapes, kept=None):
  """None where the pipeline's cuts fit its `memory_budget` at `batch_size`; else the cuts
  to take. Raises ValueError (one line) when the cuts must stay (`kept`: why) or no cuts
  fit."""
  rows = pipe.memory(batch_size, input_shapes)
  found = over(pipe, rows)
  if found is None:
    return None
  peak, k = found
  budget, K = pipe.memory_budget, len(rows)
  head = (f"memory_budget={size(budget)}: stage {k} is predicted to peak at {size(peak)} "
          f"with the cuts {list(pipe.partition.cuts)} ({_parts(rows[k])}) at batch {batch_size}")
  if kept:
    raise ValueError(f"{head}; {kept}, so they stay: cut elsewhere, use more devices, or a "
                     "smaller batch")
  model = partition_lib.cuttable(pipe.model, K)
  unit = -(-batch_size // (pipe.micro_batches or 1))
  costs = footprint.LayerCosts(model, unit, input_shapes)
  states, versions, accumulating = footprint.counts(pipe)
  as_rows = footprint.rows_reach_optimizer(pipe, accumulating)
  current = 0 if task_table.ops(pipe.policy)["F"].reads == "predicted" else 1
  trainable = sum(r["gradients"] for r in rows)
  slots = sum(r["optimizer"] for r in rows) / trainable if trainable else 0.0
  # Interleaved, V: V stages per device, and its runtime once.
  share = (budget - footprint.RUNTIME) / (K // len(set(pipe.devices)))

  def fits(j, a, b, recompute=pipe.policy.recompute):
    return costs.stage(j, a, b, states[j], versions[j] - current, slots, accumulating,
                       recompute, as_rows) <= share

  try:
    return balance.min_max(pipe.partition.costs, K, fits=fits)
  except balance.NoFit:
    hint = ""
    if not pipe.policy.recompute and pipe.policy.method in policies.SYNCHRONOUS_METHODS:
      try:
        balance.min_max(pipe.partition.costs, K,
                        fits=lambda j, a, b: fits(j, a, b, recompute=True))
        hint = "; with recompute=True some would"
      except balance.NoFit:
        pass
    raise ValueError(f"{head}, and no cuts of its {len(costs.kept)} layers into {K} stages "
                     f"fit{hint}; use more devices, a smaller batch or more micro-batches "
                     "(Pipeline.memory() itemises each stage's prediction)") from None


def check(pipe, batch_size, input_shapes):
  """Refuses (one line) a pipeline whose predicted peak on some device is over its budget."""
  rows = pipe.memory(batch_size, input_shapes)
  found = over(pipe, rows)
  if found is not None:
    peak, k = found
    raise ValueError(f"memory_budget={size(pipe.memory_budget)}: stage {k} is predicted to "
                     f"peak at {size(peak)} with the cuts {list(pipe.partition.cuts)} "
                     f"({_parts(rows[k])}) at batch {batch_size}, the closest the layers' "
                     "shares allowed; use more devices, a smaller batch or more "
                     "micro-batches")


def recut(pipe, kept, verbose=0):
  """Before a fit trains: where `plan` moves `pipe`'s cuts (`kept`: why they may not move,
  or None), cuts `pipe` there and compiles it again, checks the new stages' prediction, and
  says so in a line unless `verbose` is 0."""
  cuts = plan(pipe, pipe.batch_size, pipe.input_shapes, kept)
  if cuts is None:
    return
  before = list(pipe.partition.cuts)
  pipe.partition = partition_lib.from_cuts(
      partition_lib.cuttable(pipe.model, pipe.num_stages), cuts, pipe.partition.costs)
  partition_lib.check_shared(pipe.model, pipe.partition, pipe.method,
                             policies.SYNCHRONOUS_METHODS)
  pipe.recompile()
  check(pipe, pipe.batch_size, pipe.input_shapes)
  if verbose != 0:
    peaks = ", ".join(size(row["total"]) for row in pipe.memory())
    print(f"memory_budget={size(pipe.memory_budget)}: cut at {list(cuts)} (was {before}); "
          f"predicted peaks per stage {peaks}")
