"""Layouts of one model on H hosts: data parallel, pipeline, or both, priced with the links.

H: hosts, R: replicas (data parallel), K: stages, M: micro-batches, B: the global batch. A
layout puts R replicas of a K-stage pipeline on R x K = H hosts: R = H is data parallelism
(each host the whole model, the gradients summed over the links), K = H a pipeline (each
host a stage, activations and their gradients over the links), anything between both. Each
is priced by the simulator (`tfpipe.plan.simulator`) from what a profile measured on one
host (`ModelCosts`: each stage's forward and backward seconds at its micro-batch size, taken
as one call as the executor runs it; each layer's weights' bytes; the bytes crossing each
cut) and what a probe measured of
the links (`tfpipe.plan.network.Link`):

- stage k's compute: its layers' (cut as `partition="uniform"` cuts them) at B / (R M),
  M times;
- cut k: the bytes crossing it per sample, times B / R, at the link's rate, plus the link's
  latency per micro-batch, each way;
- the gradient sum: a ring all-reduce (or a reduction to replica 0) of each stage's weights
  over R hosts, after its update's compute;
- the feed: B samples' inputs and labels from the client over its link, sent ahead.

The chosen layout is the one predicted fastest; within `TIE` of it, the one with fewer
replicas (fewer copies of the weights and optimizer state).
"""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from tfpipe.plan import balance, network, policies, simulator

__all__ = ["Layout", "ModelCosts", "Row", "layouts", "micro_batches_for", "stages",
           "predict", "rank", "report_lines", "TIE"]

TIE = 0.02   # relative: predicted samples/s this close are a tie


@dataclasses.dataclass(frozen=True)
class Layout:
  """R replicas of a K-stage `method` pipeline at M micro-batches (K = 1: data parallel)."""
  data_parallel: int
  num_stages: int
  micro_batches: int = 1
  method: str = "1f1b"

  @property
  def hosts(self) -> int:
    return self.data_parallel * self.num_stages

  @property
  def name(self) -> str:
    if self.num_stages == 1:
      return f"data parallel R={self.data_parallel}"
    pipe = f"{self.method} K={self.num_stages} M={self.micro_batches}"
    return pipe if self.data_parallel == 1 else f"{pipe} x data parallel R={self.data_parallel}"


@dataclasses.dataclass
class ModelCosts:
  """What a profile of the model measured on one host. forward[(i, j, b)], backward[(i, j, b)]:
  seconds of layers i .. j-1 taken as one stage at micro-batch size b; weights[i]: layer i's
  trainable bytes (a layer called twice counted at its first call); cut_bytes[c - 1]: bytes
  per sample crossing cut position c (c = 1 .. n - 1); feed_bytes: bytes per sample of the
  inputs and labels; update_per_byte: seconds the optimizer's update takes per byte of
  weights."""
  forward: Dict[Tuple[int, int, int], float]
  backward: Dict[Tuple[int, int, int], float]
  weights: List[float]
  cut_bytes: List[float]
  feed_bytes: float = 0.0
  update_per_byte: float = 0.0

  @property
  def layers(self) -> int:
    return len(self.weights)

  def __post_init__(self) -> None:
    n = self.layers
    if len(self.cut_bytes) != max(n - 1, 0):
      raise ValueError(f"need {n - 1} cut sizes for {n} layers. Received {len(self.cut_bytes)}")
    if set(self.forward) != set(self.backward):
      raise ValueError("need a forward and a backward time for each stage and batch size")

  def seconds(self, i: int, j: int, b: int) -> Tuple[float, float]:
    """(forward, backward) of layers i .. j-1 at micro-batch size b."""
    if (i, j, b) not in self.forward:
      raise ValueError(f"no profile of layers {i}..{j - 1} at a batch of {b}")
    return self.forward[(i, j, b)], self.backward[(i, j, b)]


@dataclasses.dataclass
class Row:
  """A layout's prediction: samples/s; link_share, the share of its step spent waiting on
  links (1 - its samples/s over its samples/s with free links); sent, the bytes the busiest
  host sends per mini-batch."""
  layout: Layout
  samples_per_second: float
  link_share: float
  sent: float


def micro_batches_for(K: int, local_batch: int) -> int:
  """M for a K-stage pipeline: 2K (the bubble's fill twice), else K, else 1, the first that
  divides the replica's batch; 1 for K = 1."""
  if K == 1:
    return 1
  return next(M for M in (2 * K, K, 1) if local_batch % M == 0)


