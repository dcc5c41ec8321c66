"""The trainer's configuration: what the flags say, as one object passed to the library."""

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass
class TrainConfig:
  model: str = "snn"
  dataset: str = "digits"
  method: str = "spectrain"
  num_stages: int = 2
  devices: Optional[Sequence[str]] = None
  cluster: Optional[str] = None
  cluster_timeout: float = 120.0
  client_address: Optional[str] = None
  liveness_misses: int = 2
  grid: str = "2x2"
  stage_replicas: Sequence[str] = ()
  data_parallel: int = 1
  layout: str = "fixed"
  cross_device_ops: Optional[str] = None
  virtual_stages: Optional[int] = None
  partition: str = "uniform"
  spectrain_backward: str = "reuse"
  version_difference: Optional[str] = None
  micro_batches: Optional[int] = None
  recompute: str = "auto"
  memory_budget: Optional[str] = None
  executor: str = "auto"
  steps_per_execution: str = "auto"
  lockstep: bool = False
  spike_compensation: Optional[bool] = None
  delay_momentum: bool = False
  nesterov: Optional[bool] = None
  advice: bool = False
  delay_compensation: Optional[float] = None
  lr_rescheduling: Optional[int] = None
  discrepancy_decay: Optional[float] = None
  optimizer: str = "spectrain"
  weight_decay: Optional[float] = None
  global_clipnorm: Optional[float] = None
  precision: str = "float32"
  batch_size: int = 64
  learning_rate: float = 0.01
  momentum: float = 0.9
  epochs: int = 1
  steps: Optional[int] = None
  seed: int = 0
  logdir: Optional[str] = None
  data_dir: Optional[str] = None
  snn_width: int = 2048
  snn_depth: int = 32
  mlp_width: int = 256
  mlp_depth: int = 8
  model_scale: float = 1.0
  synthetic_samples: int = 2048
  synthetic_shape: Sequence[int] = (32, 32, 3)
  sequence_length: int = 20
  trace_steps: Optional[str] = None
  trace_dir: Optional[str] = None
  breakdown: bool = False
  transfer_share: bool = False
  throughput_window: Optional[str] = "50,250"
  prediction_error: bool = False
  checkpoint_dir: Optional[str] = None
  checkpoint_every: int = 1
  save_weights: Optional[str] = None
  max_restarts: int = 0
  stop_on_nan: bool = True
  intra_op_threads: int = 1
  verbose: int = 2

  @classmethod
  def from_flags(cls, flag_values):
    values = {f.name: getattr(flag_values, f.name) for f in dataclasses.fields(cls)}
    values["synthetic_shape"] = tuple(int(d) for d in values["synthetic_shape"])
    return cls(**values)
