"""Devices: GPUs when present, else logical CPU devices split from the one CPU."""

from typing import List, Sequence

import tensorflow as tf

__all__ = ["remote", "create_logical_cpus", "ensure_logical_cpus", "default_devices",
           "resolve_devices", "parse_stage_replicas", "resolve_stage_devices",
           "resolve_pipeline_replicas"]


def create_logical_cpus(n, intra_op_threads=1):
  """Splits the CPU into `n` logical devices; call before TensorFlow initialises.

  With `intra_op_threads=1`, ops on two logical devices run in parallel on two
  cores. Returns the device names. Calling it again with the same `n` after
  initialisation is a no-op; any other call after initialisation raises.
  """
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"the number of logical CPU devices must be a positive integer. Received: {n!r}")
  cpu = tf.config.list_physical_devices("CPU")[0]
  current = tf.config.get_logical_device_configuration(cpu)
  if current is not None and len(current) == n:
    return _local("CPU")
  try:
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    if intra_op_threads is not None:
      tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
  except RuntimeError as e:
    have = len(_local("CPU"))
    raise RuntimeError(
        f"cannot create {n} logical CPU devices: TensorFlow is already initialised with "
        f"{have}. Call tfpipe.create_logical_cpus({n}) at the start of the program, before "
        "any TensorFlow op runs") from e
  return _local("CPU")


def ensure_logical_cpus(n, intra_op_threads=1):
  """At least `n` logical CPU devices: creates them, or accepts enough made earlier."""
  have = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
  if have is not None and len(have) >= n:
    return _local("CPU")
  return create_logical_cpus(n, intra_op_threads)


def _local(kind):
  """This process's logical devices of `kind` (not those of a connected cluster)."""
  return [d.name for d in tf.config.list_logical_devices(kind)
          if tf.DeviceSpec.from_string(d.name).job in (None, "localhost")]


def default_devices():
  """The local GPUs if any, else the logical CPU devices (never a connected cluster's)."""
  return _local("GPU") or _local("CPU")


def resolve_devices(devices, num_stages):
  """The device of every stage, from a device list and/or a stage count.

  Device strings are kept as given, so remote devices
  (`/job:worker/task:1/device:CPU:0`) work once connected to a cluster.
  """
  if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
    raise ValueError(f"`num_stages` must be a positive integer. Received: num_stages={num_stages!r}")
  if devices is None:
    if num_stages is None:
      raise ValueError("give `devices` (one per stage) or `num_stages`")
    available = default_devices()
    if num_stages > len(available):
      raise ValueError(
          f"too few devices for {num_stages} stages (devices: {len(available)}: {available}); "
          f"on CPU call tfpipe.create_logical_cpus({num_stages}) before TensorFlow initialises")
    return available[:num_stages]
  if isinstance(devices, str) or not all(isinstance(d, str) for d in devices):
    raise ValueError(f"`devices` must be a list of device strings. Received: devices={devices!r}")
  devices = list(devices)
  if not devices:
    raise ValueError("`devices` must not be empty")
  if num_stages is not None and num_stages != len(devices):
    raise ValueError(
        f"`num_stages` must equal the number of devices. Received: num_stages={num_stages}, "
        f"devices={devices}")
  for d in devices:
    try:
      tf.DeviceSpec.from_string(d)
    except ValueError as e:
      raise ValueError(f"not a device string: {d!r}") from e
  local = set()
  for x in tf.config.list_logical_devices():
    spec = tf.DeviceSpec.from_string(x.name)
    local.add((spec.device_type, spec.device_index))
  for d in devices:
    spec = tf.DeviceSpec.from_string(d)
    if spec.job in (None, "localhost") and spec.device_type is not None:
      if (spec.device_type.upper(), spec.device_index or 0) not in local:
        names = sorted(f"/device:{t}:{i}" for t, i in local)
        raise ValueError(f"no such local device: {d!r} (local devices: {names})")
  return devices


