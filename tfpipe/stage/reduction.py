"""How a replicated stage's gradients come together: `tf.distribute` cross-device ops.

A stage on several replica devices (`data_parallel=R`, `stage_replicas`) keeps one set of
variables on its first device. `replicate` hands each replica its copy of the weights
read; on the way back, the replicas' weight gradients are summed by a
`tf.distribute.CrossDeviceOps` (`batch_reduce` to the variables' device) before the
stage's update, as `tf.distribute.MirroredStrategy` sums its replicas' gradients.

`choose(devices, ops)` checks a user's choice or picks MirroredStrategy's: NCCL
all-reduce when every replica is a GPU of this process, else a reduction to one device.
"""

import contextlib
import functools
from typing import Any, Callable, Collection, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from tfpipe import compat
from tfpipe.stage import mirrors as mirrors_lib

__all__ = ["replicated_call", "check", "choose", "default", "replicate", "NAMES", "RING"]

# on_gradient(gradients, squares) -> (what the tapped tensors' gradient is, what to wait for)
OnGradient = Callable[[List[Any], List[Any]], Tuple[Sequence[Any], List[Any]]]
# A stage's call: (weights, inputs, state) -> (outputs, new state, losses).
Call = Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], Tuple[Any, List[Any], List[Any]]]

# Each replica keeps its own copy of the weights; a ring all-reduce sums the gradients
# (`tfpipe.stage.mirrors`). Synchronous schedules only; the default across hosts (`default`).
RING = "ring"

# --cross_device_ops names: the classes MirroredStrategy users pass.
NAMES = {
    "reduce_to_one_device": lambda: tf.distribute.ReductionToOneDevice(),
    "hierarchical_copy": lambda: tf.distribute.HierarchicalCopyAllReduce(num_packs=1),
    "nccl": lambda: tf.distribute.NcclAllReduce(num_packs=1),
}


def check(ops: Any) -> None:
  """Refuses a `cross_device_ops` value that is not an instance, RING, a name of NAMES or
  None."""
  if isinstance(ops, str) and ops not in NAMES and ops != RING:
    raise ValueError(f"unknown `cross_device_ops` {ops!r}; choose from {RING}, "
                     f"{', '.join(NAMES)} or pass a tf.distribute.CrossDeviceOps")
  if not isinstance(ops, (str, tf.distribute.CrossDeviceOps, type(None))):
    raise ValueError(f"`cross_device_ops` must be a tf.distribute.CrossDeviceOps, {RING}, one "
                     f"of {', '.join(NAMES)}, or None. Received: {ops!r}")



def _host(device: str) -> Optional[Tuple[str, int, int]]:
  spec = tf.DeviceSpec.from_string(device)
  return None if spec.job in (None, "localhost") else (spec.job, spec.replica or 0, spec.task or 0)


def default(devices: Sequence[str], synchronous: bool, tied: bool,
            rows: bool = False) -> Optional[str]:
  """What `cross_device_ops=None` means for one stage's replicas on `devices`: RING where they
  are on different hosts (TF server tasks), the schedule is `synchronous` and the stage holds
  no weight `tied` to another stage's, so that no host carries another replica's weights;
  otherwise None (MirroredStrategy's choice, `choose`). In one process a reduction to one
  device costs no link and keeps one copy of the weights. `rows`: the stage's embedding
  gradients reach the optimizer as rows (no global-norm clipping or loss scaling makes them
  dense): the ring sums dense chunks, which Adam's per-row moments would tell from Keras's,
  so the reduction, which keeps the rows, is taken."""
  hosts = {_host(d) for d in devices}
  across = len(hosts) > 1 and None not in hosts
  return RING if across and synchronous and not tied and not rows else None


def choose(devices: Sequence[str], ops: Any = None) -> Any:
  """The `tf.distribute.CrossDeviceOps` that sums gradients over `devices` (one stage's
  replicas): `ops` (an instance, a name of NAMES, or None for MirroredStrategy's choice)."""
  check(ops)
  if isinstance(ops, tf.distribute.CrossDeviceOps):
    return ops
  if isinstance(ops, str):
    return NAMES[ops]()
  specs = [tf.DeviceSpec.from_string(d) for d in devices]
  local_gpus = all(s.device_type == "GPU" and s.job in (None, "localhost") for s in specs)
  if local_gpus and len(devices) > 1:
    return NAMES["nccl"]()
  return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])


