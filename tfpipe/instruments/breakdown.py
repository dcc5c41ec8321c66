"""Time breakdown per stage from a recorded timeline (SpecTrain paper section 4.3, fig. 10).

K: stages, k: stage index. The wall time of a window splits, per stage, into
  compute:        the stage's tasks (F, B, W, FB, U); transfers that overlap
                  them are hidden and count here, as in the paper;
  transfer:       waiting while the awaited tensor is being copied across
                  the link (P2P transfer time not hidden by compute);
  idle_transfer:  waiting although the tensor is ready: it is queued behind
                  other transfers or being handed over (P2P-induced idle);
  idle_imbalance: waiting because the neighbour has not produced it yet,
                  at a barrier, for input data, or after the stage's last
                  task (imbalance-induced idle).
A wait is attributed through the task that ends it: a forward waits for
stage k-1's forward of its unit, a backward or an early receive R for stage
k+1's gradient, the last stage's FB for its last input. Tasks of one stage
that overlap in time (the compiled executor's, inside a graph) count their
union as compute. Works on
`tfpipe.runtime.TaskRecord`s (a `Pipeline(record=True)` run) or any records
with the same fields; pure Python.
"""

import dataclasses

__all__ = ["CATEGORIES", "Breakdown", "breakdown", "combine", "of_epochs", "format_breakdown"]

CATEGORIES = ("compute", "transfer", "idle_transfer", "idle_imbalance")
_COMPUTE = ("F", "B", "W", "FB", "U")


@dataclasses.dataclass
class Breakdown:
  seconds: float   # the window's wall time
  shares: list     # per stage: {category: share of `seconds`}, summing to 1

  def scalars(self):
    """{"breakdown/stage{k}/{category}": share} for TensorBoard."""
    return {f"breakdown/stage{k}/{c}": v for k, s in enumerate(self.shares) for c, v in s.items()}


def _overlap(a0, a1, b0, b1):
  return max(0.0, min(a1, b1) - max(a0, b0))


def _index(records, K):
  """(kind, stage, epoch, batch, micro) -> record, for the tasks that produce or move tensors;
  and (epoch, batch) -> the transfers into the last stage."""
  index, into_last = {}, {}
  for r in records:
    index[(r.kind, r.stage, r.epoch, r.batch, r.micro)] = r
    if r.kind == "FB":
      index[("B", r.stage, r.epoch, r.batch, r.micro)] = r
    if r.kind == "XF" and r.stage == K - 2:
      into_last.setdefault((r.epoch, r.batch), []).append(r)
  return index, into_last


def _awaited(r, K, index, into_last, received):
  """(producer record, transfer record) of the tensor whose arrival ends the wait before r."""
  key = (r.epoch, r.batch, r.micro)
  if r.kind == "F" and r.stage > 0:
    return index.get(("F", r.stage - 1) + key), index.get(("XF", r.stage - 1) + key)
  if r.kind == "FB" and K > 1:  # the last of the inputs it covers
    moves = [x for x in into_last.get((r.epoch, r.batch), [])
             if r.micro is None or x.micro == r.micro]
    if moves:
      last = max(moves, key=lambda x: x.end)
      return index.get(("F", K - 2, r.epoch, r.batch, last.micro)), last
    return None, None
  if r.kind == "R" or (r.kind == "B" and r.stage < K - 1 and key not in received):
    return index.get(("B", r.stage + 1) + key), index.get(("XB", r.stage + 1) + key)
  return None, None


def breakdown(records, num_stages, window=None):
  """The per-stage `Breakdown` of `records` over `window` = (t0, t1) (default: all of them)."""
  records = list(records)
  if not records:
    raise ValueError("no records to break down: run the pipeline with record=True")
  t0 = min(r.start for r in records) if window is None else window[0]
  t1 = max(r.end for r in records) if window is None else window[1]
  if t1 <= t0:
    raise ValueError(f"the window must have t1 > t0. Received: ({t0}, {t1})")
  index, into_last = _index(records, num_stages)
  shares = []
  for k in range(num_stages):
    own = sorted((r for r in records if r.stage == k and r.kind in _COMPUTE + ("R", "S")),
                 key=lambda r: r.start)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    received, cursor = set(), t0

    def wait(g0, g1, producer, move):
      if g1 <= g0:
        return
      ready = producer.end if producer is not None else g1
      totals["idle_imbalance"] += _overlap(g0, g1, float("-inf"), ready)
      if move is None:
        totals["idle_transfer"] += _overlap(g0, g1, ready, float("inf"))
        return
      totals["transfer"] += _overlap(g0, g1, max(ready, move.start), move.end)
      totals["idle_transfer"] += (_overlap(g0, g1, ready, move.start) +
                                  _overlap(g0, g1, max(ready, move.end), float("inf")))

    for r in own:
      producer, move = _awaited(r, num_stages, index, into_last, received)
      if r.kind in ("R", "S"):
        wait(max(cursor, t0), min(r.end, t1), producer, move)
        if r.kind == "R":
          received.add((r.epoch, r.batch, r.micro))
      else:
        wait(max(cursor, t0), min(r.start, t1), producer, move)
        totals["compute"] += _overlap(max(r.start, cursor), r.end, t0, t1)   # tasks may overlap
      cursor = max(cursor, r.end)
    totals["idle_imbalance"] += max(0.0, t1 - max(cursor, t0))
    shares.append({c: v / (t1 - t0) for c, v in totals.items()})
  return Breakdown(t1 - t0, shares)


def combine(results):
  """One `Breakdown` of several windows (e.g. the epochs of a fit), weighted by their time."""
  results = list(results)
  seconds = sum(r.seconds for r in results)
  K = len(results[0].shares)
  shares = [{c: sum(r.shares[k][c] * r.seconds for r in results) / seconds for c in CATEGORIES}
            for k in range(K)]
  return Breakdown(seconds, shares)


def of_epochs(records, chosen, num_stages):
  """The breakdown of the `chosen` records' span in each epoch (from their first start to their
  last end), over all of a fit's `records`, combined over epochs."""
  windows = {}
  for r in chosen:
    lo, hi = windows.get(r.epoch, (r.start, r.end))
    windows[r.epoch] = (min(lo, r.start), max(hi, r.end))
  return combine(breakdown(records, num_stages, w) for w in windows.values())


def format_breakdown(result, title="time breakdown (share of wall time)"):
  """The breakdown as a table, one row per stage."""
  rows = [title, f"{'stage':<8}" + "".join(f"{c:>16}" for c in CATEGORIES)]
  for k, s in enumerate(result.shares):
    rows.append(f"{k:<8}" + "".join(f"{100 * s[c]:>15.1f}%" for c in CATEGORIES))
  return "\n".join(rows)
