"""Where each host's time goes, from TensorFlow's profiler on every TF server: computing, or
waiting on a transfer (a receive or a collective it has started and that has not finished).

  shares = transfers.trace_hosts({("worker", 0): "198.18.0.1:2222", ...}, seconds=2.0)
  print(transfers.describe(shares))

`trace_hosts` asks each server's profiler service (every `tf.distribute.Server` runs one) for
a trace of `seconds` (`tf.profiler.experimental.client.trace`); each server writes its profile
into `logdir`, which must therefore be a folder the servers see too: on emulated hosts (one
machine, `tfpipe.cluster.EmulatedCluster`) any local folder is.

`shares(events)` reads one host's trace (pure Python):
  compute:  the union of the spans of the ops it ran, other than transfers;
  waiting:  the union of the spans of its pending transfers (an asynchronous receive or
            collective from its start to its callback, a send), less compute: the time it had
            nothing to compute but a transfer to wait on. It includes waiting for a peer that
            has not yet produced what is received (a pipeline's neighbour still computing, a
            replica late to its all-reduce): it bounds the time the links cost from above,
            where the links' counters (`tfpipe.instruments.traffic`) bound it from below;
  other:    the rest of the traced time (the host idle: nothing running, nothing pending).
"""

import collections
import dataclasses
import glob
import os
import tempfile
import threading
import time
from typing import Dict, Iterable, List, Tuple

import keras
import tensorflow as tf

from tfpipe import compat

__all__ = ["Shares", "shares", "trace_hosts", "describe", "HostTrace", "TRANSFER_KERNELS"]

# The kernels that move tensors: point-to-point (a pipeline's activations and gradients, a
# parameter server's weights) and collective (an all-reduce).
TRANSFER_KERNELS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
_COLLECTIVE = "Collective"
_ASYNC_START = "ExecutorState::ProcessAsync::Start"
_ASYNC_DONE = "ExecutorState::ProcessAsync::Done"
_SERVICE = "EagerService:"   # a server's handling of a request (e.g. run a function): no op

Event = Tuple[str, float, float, dict]   # (name, start s, end s, args)


@dataclasses.dataclass(frozen=True)
class Shares:
  """One host's traced seconds, split: computing, waiting on a transfer, neither."""
  seconds: float
  compute: float
  waiting: float

  @property
  def other(self) -> float:
    return max(self.seconds - self.compute - self.waiting, 0.0)

  def share(self, part: str) -> float:
    return getattr(self, part) / self.seconds if self.seconds > 0 else 0.0


def _is_transfer(kernel: str) -> bool:
  return kernel in TRANSFER_KERNELS or kernel.startswith(_COLLECTIVE)


