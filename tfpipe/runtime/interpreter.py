"""One interpreter of a stage's actions: what each op of the task table does, written once.

K: stages, k: stage, b: mini-batch, s: version difference. An action is one task of one stage
as the schedule orders it (`tfpipe.plan.schedules.Action`); the stage's weight policy says
which op it runs (`tfpipe.plan.tasks`). Both executors run every action through `run`; they
differ only in how values move (`Moves`): the threaded executor's bounded links between
threads, the compiled executor's tensors within one traced window.
"""

import collections
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from tfpipe.plan import records, schedules
from tfpipe.runtime.protocol import StageProtocol

__all__ = ["Saved", "Stage", "Moves", "run", "Micro"]

Micro = Optional[int]   # a unit's micro-batch (None: the whole mini-batch)

Saved = collections.namedtuple("Saved", ["kept", "version", "share", "s"], defaults=[0])
Saved.__doc__ = """A forward waiting for its backward: what the stage kept
(`tfpipe.stage.program.Kept`), the weight version it read (None where the executor does not
count versions, and at the last stage, whose backward reads the weights: its step), the
micro-batch's share of its mini-batch and the forward's version difference (which the last
stage's step reads)."""


class Stage:
  """What one stage keeps between its actions: forwards waiting for their backward (`saved`;
  at the last stage its inputs and labels, which its backward steps on), the output gradients
  a split backward's weight half reads (`halves`), per mini-batch the loss of its
  micro-batches so far (`losses`), and the running logs of its latest step (`logs`)."""

  def __init__(self, k: int, program: StageProtocol, last: bool):
    self.k, self.program, self.last = k, program, last
    self.saved: Dict[schedules.Unit, Saved] = {}
    self.halves: Dict[schedules.Unit, Any] = {}   # a split backward's output gradients
    self.losses: Dict[int, Any] = {}
    self.logs: Any = None


class Moves:
  """How values move between stages and actions: what an executor provides `run`.

  A share is a micro-batch's fraction of its mini-batch as the executor carries it (a float,
  or a float64 tensor); `weight` makes it what a stage task takes.
  """
  def take_input(self, k: int, b: int, micro: Micro) -> Tuple[Any, Any, Any]:
    """(inputs, share, labels) of stage k's forward of unit (b, micro); labels: (labels,
    sample weights) at the last stage, else None."""
    raise NotImplementedError

  def take_gradient(self, k: int, b: int, micro: Micro) -> Any:
    """The output gradients of stage k's backward of unit (b, micro)."""
    raise NotImplementedError

  def send_output(self, k: int, b: int, micro: Micro, ys: Any, share: Any) -> None:
    """Stage k's forward outputs of (b, micro), to stage k + 1."""
    raise NotImplementedError

  def send_gradient(self, k: int, b: int, micro: Micro, dxs: Any) -> None:
    """Stage k's input gradients of (b, micro), to stage k - 1."""
    raise NotImplementedError

  def receive(self, k: int, b: int, micro: Micro) -> None:
    """An R task: stage k takes its output gradients early (DDG); nothing where data orders it."""

  def barrier(self, b: int) -> None:
    """An S task: every stage meets (lockstep); nothing where data orders it."""

  def update(self, program: StageProtocol, b: int) -> None:
    """Applies stage `program`'s accumulated gradients of mini-batch b."""
    program.update()

  def weight(self, k: int, share: Any) -> Any:
    return share

  def total(self, shares: Sequence[Any]) -> Any:
    """The share of several units together."""
    return sum(shares)

  def add_loss(self, total: Any, loss: Any, share: Any) -> Any:
    """A mini-batch's loss so far (None: nothing yet) with a micro-batch's loss added."""
    raise NotImplementedError

  def finished(self, b: int, loss: Any, logs: Any) -> None:
    """Mini-batch b's loss and the running logs, once its last stage is done with it."""
    raise NotImplementedError

  # Bookkeeping of the executors that count versions and time tasks (the threaded one).

  def version(self, k: int, s: int) -> Any:
    """The weight version a task of stage k with version difference s reads, or None."""
    return None

  def current(self, k: int) -> Optional[int]:
    """Stage k's update count now, or None."""
    return None

  def updated(self, k: int) -> None:
    """Stage k applied an update."""

  def record(self, k: int, kind: str, action: schedules.Task, version: Any, s: int,
             start: float) -> None:
    """Task `action` ran as `kind` (`tfpipe.plan.records.TaskRecord`'s kinds) from `start`."""

  def saved(self, stage: Stage) -> None:
    """Stage `stage` kept a forward, or held one for its step (its peak of kept forwards)."""


