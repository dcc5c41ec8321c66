"""What a schedule is made of: `Task`s in per-stage lists (`Lists`), a `Schedule` whose stages
share devices (`lanes`), the executors' `Action`, and the helpers every schedule builder uses
(`tfpipe.plan.schedules`, `tfpipe.plan.virtual`).
"""

from typing import List, NamedTuple, Optional, Tuple

__all__ = ["Task", "Unit", "Lists", "Lane", "Action", "is_update", "check_sizes", "forward_units",
           "backward_of", "Schedule", "jointly_updated", "lanes"]


class Task(NamedTuple):
  """One task of one stage: kind "F", "B", "W", "U", "R" or "S", a mini-batch (S: a step), and a
  micro-batch or None."""
  kind: str
  batch: int
  micro: Optional[int] = None

  def __str__(self) -> str:
    return f"{self.kind}{self.batch}" + ("" if self.micro is None else f".{self.micro}")


Unit = Tuple[int, Optional[int]]   # a forward unit: (mini-batch, micro-batch or None)
Lists = List[List[Task]]   # a schedule: each stage's task list
Lane = List[Tuple[int, Task]]   # one device's (stage, task) order


class Action(NamedTuple):
  """A task of stage `stage` as the executors run it (`tfpipe.runtime.interpreter`): with its
  version difference `s` and, for a backward, the forward units (batch, micro) it covers."""
  stage: int
  task: Task
  s: int
  units: Tuple[Unit, ...]


def is_update(task: Task) -> bool:
  """True for the tasks that apply an update: U(b), and B(b) of a whole mini-batch."""
  return task.kind == "U" or (task.kind == "B" and task.micro is None)


def check_sizes(K: int, N: int, M: int = 1) -> None:
  for label, value in (("K", K), ("N", N), ("M", M)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"`{label}` must be a positive integer. Received: {label}={value!r}")


def forward_units(N: int, M: int) -> List[Unit]:
  """Forward units in order: mini-batches, or (b, i) micro-batches when M > 1."""
  if M == 1:
    return [(b, None) for b in range(N)]
  return [(b, i) for b in range(N) for i in range(M)]


def backward_of(b: int, i: Optional[int], M: int, tasks: List[Task]) -> None:
  """B of a unit; with micro-batches, the update U(b) follows the last one."""
  tasks.append(Task("B", b, i))
  if i is not None and i == M - 1:
    tasks.append(Task("U", b))


class Schedule(List[List[Task]]):
  """A schedule (a list of per-stage task lists) whose stages share devices: `lanes[d]` is
  the order in which device d runs its stages' tasks, as (stage, task) pairs; each stage's
  list is its tasks in that order. Plain lists run one stage per device."""

  def __init__(self, stages: Lists, lanes: Optional[List[Lane]], joint: bool = False) -> None:
    super().__init__(stages)
    self.lanes = lanes
    self.joint = joint


def jointly_updated(schedule: Lists) -> "Schedule":
  """`schedule` with joint updates: no stage's update U(b) runs before every stage's
  backwards (B and W) of b have run (`tfpipe.plan.verify`, the executors), so a decision over
  the whole model's gradient (`tfpipe.rules.joint`) can be made before any stage applies it. For a
  synchronous schedule with U tasks; it costs nothing there: the next mini-batch waits for
  every update anyway."""
  if not any(t.kind == "U" for tasks in schedule for t in tasks):
    raise ValueError("joint updates need a schedule whose updates are U tasks (micro-batch "
                     "backwards accumulated, then applied)")
  return Schedule([list(tasks) for tasks in schedule], getattr(schedule, "lanes", None),
                  joint=True)


def lanes(schedule: Lists) -> List[Lane]:
  """Per device, the (stage, task) order it runs: `Schedule.lanes`, else one stage each."""
  return getattr(schedule, "lanes", None) or [[(k, t) for t in tasks]
                                              for k, tasks in enumerate(schedule)]