def _union(spans: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
  out: List[Tuple[float, float]] = []
  for start, end in sorted(spans):
    if out and start <= out[-1][1]:
      out[-1] = (out[-1][0], max(out[-1][1], end))
    else:
      out.append((start, end))
  return out


def _length(spans: List[Tuple[float, float]]) -> float:
  return sum(end - start for start, end in spans)


def _minus(spans: List[Tuple[float, float]], cut: List[Tuple[float, float]]) -> float:
  """Seconds of the union `spans` outside the union `cut` (both sorted, disjoint)."""
  left, j = 0.0, 0
  for start, end in spans:
    while j < len(cut) and cut[j][1] <= start:
      j += 1
    at, k = start, j
    while k < len(cut) and cut[k][0] < end:
      left += max(cut[k][0] - at, 0.0)
      at = max(at, cut[k][1])
      k += 1
    left += max(end - at, 0.0)
  return left


def _op_type(args: dict) -> str:
  return args.get("long_name", "").rsplit(":", 1)[-1]


def shares(events: Iterable[Event]) -> Shares:
  """One host's `Shares` from its trace's events (name, start s, end s, args): the ops'
  (events with a "long_name" "NAME:TYPE"; not the server's handling of a request, which
  spans the function it runs) and the asynchronous kernels' starts and callbacks (matched by
  step, node and kernel, in order)."""
  compute, moving = [], []
  started: Dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
  for name, start, end, args in sorted(events, key=lambda e: e[1]):
    if name in (_ASYNC_START, _ASYNC_DONE):
      kernel = args.get("kernel_type", "")
      key = (args.get("step_id"), args.get("name"), kernel)
      if name == _ASYNC_START:
        started[key].append(start)
      elif started[key]:
        first = started[key].popleft()
        if _is_transfer(kernel):   # another asynchronous kernel (a call) spans its callees
          moving.append((first, end))
    elif "long_name" in args and not args["long_name"].startswith(_SERVICE):
      (moving if _is_transfer(_op_type(args)) else compute).append((start, end))
  if not compute and not moving:
    return Shares(0.0, 0.0, 0.0)
  busy, spans = _union(compute), compute + moving
  wall = max(end for _, end in spans) - min(start for start, _ in spans)   # first op to last
  return Shares(wall, _length(busy), _minus(_union(moving), busy))


def _read(path: str) -> List[Event]:
  return [(name, start * 1e-12, (start + duration) * 1e-12, args)
          for name, start, duration, args in compat.profile_events(path)]


def trace_hosts(addresses: Dict[object, str], seconds: float, logdir=None) -> Dict[object, Shares]:
  """{host: Shares} of a trace of `seconds` on each TF server (`addresses`: {host:
  "ip:port"}), taken at once; `logdir`: where the servers write their profiles (a temporary
  folder by default, removed after)."""
  if not seconds > 0:
    raise ValueError(f"a trace needs seconds > 0. Received: {seconds!r}")
  # Named by this process, so that the next run removes it if this one is killed
  # (`tfpipe.cluster.remove_leftover_files`).
  with tempfile.TemporaryDirectory(prefix=f"tfpipe-hosts-{os.getpid()}-") as scratch:
    folder = logdir or scratch
    tf.profiler.experimental.client.trace(
        ",".join(f"grpc://{a}" for a in addresses.values()), folder,
        max(1, int(seconds * 1000)), num_tracing_attempts=1)
    written = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
    out = {}
    for host, address in addresses.items():
      mine = [p for p in written if os.path.basename(p).startswith(address.replace(":", "_"))]
      if not mine:
        raise RuntimeError(f"the profiler of {address} wrote no trace under {folder}")
      out[host] = shares(_read(max(mine, key=os.path.getmtime)))
      if not out[host].seconds:
        # Seen on a KerasHub Llama's 1f1b stages at 10 Gbit/s in most runs, whatever the
        # lead before the epoch (2 or 6 s): the servers' profiles held no op. Not explained.
        raise RuntimeError(f"the trace of {address} holds no op: its profiler caught nothing "
                           "of the traced time")
    return out


def _name(host) -> str:
  return host if isinstance(host, str) else f"{host[0]}/{host[1]}"


def _percent(share: float) -> str:
  if share < 5e-5:   # round-off of the parts' difference
    return "0%"
  return f"{100 * share:.0f}%" if share >= 0.1 else f"{100 * share:.2g}%"


def describe(traced: Dict[object, Shares]) -> str:
  """One line: each host's traced seconds and its shares, in percent."""
  hosts = sorted(traced, key=lambda h: (isinstance(h, str), str(h)))
  each = "; ".join(
      f"{_name(h)} computing {_percent(traced[h].share('compute'))}, waiting on transfers "
      f"{_percent(traced[h].share('waiting'))}, idle {_percent(traced[h].share('other'))}"
      for h in hosts)
  seconds = max((s.seconds for s in traced.values()), default=0.0)
  return (f"time on each host, traced over {seconds:.2g} s of one more epoch (waiting on "
          f"transfers: a receive or all-reduce pending, nothing to compute): {each}")


class HostTrace(keras.callbacks.Callback):
  """Traces every host's server (`trace_hosts`) while the first epoch of the `fit` it is given
  to trains: the epoch waits `lead` seconds for the servers' profilers to start (started with
  the epoch, a trace missed it), and the trace lasts `lead + seconds` (the epoch's length and some
  more: only the span from the first op traced to the last is counted). `result` is then
  {host: Shares}, or None with `error` saying why (a trace that fails never stops training)."""

  LEAD = 2.0

  def __init__(self, addresses: Dict[object, str], seconds: float, lead=None):
    super().__init__()
    if not seconds > 0:
      raise ValueError(f"a trace needs seconds > 0. Received: {seconds!r}")
    self.addresses, self.seconds = dict(addresses), seconds
    self.lead = self.LEAD if lead is None else lead
    self.result, self.error = None, None
    self._thread = None

  def _trace(self):
    try:
      self.result = trace_hosts(self.addresses, self.lead + self.seconds)
    except Exception as e:  # pylint: disable=broad-except
      self.error = f"{type(e).__name__}: {e}"

  def on_epoch_begin(self, epoch, logs=None):
    if self._thread is None:
      self._thread = threading.Thread(target=self._trace, name="tfpipe-host-trace", daemon=True)
      self._thread.start()
      time.sleep(self.lead)

  def on_train_end(self, logs=None):
    if self._thread is not None:
      self._thread.join()
