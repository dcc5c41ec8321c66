"""Schedules with several stages per device (V > 1): interleaved 1F1B (stages round robin on
the devices) and zero-bubble ZB-V (stages in a V); each a `Schedule` with its devices' lanes.
"""

from typing import List, Optional, Tuple

from tfpipe.plan.schedule_types import Lane, Schedule, Task, check_sizes

__all__ = ["interleaved", "zero_bubble_v"]


def interleaved(S: int, N: int, M: int, V: int) -> "Schedule":
  """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC'21), with a flush per mini-batch: S =
  K x V stages on K devices, device d holding the V chunks d, d + K, ..., (V-1)K + d.

  Each device runs its chunks' micro-batches in groups of K: forwards take chunk 0's
  micro-batches 0..K-1, then chunk 1's, ..., then chunk 0's K..2K-1; backwards the same with
  the chunks reversed. Device d warms up with min((K-1-d) x 2 + (V-1) x K, MV) forwards, then
  alternates one forward and one backward, then runs the backwards left; one update per chunk.
  K = 2, V = 2 (S = 4), N = 1, M = 2, as device lanes ("s.t": task t of stage s):

  ```
  device 0: 0.F0.0 0.F0.1 2.F0.0 2.F0.1 2.B0.0 2.B0.1 0.B0.0 0.B0.1 0.U0 2.U0
  device 1: 1.F0.0 1.F0.1 3.F0.0 3.B0.0 3.F0.1 3.B0.1 1.B0.0 1.B0.1 1.U0 3.U0
  ```
  The bubble is (K-1)/(VM + K-1) with equal chunk times, V times smaller than 1F1B's for
  M >> K, for V times the transfers. M must be a multiple of K.
  """
  check_sizes(S, N, M)
  if not isinstance(V, int) or isinstance(V, bool) or V < 1 or S % V:
    raise ValueError(f"`virtual_stages` must be a positive integer dividing the {S} stages. "
                     f"Received: virtual_stages={V!r}")
  K = S // V
  if M % K:
    raise ValueError(f"the interleaved schedule runs micro-batches in groups of one per device: "
                     f"micro_batches must be a multiple of the {K} devices. Received: "
                     f"micro_batches={M}")

  def unit(i: int, backward: bool) -> Tuple[int, int]:
    chunk = (i // K) % V
    return ((V - 1 - chunk) if backward else chunk), (i // (K * V)) * K + i % K

  device_lanes = []
  for d in range(K):
    warm, lane = min((K - 1 - d) * 2 + (V - 1) * K, M * V), []   # type: int, Lane
    for b in range(N):

      def forward(i: int, b: int = b) -> Tuple[int, Task]:
        return unit(i, False)[0] * K + d, Task("F", b, unit(i, False)[1])

      def backward(i: int, b: int = b) -> Tuple[int, Task]:
        return unit(i, True)[0] * K + d, Task("B", b, unit(i, True)[1])

      lane += [forward(i) for i in range(warm)]
      for i in range(M * V - warm):
        lane += [forward(warm + i), backward(i)]
      lane += [backward(i) for i in range(M * V - warm, M * V)]
      lane += [(v * K + d, Task("U", b)) for v in range(V)]
    device_lanes.append(lane)
  stages = [[t for lane in device_lanes for s, t in lane if s == k] for k in range(S)]
  return Schedule(stages, device_lanes)


def zero_bubble_v(S: int, N: int, M: int) -> "Schedule":
  """ZB-V (Qi et al., ICLR 2024), with a flush per mini-batch: S = 2K stages on K devices in a
  V (device d holds stages d and 2K-1-d: the forward goes down the devices and back up), each
  backward split into B and W as in `zero_bubble_h1`.

  The order is the paper's (section 6): per device a warm-up of forwards, then the steady
  state F B W of the first chunk and F B W of the second, then a cool-down that fills the
  flush with the deferred W tasks (`_zbv_order`). Each stage runs its F, B and W tasks in
  micro-batch order, so every link stays FIFO. K = 2, N = 1, M = 2, as device lanes ("s.t":
  task t of stage s):

  ```
  device 0: 0.F0.0 0.F0.1 3.F0.0 3.B0.0 3.W0.0 3.F0.1 3.B0.1 3.W0.1 0.B0.0 0.W0.0 0.B0.1 0.W0.1 0.U0 3.U0
  device 1: 1.F0.0 2.F0.0 1.F0.1 2.F0.1 2.B0.0 2.W0.0 1.B0.0 1.W0.0 2.B0.1 2.W0.1 1.B0.1 1.W0.1 1.U0 2.U0
  ```
  Simulated with F, B and W of equal length: K = 4, M = 8 idles 2.0% (ZB-H1 11.1%, 1F1B
  27.3%), K = 4, M = 16 1.0%, K = 8, M = 16 2.4%; a device keeps at most 2K forwards
  without their W (K micro-batches of its whole layers: 1F1B's peak).
  """
  check_sizes(S, N, M)
  if S % 2:
    raise ValueError(f"ZB-V places two stages on each device: the stage count must be even. "
                     f"Received: {S} stages")
  K = S // 2
  order = _zbv_order(S, M)
  lanes: List[Lane] = [[] for _ in range(K)]
  for b in range(N):
    for d, tasks in enumerate(order):
      lanes[d] += [(s, Task(kind, b, i)) for s, kind, i in tasks]
      lanes[d] += [(s, Task("U", b)) for s in sorted({s for s, _, _ in tasks})]
  stages = [[t for lane in lanes for s, t in lane if s == k] for k in range(S)]
  return Schedule(stages, lanes)


def _zbv_order(S: int, M: int) -> List[List[Tuple[int, str, int]]]:
  """Per device, [(stage, kind, micro)] of one mini-batch in the paper's ZB-V order (section 6,
  figure 8), for n = max(M, 2K-1) micro-batches with those past M left out. Device d (chunk a:
  stage d, chunk b: stage 2K-1-d): warm-up with 2(K-d)-1 forwards of a, then d pairs Fb Fa,
  then K-d triples Fb Bb Wb; the steady state repeats Fa Ba Wa Fb Bb Wb until every forward
  ran; the cool-down runs d pairs Ba Bb, then K-d pairs Ba Wa (the oldest W of a), then the
  W left of b, then of a."""
  K, order = S // 2, []
  n = max(M, 2 * K - 1)
  for d in range(K):
    a, b = d, S - 1 - d
    count = {(s, kind): 0 for s in (a, b) for kind in "FBW"}
    tasks = []

    def run(s: int, kind: str, micro: Optional[int] = None) -> None:
      i = count[(s, kind)] if micro is None else micro
      count[(s, kind)] += 1
      if i < M:
        tasks.append((s, kind, i))

    def runs(*steps: Tuple[int, str]) -> None:
      for s, kind in steps:
        run(s, kind)

    for _ in range(2 * (K - d) - 1):
      run(a, "F")
    for _ in range(d):
      runs((b, "F"), (a, "F"))
    for _ in range(K - d):
      runs((b, "F"), (b, "B"), (b, "W"))
    while count[(b, "F")] < count[(a, "F")] or count[(a, "F")] < n:
      if count[(a, "F")] < n:
        run(a, "F")
      runs((a, "B"), (a, "W"), (b, "F"), (b, "B"), (b, "W"))
    for _ in range(d):
      runs((a, "B"), (b, "B"))
    for _ in range(K - d):
      runs((a, "B"), (a, "W"))
    for s in (b, a):
      while count[(s, "W")] < count[(s, "B")]:
        run(s, "W")
    order.append(tasks)
  return order
