"""Links between hosts, as the simulator prices them (pure Python).

R: replicas (data parallel), K: stages. A `Link` is what a probe measured between two hosts
(`tfpipe.cluster.probe`): bytes per second one way, the seconds a transfer costs whatever
its size, and bytes per second each way when both hosts send at once (`duplex_rate`: where a
transfer costs the hosts' processors as well as the wire, as TensorFlow's gRPC does on CPU
hosts, sending and receiving together is slower than either alone). A transfer of n bytes
takes `latency + n / rate`. Gradient sums:

- a ring all-reduce of n bytes over R hosts (each replica keeps its own weights) sends
  2 (R-1) chunks of n / R per host, each a transfer of its own, every host at once (each
  sends to one neighbour while it receives from the other: at the duplex rate, or at the
  ring rate a probe measured of the ring itself, whose concatenations, splits and sums cost
  the hosts' processors too);
- a reduction to one device (the variables on replica 0's host) sends the weights out to
  the R - 1 other replicas before their forward and takes their R - 1 gradients in after
  their backward, all over replica 0's link: 2 (R-1) n bytes through one host, one way at a
  time (the gradients cannot leave before the weights arrived).
"""

import dataclasses
from typing import Optional, Sequence

__all__ = ["Link", "slowest", "transfer_seconds", "ring_seconds", "reduce_to_one_seconds",
           "reduction_seconds", "check_how", "RING", "REDUCE_TO_ONE"]

RING = "ring"
REDUCE_TO_ONE = "reduce_to_one_device"


@dataclasses.dataclass(frozen=True)
class Link:
  """rate: bytes per second one way; latency: seconds a transfer costs whatever its size;
  duplex_rate: bytes per second each way while both ends send at once (None: `rate`);
  ring_rate: bytes per second of each host's traffic in a ring all-reduce as measured (two
  hosts summing n bytes: n / the seconds it took, the ring's own concatenations, splits and
  sums included; None: `duplex_rate`)."""
  rate: float
  latency: float = 0.0
  duplex_rate: Optional[float] = None
  ring_rate: Optional[float] = None

  def __post_init__(self) -> None:
    if not self.rate > 0:
      raise ValueError(f"a link's rate must be > 0 bytes/s. Received: {self.rate!r}")
    if not self.latency >= 0:
      raise ValueError(f"a link's latency must be >= 0 s. Received: {self.latency!r}")
    if self.duplex_rate is not None and not self.duplex_rate > 0:
      raise ValueError(f"a link's duplex rate must be > 0 bytes/s. Received: "
                       f"{self.duplex_rate!r}")
    if self.ring_rate is not None and not self.ring_rate > 0:
      raise ValueError(f"a link's ring rate must be > 0 bytes/s. Received: "
                       f"{self.ring_rate!r}")

  @property
  def both_ways(self) -> "Link":
    """This link as a transfer sees it while the other end sends too (the duplex rate)."""
    return Link(self.duplex_rate or self.rate, self.latency)

  def describe(self) -> str:
    both = (f", {self.duplex_rate * 8 / 1e6:.0f} Mbit/s each way both at once"
            if self.duplex_rate is not None else "")
    ring = (f", {self.ring_rate * 8 / 1e6:.0f} Mbit/s in a ring all-reduce"
            if self.ring_rate is not None else "")
    return f"{self.rate * 8 / 1e6:.0f} Mbit/s, {self.latency * 1e3:.2f} ms{both}{ring}"


def slowest(links: Sequence[Link]) -> Link:
  """One link standing for `links`: the least rate (and duplex rate) and the largest latency
  among them."""
  if not links:
    raise ValueError("no links to take the slowest of")
  duplex = [l.duplex_rate for l in links if l.duplex_rate is not None]
  ring = [l.ring_rate for l in links if l.ring_rate is not None]
  return Link(min(l.rate for l in links), max(l.latency for l in links),
              min(duplex) if duplex else None, min(ring) if ring else None)


def transfer_seconds(nbytes: float, link: Link) -> float:
  """Seconds `nbytes` take over `link` (0 bytes: no transfer, 0 s)."""
  if nbytes < 0:
    raise ValueError(f"bytes must be >= 0. Received: {nbytes}")
  return link.latency + nbytes / link.rate if nbytes else 0.0


def ring_seconds(nbytes: float, replicas: int, link: Link) -> float:
  """Seconds a ring all-reduce of `nbytes` takes over `replicas` hosts joined by `link` (at
  its ring rate where it was measured)."""
  R = _replicas(replicas)
  ring = link.both_ways if link.ring_rate is None else Link(link.ring_rate, link.latency)
  return 2 * (R - 1) * transfer_seconds(nbytes / R, ring) if R > 1 else 0.0


def reduce_to_one_seconds(nbytes: float, replicas: int, link: Link) -> float:
  """Seconds replica 0's host takes to send `nbytes` of weights to each other replica and take
  their gradients of `nbytes` back (one transfer per replica each way, one at a time)."""
  R = _replicas(replicas)
  return 2 * (R - 1) * transfer_seconds(nbytes, link)


def check_how(how: str) -> str:
  """Refuses a gradient sum other than `RING` or `REDUCE_TO_ONE`."""
  if how not in (RING, REDUCE_TO_ONE):
    raise ValueError(f"unknown gradient sum {how!r}: {RING!r} or {REDUCE_TO_ONE!r}")
  return how


def reduction_seconds(nbytes: float, replicas: int, link: Link, how: str) -> float:
  """`ring_seconds` or `reduce_to_one_seconds`, by `how`."""
  if check_how(how) == RING:
    return ring_seconds(nbytes, replicas, link)
  return reduce_to_one_seconds(nbytes, replicas, link)


def _replicas(replicas: int) -> int:
  if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
    raise ValueError(f"replicas must be an integer >= 1. Received: {replicas!r}")
  return replicas
