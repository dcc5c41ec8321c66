"""Every method by name: `METHODS`, and `create`, the trainer of any of them."""

from typing import Any, NamedTuple, Optional, Sequence

import keras

from tfpipe.baselines import asgd, keras as keras_baselines, tensor_parallel
from tfpipe.plan import names
from tfpipe.plan.auto import AUTO   # a pipeline whose method is chosen at its first fit
from tfpipe.plan.policies import PIPELINE_METHODS
from tfpipe.training.pipeline import Pipeline

__all__ = ["AUTO", "METHODS", "BASELINE_METHODS", "CLUSTER_METHODS", "MethodKind", "kind", "create"]

BASELINE_METHODS = ("single", "dataparallel", "grid")   # not pipelines
CLUSTER_METHODS = ("asgd",)   # on TF servers of a cluster (tfpipe.cluster); not a pipeline
METHODS = BASELINE_METHODS + PIPELINE_METHODS + (AUTO,) + CLUSTER_METHODS


class MethodKind(NamedTuple):
  """What kind of trainer a method makes: what a caller (the trainer) dispatches on, so no
  caller compares method names. `devices`: "stages" (a pipeline's), "one", "replicas" (data
  parallel), "grid" (tensor parallel, n_b x n_m) or "cluster" (workers and parameter servers
  of TF servers); `across_processes`: it may run as workers of TF_CONFIG
  (MultiWorkerMirroredStrategy)."""
  name: str
  pipeline: bool
  devices: str
  across_processes: bool = False

  @property
  def parameter_servers(self) -> bool:
    return self.devices == "cluster"


_KINDS = {"single": MethodKind("single", False, "one"),
          "dataparallel": MethodKind("dataparallel", False, "replicas", across_processes=True),
          "grid": MethodKind("grid", False, "grid"),
          "asgd": MethodKind("asgd", False, "cluster")}


def kind(method: str) -> MethodKind:
  """The `MethodKind` of `method` (any name of `METHODS`; a wrong one is a ValueError naming
  the choices)."""
  method = names.lookup("method", method, METHODS)
  return _KINDS.get(method, MethodKind(method, True, "stages"))


def create(model: keras.Model, method: str, devices: Optional[Sequence[str]] = None,
           num_stages: Optional[int] = None, **kwargs: Any) -> Any:
  """The trainer for `method`: a `Pipeline`, the `single` / `dataparallel` baseline, the
  `grid` of tensor-parallel Dense layers (`grid=(n_b, n_m)`), or `asgd` on the parameter
  servers of a cluster (`spec=`, and `build=` where `keras.models.clone_model` cannot copy
  the model: `tfpipe.baselines.asgd.ASGD`)."""
  method = names.lookup("method", method, METHODS)
  if method == "asgd":
    if "spec" not in kwargs:
      raise ValueError("method 'asgd' needs `spec`, a cluster spec with 'worker' and 'ps' jobs "
                       "(e.g. tfpipe.cluster.LocalCluster({'worker': 2, 'ps': 1}).spec)")
    return asgd.ASGD(model, kwargs.pop("spec"), build=kwargs.pop("build", None))
  if method == "grid":
    return tensor_parallel.GridParallel(model, grid=kwargs.pop("grid", (2, 2)), devices=devices)
  if method == "single":
    return keras_baselines.Single(model, device=devices[0] if devices else None)
  if method == "dataparallel":
    return keras_baselines.DataParallel(model, devices=devices, num_replicas=num_stages)
  return Pipeline(model, devices=devices, num_stages=num_stages, method=method, **kwargs)