def replicate(weights: Sequence[Any], devices: Sequence[str], ops: Any,
              unused: Collection[int] = frozenset()) -> List[List[Any]]:
  """[copies of `weights` on each of `devices`]; the gradient sums the copies' gradients with
  `ops` onto `devices[0]` (a copy a replica did not use counts as zeros). `ops` a
  `mirrors.Mirrors`: replica r >= 1 reads its own copy, and a ring all-reduce sums the
  gradients on every replica (`mirrored`). `unused`: the indices of weights the replicas'
  backwards found unconnected (filled before the gradient here runs): their gradient is
  None, as the tape gives a weight the loss does not depend on (a graph's gradient fills
  an unconnected output of a multi-output op with zeros, which would hide it)."""
  weights = list(weights)
  if not weights:
    return [[] for _ in devices]
  if isinstance(ops, mirrors_lib.Mirrors):
    return mirrored(weights, devices, ops, unused)
  compat.drop_reduction_notices()

  @tf.custom_gradient  # type: ignore[untyped-decorator]  # TensorFlow is untyped
  def copies(*tensors: Any) -> Tuple[List[Any], Callable[..., List[Any]]]:
    out = []
    for device in devices:
      with tf.device(device):
        out += [tf.identity(t) for t in tensors]

    def grad(*upstream: Any) -> List[Any]:
      n = len(tensors)
      per_weight, connected = [], []
      for i, t in enumerate(tensors):
        if i in unused or all(upstream[r * n + i] is None for r in range(len(devices))):
          continue   # a weight the loss does not depend on: no gradient, as in Keras
        parts = []
        for r, device in enumerate(devices):
          g = upstream[r * n + i]
          with tf.device(device):
            parts.append(tf.zeros_like(out[r * n + i]) if g is None else g)
        per_weight.append((compat.per_replica(parts), devices[0]))
        connected.append(i)
      sums = iter(ops.batch_reduce(tf.distribute.ReduceOp.SUM, per_weight) if per_weight else [])
      return [next(sums) if i in connected else None for i in range(n)]

    return out, grad

  flat = copies(*weights)
  n = len(weights)
  return [list(flat[r * n:(r + 1) * n]) for r in range(len(devices))]


def mirrored(weights: Sequence[Any], devices: Sequence[str], mirrors: mirrors_lib.Mirrors,
             unused: Collection[int] = frozenset()) -> List[List[Any]]:
  """[`weights` for replica 0, each other replica's own copy (`mirrors`)]; the gradient each
  replica's copy gets goes to its own update (`mirrors.Mirrors.gradients`): no weight, and no
  gradient outside the ring, crosses between replicas.

  Each replica's copy passes through an identity of its own (on its device), replica r >= 1's
  anchored to replica 0's by a zero scalar replica 0's identities also output, so that
  replica 0's gradient function runs after every other replica's: it holds them all, where
  a sum over replicas is taken. (An anchor read from a weight would add a dense zero to
  its gradient, and an embedding's rows would arrive dense.)"""
  weights = [tf.convert_to_tensor(w) for w in weights]   # read here: what the copies follow
  with tf.device(devices[0]):
    *first, anchor = _tap(weights, functools.partial(mirrors.gradients, 0),
                          device=devices[0], unused=unused, marker=True)
  copies = [first]
  for r, values in enumerate(mirrors.values(after=weights), 1):
    with tf.device(devices[r]):
      copies.append(_tap(values, functools.partial(mirrors.gradients, r),
                         anchor=anchor, device=devices[r], unused=unused))
  return copies


def _tap(tensors: Sequence[Any], on_gradient: OnGradient, anchor: Any = None,
         device: Optional[str] = None, unused: Collection[int] = frozenset(),
         marker: bool = False) -> List[Any]:
  """Identities of `tensors`; their gradient goes through `on_gradient(gradients, squares)`
  (what it returns is the gradient of `tensors`; `squares`: per sparse gradient the sum of
  its rows' squares, as Keras's global norm counts them, else None), an `anchor`'s is zero.
  `device`: where a sparse gradient (an embedding's rows) is made dense, the replica's own
  (not the device the gradient is taken under, which would send the dense matrix across).
  `unused`: as `replicate`'s. `marker`: a zero scalar follows the identities, an anchor
  for others."""
  n = len(tensors)

  @tf.custom_gradient  # type: ignore[untyped-decorator]  # TensorFlow is untyped
  def identities(*inputs: Any) -> Tuple[List[Any], Callable[..., List[Any]]]:
    out = [tf.identity(t) for t in inputs[:n]]
    if marker:
      out.append(tf.zeros([], tf.float32))

    def grad(*upstream: Any) -> List[Any]:
      missing = [g is None or i in unused for i, g in enumerate(upstream[:n])]
      with tf.device(device) if device else contextlib.nullcontext():
        squares = [tf.reduce_sum(tf.square(tf.cast(g.values, tf.float32)))
                   if isinstance(g, tf.IndexedSlices) else None for g in upstream[:n]]
        dense = [tf.zeros_like(o) if g is None else tf.convert_to_tensor(g)
                 for o, g in zip(out[:n], upstream)]
      returned, waits = on_gradient(dense, squares)
      returned = [None if m else g for g, m in zip(returned, missing)]
      if anchor is None:
        return list(returned)
      with tf.control_dependencies(waits):   # the anchor's zero carries them to replica 0
        return list(returned) + [tf.zeros_like(anchor)]

    return out, grad

  return list(identities(*tensors, *([anchor] if anchor is not None else [])))


