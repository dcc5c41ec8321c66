"""Where a Pipeline's stages run: each stage's devices (one, or its replicas'), checked
against the method, the cluster and each other before any TensorFlow work.

`place` resolves `tfpipe.Pipeline`'s `devices`, `num_stages`, `stage_replicas` and
`data_parallel` for a weight policy: R replicas of the whole pipeline, hybrid stages, or
V stages per device (interleaved: d, d + K, ...; zbv: d and 2K-1-d).
"""

import collections

import tensorflow as tf

from tfpipe import devices as devices_lib
from tfpipe.cluster import servers as cluster
from tfpipe.plan import schedules

__all__ = ["Placement", "place", "default_jit_compile"]

# stage_devices: per stage its devices, the variables' first; stage_replicas: {stage: R} of
# hybrid stages; data_parallel: R replicas of the whole pipeline.
Placement = collections.namedtuple("Placement", ["stage_devices", "stage_replicas",
                                                 "data_parallel"])


def place(devices, num_stages, policy, stage_replicas=None, data_parallel=1):
  """The `Placement` of `policy`'s stages (`tfpipe.plan.policies`); a remote device must be
  in the connected cluster."""
  data_parallel = _data_parallel(data_parallel, stage_replicas, policy)
  V = policy.virtual_stages
  if V > 1 and stage_replicas:
    raise ValueError(f"virtual stages (method {policy.method!r}, virtual_stages={V}) do not "
                     f"combine with stage_replicas. Received: stage_replicas={stage_replicas!r}")
  if data_parallel > 1 or V > 1:
    per_device = (devices_lib.resolve_pipeline_replicas(devices, num_stages, data_parallel)
                  if data_parallel > 1 else
                  [[d] for d in devices_lib.resolve_devices(devices, num_stages)])
    where = schedules.device_of(policy.schedule, V * len(per_device), V)
    result = Placement([per_device[d] for d in where], {}, data_parallel)
  else:
    result = Placement(*devices_lib.resolve_stage_devices(devices, num_stages, stage_replicas),
                       data_parallel)
  _check_cluster(devices_lib.remote(result.stage_devices))
  return result


def default_jit_compile(placement):
  """Keras's `jit_compile="auto"`: on when every stage is one GPU, off otherwise."""
  return (all(tf.DeviceSpec.from_string(ds[0]).device_type == "GPU"
              for ds in placement.stage_devices)
          and not placement.stage_replicas and placement.data_parallel == 1)


def _check_cluster(remote_devices):
  """Remote devices need a connected cluster that has their tasks."""
  if not remote_devices:
    return
  spec = cluster.connected_spec()
  if spec is None:
    raise ValueError(f"device {remote_devices[0]!r} is remote: connect to its cluster first "
                     "(tfpipe.cluster.connect(spec))")
  cluster.check_devices(remote_devices, spec)


def _data_parallel(replicas, stage_replicas, policy):
  """R, checked: a positive integer, not with `stage_replicas`, nor with a schedule whose last
  stage joins several forwards in one step (their replicas' parts would interleave)."""
  if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
    raise ValueError(f"`data_parallel` must be a positive integer. Received: "
                     f"data_parallel={replicas!r}")
  if replicas > 1 and stage_replicas:
    raise ValueError("data_parallel replicates every stage already; it does not combine with "
                     f"stage_replicas. Received: data_parallel={replicas}, "
                     f"stage_replicas={stage_replicas!r}")
  if replicas > 1 and not schedules.kind_of(policy.schedule).replicable:
    raise ValueError(f"method {policy.method!r} runs one last-stage step over several "
                     f"forwards, which data_parallel does not split. Received: "
                     f"data_parallel={replicas}")
  return replicas
