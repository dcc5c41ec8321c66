"""Pipeline schedules: each stage's ordered task list, in pure Python (no TensorFlow).

K: stages, k: stage index (0 holds the input), N: mini-batches in an epoch,
b: mini-batch index, M: micro-batches per mini-batch, i: micro-batch index,
d = K-1-k: the depth of the pipeline below stage k.

A schedule is a list of K task lists (`tfpipe.plan.schedule_types`; the schedules with several
stages per device are in `tfpipe.plan.virtual`). Stage k runs its list in order; a task
waits only for its data (see `tfpipe.plan.verify`). Task kinds:

  F(b[, i])  forward of a mini-batch (or of one of its micro-batches);
  B(b, i)    backward of micro-batch i: its weight gradient is accumulated;
  B(b)       backward of the whole mini-batch b (all its micro-batches, if
             any), followed by the stage's update;
  W(b, i)    the weight-gradient half of micro-batch i's backward, accumulated
             (zero-bubble schedules: their B(b, i) then gives the stage input's
             gradient only);
  U(b)       the update with the gradients accumulated over b's micro-batches;
  R(b[, i])  receive b's output gradient now, ahead of its backward (DDG);
  S(t)       a barrier: every stage waits at S(t) until all stages reach it
             (lock-step DDG).

At the last stage a forward only receives its input: the stage's forward and
backward run as one step at its B task, which follows the forwards it covers.
Every stage owns its weights and is the only one to update them, so the
weight version a task reads depends on its stage's order alone, never on
thread timing: the runtime and the slow reference loop agree exactly.
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Set

from tfpipe.plan import names
from tfpipe.plan.schedule_types import (Action, Lane, Lists, Schedule, Task, Unit, backward_of,
                                        check_sizes, forward_units, is_update, jointly_updated,
                                        lanes)
from tfpipe.plan.virtual import interleaved, zero_bubble_v

__all__ = ["Task", "Unit", "Lists", "Lane", "Action", "Schedule", "lanes", "sequential",
           "one_f_one_b", "gpipe", "one_f_one_b_flush", "interleaved", "zero_bubble_h1",
           "zero_bubble_v", "device_of", "jointly_updated",
           "ddg", "ddg_lockstep", "timeprest", "build",
           "SCHEDULES", "ScheduleKind", "kind_of", "check_virtual_stages", "is_update",
           "micro_batches",
           "micro_sizes"]


def sequential(K: int, N: int) -> Lists:
  """Naive model parallelism: one batch in flight.

  K = 3, N = 2 (time runs left to right; Fb / Bb = forward / backward of b):

  ```
  stage 0: F0 .  .  .  B0 F1 .  .  .  B1
  stage 1: .  F0 .  B0 .  .  F1 .  B1 .
  stage 2: .  .  F0B0 .  .  .  F1B1 .  .
  ```
  """
  check_sizes(K, N)
  return [[t for b in range(N) for t in (Task("F", b), Task("B", b))] for _ in range(K)]


def one_f_one_b(K: int, N: int, M: int = 1) -> Lists:
  """Asynchronous 1F1B (PipeDream's steady state), drained at the end.

  Stage k starts with d = K-1-k forwards, then alternates one forward, one
  backward. K = 3, N = 4:

  ```
  stage 0: F0 F1 .  .  F2 .  B0 F3 .  B1 .  .  B2 .  B3
  stage 1: .  F0 F1 .  B0 F2 .  B1 F3 .  B2 .  B3 .  .
  stage 2: .  .  F0B0 F1B1 F2B2 F3B3 .  .  .  .  .  .  .
  ```
  The forward of b at stage k runs after the backwards of b-d earlier
  batches: its weights are stale by d updates. With M > 1 the units are
  micro-batches; each stage accumulates their gradients and updates once
  per mini-batch, after the backward of its last micro-batch.
  """
  check_sizes(K, N, M)
  units = forward_units(N, M)
  stages = []
  for k in range(K):
    warm = min(K - 1 - k, len(units))
    tasks = [Task("F", *u) for u in units[:warm]]
    for n, (b, i) in enumerate(units):
      if n + warm < len(units):
        tasks.append(Task("F", *units[n + warm]))
      backward_of(b, i, M, tasks)
    stages.append(tasks)
  return stages


def gpipe(K: int, N: int, M: int) -> Lists:
  """GPipe: per mini-batch, all M micro-batch forwards, then all backwards, then one update.

  K = 2, N = 1, M = 3 (the last stage runs each micro-batch's forward and
  backward as one step, in micro-batch order, so backwards flow in that order):

  ```
  stage 0: F0.0 F0.1 F0.2 .    B0.0 B0.1 B0.2 U0
  stage 1: .    F0.0B0.0 F0.1B0.1 F0.2B0.2  U0
  ```
  No update happens inside a mini-batch: every micro-batch reads the same
  weights, and the result equals training on whole mini-batches.
  """
  check_sizes(K, N, M)
  stages = []
  for k in range(K):
    tasks = []
    for b in range(N):
      if k == K - 1:
        tasks += [t for i in range(M) for t in (Task("F", b, i), Task("B", b, i))]
      else:
        tasks += [Task("F", b, i) for i in range(M)] + [Task("B", b, i) for i in range(M)]
      tasks.append(Task("U", b))
    stages.append(tasks)
  return stages


def one_f_one_b_flush(K: int, N: int, M: int) -> Lists:
  """1F1B with a flush (PipeDream-Flush, DAPPLE; Megatron-LM's default): per mini-batch, the
  1F1B order over its M micro-batches, then one update; the next mini-batch starts after it.

  Stage k starts with min(d, M) forwards (d = K-1-k), then alternates one forward and one
  backward, then runs the backwards left. K = 3, N = 1, M = 4:

  ```
  stage 0: F0.0 F0.1 F0.2 .    .    B0.0 F0.3 .    B0.1 .    B0.2 .    B0.3 U0
  stage 1: .    F0.0 F0.1 .    B0.0 F0.2 B0.1 F0.3 B0.2 .    B0.3 U0
  stage 2: .    .    F0.0B0.0 F0.1B0.1 F0.2B0.2 F0.3B0.3 U0
  ```
  Like GPipe no update comes inside a mini-batch (it equals training on whole mini-batches)
  and the bubble is the same, (K-1)/(M+K-1); but stage k keeps at most min(K-k, M)
  micro-batches' activations instead of M.
  """
  check_sizes(K, N, M)
  return [_flushed_1f1b(k, K, N, M, None) for k in range(K)]


def _flushed_1f1b(k: int, K: int, N: int, M: int, lag: Optional[int]) -> List[Task]:
  """Stage k's list of 1F1B with a flush; with `lag`, each B(b, i) is followed by the W of
  micro-batch i - lag (the rest after the last B): the zero-bubble split."""
  warm, tasks = min(K - 1 - k, M), []
  for b in range(N):
    tasks += [Task("F", b, i) for i in range(warm)]
    for i in range(M):
      if i + warm < M:
        tasks.append(Task("F", b, i + warm))
      tasks.append(Task("B", b, i))
      if lag is not None and i >= lag:
        tasks.append(Task("W", b, i - lag))
    if lag is not None:
      tasks += [Task("W", b, i) for i in range(max(0, M - lag), M)]
    tasks.append(Task("U", b))
  return tasks


def zero_bubble_h1(K: int, N: int, M: int) -> Lists:
  """ZB-H1 (Qi et al., ICLR 2024), per mini-batch and with a flush: each backward splits into
  B (the gradient for the stage input, on the critical path: stage k-1 waits for it; at the
  last stage the forward, loss and that gradient) and W (the weight gradient, accumulated).
  A stage runs 1F1B's F and B order and lets its W tasks trail its B tasks by k, so the later
  stages, which idle longest at the end of 1F1B, run their deferred W there instead.
  K = 3, N = 1, M = 4:

  ```
  stage 0: F0.0 F0.1 F0.2 .    .    B0.0 W0.0 F0.3 B0.1 W0.1 B0.2 W0.2 B0.3 W0.3 U0
  stage 1: .    F0.0 F0.1 .    B0.0 F0.2 B0.1 W0.0 F0.3 B0.2 W0.1 B0.3 W0.2 W0.3 U0
  stage 2: .    .    F0.0B0.0 F0.1B0.1 F0.2B0.2 W0.0 F0.3B0.3 W0.1 W0.2 W0.3 U0
  ```
  With B and W each as long as a forward the bubble is (K-1)/(3M+K-1), a third of 1F1B's
  when M >> K (the paper's ZB-H1); stage k keeps min(K-k, M) + min(k, M) micro-batches at
  most (their forward run, their W not yet), at most min(K, M): 1F1B's peak at stage 0.
  The update follows the last W.
  """
  check_sizes(K, N, M)
  return [_flushed_1f1b(k, K, N, M, lag=k) for k in range(K)]


def device_of(name: str, S: int, V: int) -> List[int]:
  """The device index of each of the S stages of schedule `name` with V stages per device:
  round robin (interleaved: device d holds d, d + K, ...), or a V (zb_v: device d holds d and
  2K-1-d, so the first device also holds the last stage)."""
  K = S // V
  if kind_of(name).placement == "v":
    return [s if s < K else 2 * K - 1 - s for s in range(S)]
  return [s % K for s in range(S)]


def ddg(K: int, N: int, lockstep: bool = False) -> Lists:
  """Decoupled backpropagation with delayed gradients (DDG; Kang's report, table 3).

  Step t of stage k: forward of t, backward of t-d with the gradient it
  already holds, then receive (R) the gradient for its next backward. The
  per-stage order of forwards and backwards is 1F1B's; the early receive
  makes the forward run as in `sequential` while the backwards overlap:
  a step takes T_F + T_B/K. K = 3, N = 3:

  ```
  stage 0: F0 F1 R0 F2 B0 R1 B1 R2 B2
  stage 1: F0 R0 F1 B0 R1 F2 B1 R2 B2
  stage 2: F0 B0 F1 B1 F2 B2
  ```
  Stage 0 cannot start F2 before stage 1 has run F1 and B0 (it receives
  B0's gradient first), so each forward waits for the previous step of
  stage 1, but not of the stages below: a step takes (2 T_F + T_B)/K.

  lockstep=True ends every step t with a barrier S(t) on all stages, as in
  the DDG paper (fig. 3) and Kang's model-parallelism report's table 1: the next forward
  starts when the slowest stage ends its step, T_F + T_B/K. The weights each
  task reads are the same either way.
  """
  check_sizes(K, N)
  stages = []
  for k in range(K):
    d, tasks, received = K - 1 - k, [], set()
    for t in range(N):
      tasks.append(Task("F", t))
      if t - d >= 0:
        tasks.append(Task("B", t - d))
      if k < K - 1 and 0 <= t - d + 1 < N:
        tasks.append(Task("R", t - d + 1))
        received.add(t - d + 1)
      if lockstep:
        tasks.append(Task("S", t))
    for b in range(max(0, N - d), N):
      if k < K - 1 and b not in received:
        tasks.append(Task("R", b))
      tasks.append(Task("B", b))
    stages.append(tasks)
  return stages


def ddg_lockstep(K: int, N: int) -> Lists:
  """`ddg` with a barrier S(t) closing every step (see `ddg`)."""
  return ddg(K, N, lockstep=True)


def timeprest(K: int, N: int, M: int) -> Lists:
  """TiMePReSt: pipelined micro-batch forwards, one backward per mini-batch on the latest weights.

  Stage k runs the micro-batch forwards in order and the backward of
  mini-batch b right after the forward of micro-batch number b*M + M-1 + d
  (counting micro-batches over the epoch), the 1F1B offset in micro-batch
  units: stage k+1 computes b's gradient while stage k runs one more
  forward. K = 2, N = 2, M = 2:

  ```
  stage 0: F0.0 F0.1 F1.0 B0 F1.1 B1
  stage 1: .    F0.0 F0.1B0 F1.0 F1.1B1
  ```
  """
  check_sizes(K, N, M)
  units = forward_units(N, M) if M > 1 else [(b, 0) for b in range(N)]
  stages = []
  for k in range(K):
    d, tasks, done = K - 1 - k, [], 0
    for n, (b, i) in enumerate(units):
      tasks.append(Task("F", b, i))
      while done < N and done * M + M - 1 + d == n:
        tasks.append(Task("B", done))
        done += 1
    tasks += [Task("B", b) for b in range(done, N)]
    stages.append(tasks)
  return stages


class ScheduleKind(NamedTuple):
  """A schedule, named once (`SCHEDULES`): how it is built and what it is.

  `build(S, N, M, V)`: the task lists of S stages over N mini-batches of M micro-batches, V
  stages per device. `micro_batches`: "never" (M is 1), "optional" (M >= 1) or "always"
  (built with its M even when 1). `split_backward`: each backward is split into B (the input's
  gradient) and W (the weights'). `virtual_stages`: the V it runs, None for any V that
  divides the stages. `placement`: "round_robin" (device d holds stages d, d + K, ...) or "v"
  (device d holds d and 2K-1-d). `replicable`: data parallelism may split its batches (not
  where the last stage joins several forwards in one step). `lockstep`: the schedule of the
  same tasks with a barrier closing every step, if it has one. `joint_as`: the schedule built
  for joint updates (`jointly_updated`), if not itself."""
  build: Callable[[int, int, int, int], Lists]
  micro_batches: str = "never"
  split_backward: bool = False
  virtual_stages: Optional[int] = 1
  placement: str = "round_robin"
  replicable: bool = True
  lockstep: Optional[str] = None
  joint_as: Optional[str] = None


SCHEDULES: Dict[str, ScheduleKind] = {
    "sequential": ScheduleKind(lambda S, N, M, V: sequential(S, N), joint_as="gpipe"),
    "1f1b": ScheduleKind(lambda S, N, M, V: one_f_one_b(S, N, M), "optional"),
    "gpipe": ScheduleKind(lambda S, N, M, V: gpipe(S, N, M), "always"),
    "1f1b_flush": ScheduleKind(lambda S, N, M, V: one_f_one_b_flush(S, N, M), "always"),
    "interleaved": ScheduleKind(interleaved, "always", virtual_stages=None),
    "zb_h1": ScheduleKind(lambda S, N, M, V: zero_bubble_h1(S, N, M), "always",
                          split_backward=True),
    "zb_v": ScheduleKind(lambda S, N, M, V: zero_bubble_v(S, N, M), "always",
                         split_backward=True, virtual_stages=2, placement="v"),
    "ddg": ScheduleKind(lambda S, N, M, V: ddg(S, N), lockstep="ddg_lockstep"),
    "ddg_lockstep": ScheduleKind(lambda S, N, M, V: ddg_lockstep(S, N)),
    "timeprest": ScheduleKind(lambda S, N, M, V: timeprest(S, N, M), "always",
                              replicable=False),
}


def kind_of(name: str) -> ScheduleKind:
  """The `ScheduleKind` of schedule `name` (a wrong one is a ValueError naming the choices)."""
  return SCHEDULES[names.lookup("schedule", name, SCHEDULES)]


def check_virtual_stages(name: str, V: int) -> None:
  """Refuses V (stages per device) that schedule `name` does not run."""
  wanted = kind_of(name).virtual_stages
  if wanted is None or V == wanted:
    return
  if wanted == 1:
    raise ValueError(f"the {name!r} schedule runs one stage per device. Received: V={V}")
  raise ValueError(f"the {name!r} schedule places {wanted} stages on each device. Received: "
                   f"V={V}")


def build(name: str, K: int, N: int, M: int = 1, V: int = 1) -> Lists:
  """The schedule called `name` for K stages, N mini-batches and M micro-batches each (V:
  stages per device)."""
  kind = kind_of(name)
  check_sizes(K, N, M)
  check_virtual_stages(name, V)
  if kind.micro_batches == "never" and M != 1:
    raise ValueError(f"the {name!r} schedule has no micro-batches. Received: M={M}")
  return kind.build(K, N, M, V)


def micro_batches(schedule: Lists) -> int:
  """M: the most micro-batches of one mini-batch in the schedule (1 without micro-batches)."""
  micros = [t.micro for tasks in schedule for t in tasks if t.micro is not None]
  return max(micros) + 1 if micros else 1


def lead(schedule: Lists) -> int:
  """L: how many mini-batches stage 0 starts before its tasks of the earliest unfinished one end.

  Stage 0 starts batch b (its first task of b) only after its last task of
  batch b-L, so the runtime may hold the start of b until the caller has
  handled batch b-L's result without slowing the schedule: sequential and
  GPipe L = 1, 1F1B and DDG L = K.
  """
  tasks = schedule[0]
  last = {t.batch: i for i, t in enumerate(tasks)}
  finished: Set[int] = set()
  started: Set[int] = set()
  result = 1
  for i, t in enumerate(tasks):
    if t.batch not in started:
      started.add(t.batch)
      result = max(result, t.batch - len(finished) + 1)
    if last[t.batch] == i:
      finished.add(t.batch)
  return result


def micro_sizes(n: int, M: int) -> List[int]:
  """Sizes of the M micro-batches of a mini-batch of n samples (the first n % M get one more)."""
  if n < M:
    raise ValueError(
        f"a mini-batch of {n} samples cannot be split into {M} micro-batches; use a batch size "
        f"of at least {M} (and no smaller last batch), or fewer micro-batches")
  return [n // M + (1 if i < n % M else 0) for i in range(M)]