def run(action: schedules.Action, stage: Stage, moves: Moves) -> None:
  """Runs `action` (`schedules.Action`) on `stage` (`Stage`), moving values with `moves`.

  Every stage runs the same ops. The last one's forward only keeps its inputs and labels, so
  it is not recorded and sends nothing; its backward (its step: forward, loss and backward)
  takes no output gradients, reads the forward's version difference, and ends its mini-batch's
  loss."""
  k, task, s, units = action
  kind, b, micro = task
  program, unit = stage.program, (b, micro)
  op = program.ops[kind].op   # tfpipe.plan.tasks
  start = time.perf_counter()
  if op == "forward":
    xs, share, labels = moves.take_input(k, b, micro)
    start = time.perf_counter()
    ys, kept = program.forward(xs, s, labels)
    version = None if stage.last else moves.version(k, s)
    stage.saved[unit] = Saved(kept, version, share, s)
    moves.saved(stage)
    if not stage.last:
      moves.record(k, "F", task, version, s, start)
      moves.send_output(k, b, micro, ys, share)
  elif op == "receive":
    moves.receive(k, b, micro)
    moves.record(k, "R", task, moves.current(k), s, start)
  elif op == "barrier":
    moves.barrier(b)
    moves.record(k, "S", task, moves.current(k), s, start)
  elif op == "update":
    moves.update(program, b)
    moves.record(k, "U", task, moves.current(k), s, start)
    moves.updated(k)
    if stage.last:
      moves.finished(b, stage.losses.pop(b), stage.logs)
  elif op == "backward_weights":   # a split backward's weight half: its B kept state and dys
    part = stage.saved.pop(unit)
    program.backward_weights([part.kept], stage.halves.pop(unit), s,
                             moves.weight(k, part.share), True)
    version = part.version if stage.last else _version(program, [part], k, moves)
    moves.record(k, "W", task, version, s, start)
  else:   # "backward", or a split backward's input half ("backward_input")
    _backward(op, action, stage, moves, start)


def _backward(op: str, action: schedules.Action, stage: Stage, moves: Moves,
              start: float) -> None:
  """A backward (the last stage's step) or a split backward's input half."""
  k, task, s, units = action
  kind, b, micro = task
  program, split, unit = stage.program, op == "backward_input", (b, micro)
  dys = None if stage.last else moves.take_gradient(k, b, micro)
  start = start if stage.last else time.perf_counter()
  parts = [stage.saved[u] if split else stage.saved.pop(u) for u in units]
  kept, share = [p.kept for p in parts], moves.total([p.share for p in parts])
  if stage.last:   # the step reads the weights now, at its forward's version difference
    s = parts[0].s
    version = moves.version(k, s)
  else:
    version = _version(program, parts, k, moves)
  if split:
    stage.halves[unit] = dys
    done = program.backward_input(kept, dys, s, moves.weight(k, share))
    if done.kept is not None:   # it took the weight gradients too: its weight half's
      part = stage.saved[unit]._replace(kept=done.kept)
      stage.saved[unit] = part._replace(version=version) if stage.last else part
  else:
    done = program.backward(kept, dys, s, moves.weight(k, share), micro is not None)
  moves.record(k, records.STEP if stage.last else "B", task, version, s, start)
  if micro is None:
    moves.updated(k)
  if k > 0:
    moves.send_gradient(k, b, micro, done.dxs)
  if stage.last:
    stage.logs = done.logs
    if micro is None:
      moves.finished(b, done.loss, done.logs)
    else:
      stage.losses[b] = moves.add_loss(stage.losses.get(b), done.loss, share)


def _version(program: StageProtocol, parts: Sequence[Saved], k: int, moves: Moves) -> Any:
  """The weight version a backward read: its forward's (a kept tape) or the current one."""
  return parts[0].version if program.ops["B"].reads == "kept" else moves.current(k)
