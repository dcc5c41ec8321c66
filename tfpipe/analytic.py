"""Closed-form pipeline and data-parallel models from the papers (pure Python).

K: stages, M: micro-batches, T_F / T_B: forward / backward time of one
mini-batch through the whole model, P: data-parallel workers, t_calc: one
worker's time for a batch, t_comm: moving one copy of the model's parameters.
The simulator (`tfpipe.simulator`) reproduces each of these from a schedule.
"""

from tfpipe import names

__all__ = ["gpipe_bubble", "step_time", "data_parallel_speedup", "data_parallel_efficiency",
           "balanced_workers"]


def gpipe_bubble(K, M):
  """The idle share of a GPipe mini-batch with equal stages: (K-1) / (M+K-1)."""
  return (K - 1) / (M + K - 1)


def step_time(method, T_F, T_B, K, lockstep=True):
  """Time per mini-batch in steady state with K equal stages.

  lockstep=True: EPFL report table 1 (computation-time column), where DDG and
  Features Replay run each step's forward through all stages before the
  backwards (DDG paper fig. 3): sequential T_F + T_B; ddg and feature_replay
  T_F + T_B/K; pipedream (1F1B) (T_F + T_B)/K.

  tfpipe runs them so with `lockstep=True` (a barrier closes every step).
  lockstep=False: the same schedules with only their data dependencies, as
  tfpipe runs them by default (EPFL table 3's message order: a stage receives the next
  gradient after its backward). Stage k's next forward then waits only for
  stage k+1's backward: ddg takes (2 T_F + T_B)/K for K >= 2;
  feature_replay too for K = 2, and (3 T_F + T_B)/K for K >= 3, where the
  next stage's backward includes its recomputation. Equal to the table for
  K = 2 (and K = 3 for feature_replay), faster beyond.
  """
  method = names.lookup("method", method, ("sequential", "ddg", "feature_replay", "pipedream"))
  if method == "sequential":
    return T_F + T_B
  if method in ("ddg", "feature_replay"):
    if lockstep or K == 1:
      return T_F + T_B / K
    return (2 * T_F + T_B + (T_F if method == "feature_replay" and K >= 3 else 0.0)) / K
  return (T_F + T_B) / K


def data_parallel_speedup(P, t_calc, t_comm):
  """Seed 001 eq. 8: S = P * T_calc / max(T_calc, 2P * T_comm)."""
  return P * t_calc / max(t_calc, 2 * P * t_comm)


def data_parallel_efficiency(P, t_calc, t_comm):
  """Seed 001 eq. 8: E = S / P."""
  return data_parallel_speedup(P, t_calc, t_comm) / P


def balanced_workers(t_calc, t_comm):
  """Seed 001 eq. 9: the P at which computation and communication balance, T_calc = 2P T_comm."""
  return t_calc / (2 * t_comm)
