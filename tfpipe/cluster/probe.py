"""Each link's rate and latency, measured with a few timed transfers between TF servers.

  devices = tfpipe.cluster.connect(spec)
  links = tfpipe.cluster.probe.ring_links(devices)   # devices[i] -> devices[i + 1]

A transfer is one `tf.function` call that sums, on the target device, a tensor that lives on
the source device, so TensorFlow moves it between the two servers directly (as a pipeline's
activations move). The same call with the tensor already on the target times everything but
the move (the call, the sum); the difference is the move. The latency is a 4-byte move's;
the rate is a large move's bytes over its seconds less the latency, the size grown until a
move takes `seconds` (or reaches `max_bytes`). The duplex rate is the same size moved both
ways in one call (each end sends while it receives, as in a ring all-reduce). The ring rate
is that size summed by the ring all-reduce data-parallel replicas run, whose chunks,
concatenations and sums cost the hosts' processors beside the moves (less the same call on
8 bytes). Each time is the median of `repeats`.
"""

import statistics
import time
from typing import List, Optional, Sequence

import tensorflow as tf

from tfpipe.plan import network
from tfpipe.stage import mirrors

__all__ = ["probe", "ring_links", "client_links", "CLIENT_DEVICE"]

CLIENT_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
START_BYTES = 1 << 20


def _median_seconds(call, repeats: int) -> float:
  call()   # traced and warmed
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _timer(target: str):
  @tf.function(autograph=False, reduce_retracing=True)
  def total(x):
    with tf.device(target):
      return tf.reduce_sum(x)
  return total


def _on(device: str, nbytes: int):
  with tf.device(device):
    return tf.ones([max(1, nbytes // 4)], tf.float32)


def _move_seconds(total, source: str, target: str, nbytes: int, repeats: int) -> float:
  there, here = _on(source, nbytes), _on(target, nbytes)
  moved = _median_seconds(lambda: total(there).numpy(), repeats)
  local = _median_seconds(lambda: total(here).numpy(), repeats)
  return max(moved - local, 0.0)


def _duplex_seconds(source: str, target: str, nbytes: int, repeats: int) -> float:
  """Seconds `nbytes` take to move each way at once: a tensor from `source` summed on
  `target` and one from `target` summed on `source` in one call, less the same call with
  each tensor already where it is summed."""
  @tf.function(autograph=False, reduce_retracing=True)
  def both(x, y):
    with tf.device(target):
      a = tf.reduce_sum(x)
    with tf.device(source):
      b = tf.reduce_sum(y)
    return a, b

  crossing = (_on(source, nbytes), _on(target, nbytes))
  staying = (_on(target, nbytes), _on(source, nbytes))
  moved = _median_seconds(lambda: [t.numpy() for t in both(*crossing)], repeats)
  local = _median_seconds(lambda: [t.numpy() for t in both(*staying)], repeats)
  return max(moved - local, 0.0)


def _ring_seconds(source: str, target: str, nbytes: int, repeats: int) -> float:
  """Seconds a ring all-reduce (`tfpipe.stage.mirrors.ring_all_reduce`, as data-parallel
  replicas sum their gradients) of `nbytes` on each of the two devices takes, less the same
  of 8 bytes (the call)."""
  @tf.function(autograph=False)   # the ring splits by static shapes: traced per size
  def reduce(x, y):
    sums = mirrors.ring_all_reduce([[x], [y]], [source, target])
    with tf.device(source):
      a = sums[0][0][0]
    with tf.device(target):
      b = sums[1][0][0]
    return a, b

  def took(n: int) -> float:
    pair = (_on(source, n), _on(target, n))
    return _median_seconds(lambda: [t.numpy() for t in reduce(*pair)], repeats)
  return max(took(nbytes) - took(8), 0.0)


def probe(source: str, target: str, seconds: float = 0.05, max_bytes: int = 64 << 20,
          repeats: int = 3, duplex: bool = True, ring: bool = True) -> network.Link:
  """The link from `source` to `target` (device strings), measured; with `duplex`, its rate
  each way while both ends send too; with `ring` (and `duplex`) the rate of a ring
  all-reduce's traffic between the two."""
  if source == target:
    raise ValueError(f"a link needs two devices; both are {source!r}")
  if not seconds > 0 or max_bytes < START_BYTES:
    raise ValueError(f"need seconds > 0 and max_bytes >= {START_BYTES}. Received: "
                     f"seconds={seconds!r}, max_bytes={max_bytes!r}")
  total = _timer(target)
  latency = _move_seconds(total, source, target, 4, repeats)
  nbytes = START_BYTES
  while True:
    took = _move_seconds(total, source, target, nbytes, repeats)
    if took >= seconds or nbytes >= max_bytes:
      break
    nbytes = min(max_bytes, nbytes * 4)
  rate = _rate(nbytes, took, latency)
  if not duplex:
    return network.Link(rate, latency)
  both = min(_rate(nbytes, _duplex_seconds(source, target, nbytes, repeats), latency), rate)
  if not ring:
    return network.Link(rate, latency, both)
  # Two hosts summing n bytes each send n (two chunks of n / 2); the latencies are in the
  # 8-byte call taken off.
  summed = _rate(nbytes, _ring_seconds(source, target, nbytes, repeats), 0.0)
  return network.Link(rate, latency, both, summed)


def _rate(nbytes: int, took: float, latency: float) -> float:
  """Bytes per second of a move of `nbytes` that took `took` s, less the latency (a move too
  fast to time beside its call: the bytes in its whole time)."""
  moving = took - latency
  return nbytes / moving if moving > 0 else nbytes / max(took, 1e-9)


def ring_links(devices: Sequence[str], **kwargs) -> List[network.Link]:
  """The links devices[i] -> devices[(i + 1) % n] (a ring's, and adjacent stages')."""
  if len(devices) < 2:
    raise ValueError(f"need 2 devices or more to probe links between. Received: {list(devices)}")
  return [probe(d, devices[(i + 1) % len(devices)], **kwargs) for i, d in enumerate(devices)]


def client_links(devices: Sequence[str], client: Optional[str] = None,
                 **kwargs) -> List[network.Link]:
  """The links from this program (`client`: its device) to each of `devices` (one way: what
  feeds them)."""
  kwargs.setdefault("duplex", False)
  return [probe(client or CLIENT_DEVICE, d, **kwargs) for d in devices]