def _backward_here(device: str, call: Call, weights: Sequence[Any], xs: Sequence[Any],
                   state: Sequence[Any], unused: Optional[Set[int]] = None,
                   persistent: bool = True) -> Tuple[List[Any], List[Any], List[Any]]:
  """`call(weights, xs, state)` -> (ys, new_state, losses), its gradient taken on `device`.

  A tape's gradient ops go where the code taking the gradient places them (the stage's
  first device), not where their forward ran: replica r's backward would read its
  activations and weights from its host and send its gradients back. Here each replica's
  backward is its own (a tape of its own, its gradient taken under its device). The indices
  of `weights` the loss does not depend on are added to `unused` (a set) where given.

  That tape is the only one watching the replica's tensors (the inputs are cut from the
  caller's tapes, whose gradient this function gives), and `persistent` only where the
  caller's gradient is taken twice (a split backward's halves, B's and W's, apart): where
  TensorFlow sees higher-order gradients possible, it wraps each while loop (a recurrent
  layer) in a function whose gradient's loop carries no device, and the loop then ran on
  the caller's default device (the client: a residual LSTM's second replica exchanged 1.5
  GB a step with it)."""
  weights, xs, state = list(weights), list(xs), list(state)
  n_w, n_x = len(weights), len(xs)
  structure = []

  @tf.custom_gradient  # type: ignore[untyped-decorator]  # TensorFlow is untyped
  def placed(*flat: Any) -> Tuple[List[Any], Callable[..., List[Any]]]:
    w, x, st = [[tf.stop_gradient(t) if t.dtype.is_floating else t for t in part]
                for part in (flat[:n_w], flat[n_w:n_w + n_x], flat[n_w + n_x:])]
    watched = [t for t in w + x if t.dtype.is_floating]
    with tf.GradientTape(watch_accessed_variables=False, persistent=persistent) as tape:
      tape.watch(watched)
      ys, new_state, losses = call(w, x, st)
    ys, losses = tf.nest.flatten(ys), list(losses)
    structure.append((len(ys), len(new_state)))
    out = ys + list(new_state) + losses

    def grad(*upstream: Any) -> List[Any]:
      pairs = [(o, g) for o, g in zip(out, upstream)
               if g is not None and o.dtype.is_floating]
      with tf.device(device):
        found = tape.gradient([o for o, _ in pairs], watched,
                              output_gradients=[g for _, g in pairs],
                              unconnected_gradients=tf.UnconnectedGradients.NONE)
      if unused is not None:
        unused.update(i for i, g in enumerate(found[:len(w)]) if g is None)
      grads = iter(found)
      return [next(grads) if t.dtype.is_floating else None for t in w + x] + [None] * len(st)

    return out, grad

  out = placed(*weights, *xs, *state)
  n_y, n_s = structure[-1]
  return list(out[:n_y]), list(out[n_y:n_y + n_s]), list(out[n_y + n_s:])


def replicated_call(model: Any, weights: Sequence[Any], state: Sequence[Any], xs: Sequence[Any],
                    training: bool, devices: Sequence[str], ops: Any, groups_in: int = 1,
                    groups_out: int = 1,
                    persistent: bool = True) -> Tuple[List[Any], List[Any], Any]:
  """`model` (a stage) on each of `devices`: each replica on its share of the batch `xs` (the
  first n % R get one more), or with `groups_in` > 1 on its own inputs (a data-parallel
  pipeline's replicas travel apart); weights copied to each replica, their gradients summed
  with `ops` (`replicate`). Returns (outputs: joined along the batch axis, or the replicas'
  one after another with `groups_out` > 1; the non-trainable state, the replicas' mean; the
  first replica's losses: weight penalties count once). `persistent`: the caller may take
  the gradient twice (`_backward_here`)."""
  R = len(devices)
  if groups_in > 1:
    size = len(xs) // R
    replica_inputs = [list(xs[r * size:(r + 1) * size]) for r in range(R)]
  else:
    n = tf.shape(xs[0])[0]
    sizes = tf.stack([n // R + tf.cast(i < n % R, n.dtype) for i in range(R)])
    parts = [tf.split(x, sizes, num=R) for x in xs]
    replica_inputs = [[p[r] for p in parts] for r in range(R)]
  outputs, states, first_losses = [], [], None
  unused: Set[int] = set()   # the weights the replicas' backwards find unconnected
  copies = replicate(weights, devices, ops, unused)

  def call(w: Sequence[Any], x: Sequence[Any], r_state: Sequence[Any]) -> Any:
    return model.stateless_call(w, r_state, x[0] if len(x) == 1 else x, training=training,
                                return_losses=True)

  for r, device in enumerate(devices):
    inputs = replica_inputs[r]
    with tf.device(device):
      if r == 0:
        ys, new_state, losses = call(copies[r], inputs, state)
      else:
        ys, new_state, losses = _backward_here(device, call, copies[r], inputs, state, unused,
                                                 persistent)
    outputs.append(tf.nest.flatten(ys))
    states.append(new_state)
    first_losses = losses if first_losses is None else first_losses
  with tf.device(devices[0]):
    ys = ([y for out in outputs for y in out] if groups_out > 1 else
          [tf.concat(list(pieces), 0) for pieces in zip(*outputs)])
    new_state = [tf.add_n(list(values)) / R if values[0].dtype.is_floating else values[0]
                 for values in zip(*states)]
  return ys, new_state, first_losses
