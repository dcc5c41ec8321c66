"""What an executor may ask of a stage: `StageProtocol`, the stage's operations over the state
it keeps, and the few read-only properties the executors read.

`tfpipe.stage.program.StageProgram` implements it. The executors (`tfpipe.runtime`) type the
stages they run as `StageProtocol`, and mypy (`tests/test_types.py`, `--strict`)
refuses a member of a stage the protocol does not state: a new need of an executor is stated
here first, where a reader of the stage finds it.
"""

from typing import Any, ContextManager, List, Mapping, Optional, Protocol, Sequence
from typing import runtime_checkable

__all__ = ["StageProtocol"]


@runtime_checkable
class StageProtocol(Protocol):
  """Stage k of a pipeline as the executors run it.

  Operations (each one task of the schedule; `tfpipe.plan.tasks` says what a task runs for
  the stage's policy, `ops`): `forward` (F), `backward` (B) or its halves `backward_input`
  and `backward_weights` (a zero-bubble schedule's B and W), `update` (U): every stage's,
  the last one's too (its forward keeps its inputs and labels, its backward computes the
  loss in the program: the step). `s` is a task's version difference, `scale` a
  micro-batch's share of its mini-batch (a scalar tensor), `accumulate` whether weight
  gradients go to the accumulators (micro-batches) rather than into an update. How the tasks
  trace is a context the compiled executor enters (`inlined`), not an argument of each
  operation.
  """

  # Read-only properties the executors read.

  @property
  def device(self) -> str:
    """Where the stage's variables live."""

  @property
  def replica_devices(self) -> Sequence[str]:
    """The devices a call splits its batch over (one: no replicas)."""

  @property
  def grouped_in(self) -> bool:
    """Whether its inputs arrive as data-parallel replicas' parts, one per replica device."""

  @property
  def grouped_out(self) -> bool:
    """Whether its outputs leave as data-parallel replicas' parts."""

  @property
  def remote(self) -> bool:
    """Whether the stage runs on a TF server (another process)."""

  @property
  def jit_compile(self) -> Optional[bool]:
    """Whether its tasks are compiled with XLA."""

  @property
  def policy(self) -> Any:
    """Its weight policy (`tfpipe.plan.policies.WeightPolicy`)."""

  @property
  def ops(self) -> Mapping[str, Any]:
    """Per task kind, what it runs and which weights it reads (`tfpipe.plan.tasks.Op`)."""

  @property
  def updates(self) -> Any:
    """Its updates (`tfpipe.stage.updates.Updates`): `build_accumulators()`, and `joint` (a
    decision over every stage's gradients: clipping, loss scaling) or None."""

  @property
  def sources(self) -> Any:
    """The weights its tasks read (`tfpipe.stage.weights`): `version(updates, s)`."""

  @property
  def reports(self) -> Any:
    """The last stage's loss and metrics (`tfpipe.stage.logs`): `results()`."""

  # Operations.

  def forward(self, xs: Any, s: int = 0, labels: Any = None, training: bool = True,
              split: bool = False) -> Any:
    """Task F. Training: (outputs, what its backward needs). `training=False`: the outputs
    (at the last stage with `labels`, the running logs)."""

  def backward(self, parts: List[Any], dys: Any, s: int, scale: Any, accumulate: bool) -> Any:
    """Task B over the forwards `parts` given the outputs' gradients `dys`: the input
    gradients (and at the last stage the loss and logs)."""

  def backward_input(self, parts: List[Any], dys: Any, s: int, scale: Any) -> Any:
    """A split backward's input half: no update."""

  def backward_weights(self, parts: List[Any], dys: Any, s: int, scale: Any,
                       accumulate: bool) -> None:
    """A split backward's weight half: the update (or accumulation)."""

  def update(self) -> Any:
    """Task U: one update with the accumulated gradients."""

  # What the compiled executor asks of how a stage traces.

  def inlined(self, on: bool = True) -> ContextManager[None]:
    """While on, the operations trace their tasks' bodies into the caller's graph (a
    window's small stages) rather than call the stage's own traced functions."""

  def carried(self, kept: Any) -> Any:
    """`kept` as a compiled window carries it into the next."""

  def residuals_inlined(self, on: bool = True) -> ContextManager[None]:
    """While on, inlined forwards whose backward reads their tape run as calls that output
    their residuals (one trace for a window's copies)."""

  def forward_ops(self) -> int:
    """Ops in one trace of its forward (what inlining a window costs)."""

  def forward_loops(self) -> bool:
    """Whether its forward holds a while loop."""
