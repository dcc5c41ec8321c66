"""Closed-form pipeline and data-parallel models from the papers (pure Python).

K: stages, M: micro-batches, T_F / T_B: forward / backward time of one
mini-batch through the whole model, P: data-parallel workers, t_calc: one
worker's time for a batch, t_comm: moving one copy of the model's parameters.
The simulator (`tfpipe.plan.simulator`) reproduces each of these from a schedule.
"""

from tfpipe.plan import names

__all__ = ["gpipe_bubble", "step_time", "speedup", "efficiency", "serial_time",
           "data_parallel_time", "data_parallel_speedup", "data_parallel_efficiency",
           "balanced_workers", "dnn_weights", "communication_time", "layerwise_speedup"]


def gpipe_bubble(K: int, M: int) -> float:
  """The idle share of a GPipe mini-batch with equal stages: (K-1) / (M+K-1)."""
  return (K - 1) / (M + K - 1)


def step_time(method: str, T_F: float, T_B: float, K: int, lockstep: bool = True) -> float:
  """Time per mini-batch in steady state with K equal stages.

  lockstep=True: Kang's model-parallelism report table 1 (computation-time column), where DDG and
  Features Replay run each step's forward through all stages before the
  backwards (DDG paper fig. 3): sequential T_F + T_B; ddg and feature_replay
  T_F + T_B/K; pipedream (1F1B) (T_F + T_B)/K.

  tfpipe runs them so with `lockstep=True` (a barrier closes every step).
  lockstep=False: the same schedules with only their data dependencies, as
  tfpipe runs them by default (Kang's report, table 3's message order: a stage receives the next
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


def speedup(t_ser: float, t_par: float) -> float:
  """Wang et al. eq. 4: S = t_ser / t_par."""
  return t_ser / t_par


def efficiency(t_ser: float, t_par: float, P: int) -> float:
  """Wang et al. eq. 4: E = S / P."""
  return speedup(t_ser, t_par) / P


def serial_time(iterations: int, t_calc: float) -> float:
  """Wang et al. eq. 5: t_ser = I_ser(b) * T_calc(b)."""
  return iterations * t_calc


def data_parallel_time(iterations: int, P: int, t_calc: float, t_comm: float) -> float:
  """Wang et al. eq. 6: t_par = I_par(b, P) / P * max(T_calc(b), 2P * T_comm), with computation
  and communication overlapped; eq. 7 takes I_par(b, P) = I_ser(b) iterations in all."""
  return iterations / P * max(t_calc, 2 * P * t_comm)


def data_parallel_speedup(P: int, t_calc: float, t_comm: float) -> float:
  """Wang et al. eq. 8: S = P * T_calc / max(T_calc, 2P * T_comm)."""
  return P * t_calc / max(t_calc, 2 * P * t_comm)


def data_parallel_efficiency(P: int, t_calc: float, t_comm: float) -> float:
  """Wang et al. eq. 8: E = S / P."""
  return data_parallel_speedup(P, t_calc, t_comm) / P


def balanced_workers(t_calc: float, t_comm: float) -> float:
  """Wang et al. eq. 9: the P at which computation and communication balance, T_calc = 2P T_comm."""
  return t_calc / (2 * t_comm)


def dnn_weights(n_in: int, n_hidden: int, n_out: int, layers: int) -> int:
  """Wang et al. section 2: N_W = N_h (N_i + (L-2) N_h + N_o) weights of a DNN with L-1 hidden
  layers of N_h units (biases left out, as there). Wang et al.'s example: L-1 = 7, N_i = 400,
  N_h = 2048, N_o = 10k gives ~4.9e7."""
  return n_hidden * (n_in + (layers - 2) * n_hidden + n_out)


def communication_time(num_weights: int, bandwidth: float, bytes_per_weight: int = 4) -> float:
  """Wang et al. section 4.4: T_comm = M / bandwidth with M = N_W * omega_B bytes of the model
  (bandwidth in bytes/s): the one-way time to move one copy of the gradients or weights."""
  return num_weights * bytes_per_weight / bandwidth


def layerwise_speedup(t_calc: float, K: int, t_transfer: float = 0.0) -> float:
  """Layer-wise model parallelism with an asynchronous pipeline (Wang et al.'s layer-wise
  partitioning paper section 5, the SpecTrain paper):
  K equal stages each take T_calc / K per mini-batch, and each cut moves one activation
  forward and one gradient back per mini-batch (t_transfer each way, both ways at once), so
  ideally S = T_calc / max(T_calc / K, t_transfer). This assumes enough batches in flight to
  hide the transfers' latency; 1F1B keeps K-k at stage k and hides none of it, so its speedup
  is lower when t_transfer > 0 (`tfpipe.plan.simulator` gives the exact figure)."""
  return t_calc / max(t_calc / K, t_transfer)
