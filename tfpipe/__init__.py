"""tfpipe: pipelined model-parallel training of Keras models on TensorFlow."""

from tfpipe import asgd, checkpoint, cluster, devices, multi_worker, optimizers, runtime, tensor_parallel
from tfpipe.baselines import DataParallel, Single, create
from tfpipe.devices import create_logical_cpus, default_devices
from tfpipe.pipeline import Pipeline
from tfpipe.plan.policies import PIPELINE_METHODS, SYNCHRONOUS_METHODS

BASELINE_METHODS = ("single", "dataparallel", "grid")   # not pipelines
CLUSTER_METHODS = ("asgd",)   # on TF servers of a cluster (tfpipe.cluster); not a pipeline
METHODS = BASELINE_METHODS + PIPELINE_METHODS + CLUSTER_METHODS

__all__ = ["Pipeline", "Single", "DataParallel", "create", "create_logical_cpus",
           "default_devices", "devices", "optimizers", "asgd", "checkpoint", "cluster", "multi_worker", "tensor_parallel", "METHODS", "BASELINE_METHODS", "CLUSTER_METHODS",
           "PIPELINE_METHODS", "SYNCHRONOUS_METHODS"]
__version__ = "0.1.0"