def _refuse_shared(devices):
  """Two stages (or replicas) on one device would run one at a time: refused, naming it."""
  seen = {}
  for i, d in enumerate(devices):
    spec = tf.DeviceSpec.from_string(d)
    key = (spec.job or "localhost", spec.replica or 0, spec.task or 0,
           (spec.device_type or "CPU").upper(), spec.device_index or 0)
    if key in seen:
      raise ValueError(
          f"devices {devices[seen[key]]!r} (position {seen[key]}) and {d!r} (position {i}) are "
          "the same device: two stages on one device run one at a time, so the pipeline "
          "would not overlap them. Give every stage (and replica) its own device; on CPU, "
          "tfpipe.create_logical_cpus(n) makes n")
    seen[key] = i


def parse_stage_replicas(value):
  """{stage: replicas} from a dict or "k:R" strings (the trainer's --stage_replicas)."""
  if not value:
    return {}
  items = value.items() if isinstance(value, dict) else (
      tuple(v.split(":")) if isinstance(v, str) else v for v in value)
  result = {}
  for item in items:
    try:
      k, r = (int(x) for x in item)
    except (TypeError, ValueError):
      raise ValueError(f"stage replicas are STAGE:REPLICAS pairs such as 0:2. Received: "
                       f"{value!r}") from None
    if k < 0 or r < 1 or k in result:
      raise ValueError(f"stage replicas need a stage >= 0, named once, and replicas >= 1. "
                       f"Received: {value!r}")
    result[k] = r
  return result


def resolve_stage_devices(devices, num_stages, stage_replicas=None):
  """The devices of every stage: a list of lists, R devices for a stage replicated R times.

  `devices` is a flat list (taken in order, stage by stage) or None (the
  first local GPUs, else logical CPUs). Returns (stage_devices, replicas).
  """
  replicas = parse_stage_replicas(stage_replicas)
  extra = sum(r - 1 for r in replicas.values())
  if devices is not None and not isinstance(devices, str):
    total = len(list(devices))
    K = total - extra
    if num_stages is not None and num_stages != K and not replicas:
      resolve_devices(devices, num_stages)  # the plain "must equal the number of devices"
    if num_stages is not None and num_stages != K:
      raise ValueError(
          f"{total} devices make {K} stages with stage_replicas={replicas}, not "
          f"num_stages={num_stages}")
    flat = resolve_devices(devices, None)
  else:
    K = num_stages
    if devices is None and (not isinstance(K, int) or K < 1):
      resolve_devices(devices, K)  # the same clear error
    flat = resolve_devices(devices, None if devices is not None else K + extra)
  _refuse_shared(flat)
  bad = [k for k in replicas if k >= K]
  if bad:
    raise ValueError(f"stage_replicas names stage {bad[0]}, but the pipeline has {K} stages "
                     f"(0..{K - 1})")
  stage_devices, i = [], 0
  for k in range(K):
    r = replicas.get(k, 1)
    stage_devices.append(flat[i:i + r])
    i += r
  return stage_devices, replicas


def resolve_pipeline_replicas(devices, num_stages, replicas):
  """The devices of every stage of `replicas` copies of a K-stage pipeline (data parallel x
  pipeline): `devices` holds R x K devices, replica by replica (None: the first R x K
  local ones). Returns the stage devices, stage k's being replica r's k-th device for every r."""
  if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
    raise ValueError(f"`data_parallel` must be a positive integer. Received: "
                     f"data_parallel={replicas!r}")
  if devices is not None and not isinstance(devices, str):
    total = len(list(devices))
    if total % replicas:
      raise ValueError(f"{total} devices cannot hold {replicas} equal pipeline replicas "
                       f"(data_parallel={replicas}): give R x K devices, replica by replica")
    K = total // replicas
    if num_stages is not None and num_stages != K:
      raise ValueError(f"{total} devices make {replicas} replicas of {K} stages, not "
                       f"num_stages={num_stages}")
    flat = resolve_devices(devices, None)
  else:
    K = num_stages
    if devices is None and (not isinstance(K, int) or K < 1):
      resolve_devices(devices, K)  # the same clear error
    flat = resolve_devices(devices, None if devices is not None else K * replicas)
  _refuse_shared(flat)
  return [[flat[r * K + k] for r in range(replicas)] for k in range(K)]


def remote(stage_devices: Sequence[Sequence[str]]) -> List[str]:
  """The devices of `stage_devices` (a list of each stage's devices) on TF servers (not this
  process's)."""
  return [d for ds in stage_devices for d in ds
          if tf.DeviceSpec.from_string(d).job not in (None, "localhost")]
