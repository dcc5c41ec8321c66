"""tfpipe: pipelined model-parallel training of Keras models on TensorFlow.

The package's folders are its layers, each importing only those before it in the order the
docs' architecture page (docs/architecture.md) gives, the one place it is written (the
layout test reads it there): `plan` (pure Python: schedules, weight policies, the task table,
the verifier, the simulator), `models` (the benchmarks' models), `rules` (weight and update
rules in TensorFlow), `runtime` (the executors), `cluster` (TF servers), `instruments` (what
a run shows about itself), `stage` (a stage's program and where it runs), `training` (the
Keras face: `Pipeline`), `baselines` (what a pipeline is measured against).
`compat` is the one module that touches TensorFlow's and Keras's internals.
"""

import sys

from tfpipe import cluster, devices, runtime
from tfpipe.baselines import asgd, multi_worker, tensor_parallel
from tfpipe.baselines.keras import DataParallel, Single
from tfpipe.devices import create_logical_cpus, default_devices
from tfpipe.methods import BASELINE_METHODS, CLUSTER_METHODS, METHODS, create
from tfpipe.plan.policies import PIPELINE_METHODS, SYNCHRONOUS_METHODS
from tfpipe.rules import optimizers
from tfpipe.training import checkpoint
from tfpipe.training.layouts import choose_layout
from tfpipe.training.pipeline import Pipeline

# The public modules keep their import paths from before the layers had folders:
# `from tfpipe.optimizers import SpecTrain` goes on working.
for _name, _module in (("optimizers", optimizers), ("checkpoint", checkpoint), ("asgd", asgd),
                       ("multi_worker", multi_worker), ("tensor_parallel", tensor_parallel)):
  sys.modules.setdefault(f"{__name__}.{_name}", _module)
del _name, _module

__all__ = ["Pipeline", "choose_layout", "Single", "DataParallel", "create", "create_logical_cpus",
           "default_devices", "devices", "optimizers", "asgd", "checkpoint", "cluster",
           "multi_worker", "tensor_parallel", "METHODS", "BASELINE_METHODS", "CLUSTER_METHODS",
           "PIPELINE_METHODS", "SYNCHRONOUS_METHODS"]
__version__ = "0.1.0"