def layouts(hosts: int, batch_size: int, num_layers: int, method: str = "1f1b") -> List[Layout]:
  """Every R x K = `hosts` whose R divides the batch and whose K the layers allow, with
  `micro_batches_for`'s M."""
  if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"hosts must be an integer >= 1. Received: {hosts!r}")
  found = []
  for R in range(1, hosts + 1):
    K = hosts // R
    if R * K != hosts or batch_size % R or K > num_layers:
      continue
    found.append(Layout(R, K, micro_batches_for(K, batch_size // R), method))
  if not found:
    raise ValueError(f"no layout of {hosts} hosts fits a batch of {batch_size} and "
                     f"{num_layers} layers")
  return found


def stages(layout: Layout, num_layers: int, batch_size: int) -> List[Tuple[int, int, int]]:
  """(first layer, end layer, micro-batch size) of each of `layout`'s stages (cut as
  `partition="uniform"` cuts)."""
  cuts = balance.uniform(num_layers, layout.num_stages)
  b = batch_size // (layout.data_parallel * layout.micro_batches)
  return [(i, j, b) for i, j in zip(cuts[:-1], cuts[1:])]


def _costs(layout: Layout, model: ModelCosts, batch_size: int, link: Optional[network.Link],
           client: Optional[network.Link], how: str) -> Tuple[simulator.Costs, float]:
  R, K, M = layout.data_parallel, layout.num_stages, layout.micro_batches
  cuts = balance.uniform(model.layers, K)
  spans = stages(layout, model.layers, batch_size)
  forward = [M * model.seconds(*span)[0] for span in spans]
  backward = [M * model.seconds(*span)[1] for span in spans]
  weights = [sum(model.weights[i:j]) for i, j, _ in spans]
  crossing = [model.cut_bytes[c - 1] * batch_size / R for c in cuts[1:-1]]
  transfer = [0.0] * (K - 1)
  reduce = [0.0] * K
  feed = 0.0
  if link is not None:
    transfer = [c / link.rate + M * link.latency for c in crossing]
    reduce = [network.reduction_seconds(w, R, link, how) for w in weights]
  if client is not None:
    feed = network.transfer_seconds(model.feed_bytes * batch_size, client)
  # The busiest host's bytes out: its activations forward (or gradients back) and its share
  # of its stage's gradient sum.
  if how == network.RING:
    summed = [2 * (R - 1) / R * w for w in weights]
  else:
    summed = [(R - 1) * w for w in weights]
  sent = max((crossing[k] if k < K - 1 else 0.0) + (crossing[k - 1] if k > 0 else 0.0)
             + summed[k] for k in range(K))
  update = model.update_per_byte * max(weights)
  return simulator.Costs(forward, backward, transfer, update, reduce=reduce, feed=feed), sent


def predict(layout: Layout, model: ModelCosts, batch_size: int,
            link: Optional[network.Link], client: Optional[network.Link] = None,
            how: str = network.RING, batches: int = 8) -> Row:
  """`layout`'s predicted samples/s with `link` between its hosts and `client` from the
  client (None: free), summing gradients by `how` (`tfpipe.plan.network`)."""
  def rate(with_links: bool) -> Tuple[float, float]:
    costs, sent = _costs(layout, model, batch_size, link if with_links else None,
                            client if with_links else None, how)
    policy = policies.policy_for(layout.method, "reuse", None, False, None)
    schedule = policies.build_schedule(policy, layout.num_stages, batches, layout.micro_batches)
    timeline = simulator.simulate(schedule, costs, recompute=policy.recompute)
    return timeline.samples_per_second(batch_size), sent
  linked, sent = rate(True)
  free, _ = rate(False)
  return Row(layout, linked, max(0.0, 1.0 - linked / free) if free else 0.0, sent)


def rank(rows: Sequence[Row]) -> List[Row]:
  """Fastest first; within `TIE` of the fastest, fewer replicas first."""
  best = max(r.samples_per_second for r in rows)
  return sorted(rows, key=lambda r: (r.samples_per_second < best * (1 - TIE),
                                     r.layout.data_parallel if r.samples_per_second
                                     >= best * (1 - TIE) else 0, -r.samples_per_second))


def report_lines(rows: Sequence[Row], link: Optional[network.Link]) -> List[str]:
  """The layouts, the chosen first, with what each spends on links."""
  where = link.describe() if link is not None else "free links"
  lines = [f"layouts over {rows[0].layout.hosts} hosts, links {where}:",
           f"{'layout':<44}{'samples/s':>10}{'on links':>10}{'MB sent':>10}  note"]
  for i, r in enumerate(rows):
    lines.append(f"{r.layout.name:<44}{r.samples_per_second:>10.0f}{r.link_share:>10.0%}"
                 f"{r.sent / 1e6:>10.1f}  {'chosen' if i == 0 else ''}".rstrip())
  return lines
