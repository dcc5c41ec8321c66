"""Which layout to train on H hosts: data parallel, a pipeline or both, chosen by the links.

  devices = tfpipe.cluster.connect(spec)
  choice = tfpipe.choose_layout(model, devices, batch_size=256)
  print("\\n".join(choice.lines))
  pipe = tfpipe.Pipeline(model, **choice.pipeline_options())

`choose_layout` probes the links between the hosts (`tfpipe.cluster.probe`: rate and
latency, each ring neighbour's), profiles each layout's stages on the first host at their
micro-batch sizes (each a call, less a call's dispatch) and the optimizer's update, and
ranks every R x K = H by the samples/s the simulator predicts (`tfpipe.plan.layouts`). Fast links favour data parallelism (each host computes the whole
model on 1/R of the batch, and the gradient sum is cheap); slow ones a pipeline (only the
activations at the cuts cross).
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfpipe.cluster import probe
from tfpipe.instruments.costs import dispatch_seconds, median_seconds
from tfpipe.plan import layouts as plan, network
from tfpipe.stage import partition
from tfpipe.training import layer_profile

__all__ = ["LayoutChoice", "choose_layout", "model_costs"]


def _itemsize(dtype) -> int:
  return np.dtype(tf.as_dtype(dtype).as_numpy_dtype).itemsize


def _per_sample(tensors) -> float:
  return float(sum(int(np.prod([d or 1 for d in t.shape[1:]])) * _itemsize(t.dtype)
                   for t in tensors))


def _labels_per_sample(outputs) -> float:
  """One int32 label per output position (sparse labels): the output's shape less its last
  axis."""
  return float(sum(4 * int(np.prod([d or 1 for d in t.shape[1:-1]])) for t in outputs))


def _update_per_byte(model, weights_bytes: float, device: str, repeats: int) -> float:
  """Seconds per byte of the model's optimizer (momentum SGD where it has none) applying
  a step to a copy of the model's trainable weights on `device`."""
  optimizer = getattr(model, "optimizer", None)
  if optimizer is None:
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
  optimizer = optimizer.__class__.from_config(optimizer.get_config())
  with tf.device(device):
    variables = [keras.Variable(tf.zeros(v.shape, v.dtype), trainable=True)
                 for v in model.trainable_weights]
    grads = [tf.zeros(v.shape, v.dtype) for v in variables]
    optimizer.build(variables)

  @tf.function(autograph=False)
  def step():
    with tf.device(device):
      optimizer.apply(grads, variables)
      return tf.constant(0)

  seconds = max(0.0, median_seconds(step, repeats) - dispatch_seconds(device))
  return seconds / weights_bytes if weights_bytes else 0.0


def _stage_seconds(stage: keras.Model, batch_size: int, device: str, repeats: int,
                   dispatch: float, rng) -> Tuple[float, float]:
  """(forward, backward) seconds of `stage` (its weights on `device`) at `batch_size`, each
  one call as the executor traces a task (its outputs summed there), less a call's
  dispatch."""
  with tf.device(device):
    xs = [layer_profile.example(t, batch_size, rng) for t in stage.inputs]

  def total(ys):
    return tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32)) for y in tf.nest.flatten(ys)
                     if y.dtype.is_floating])

  @tf.function(autograph=False)
  def forward(*xs):
    with tf.device(device):
      return total(stage(list(xs) if len(xs) > 1 else xs[0], training=True))

  @tf.function(autograph=False)
  def forward_backward(*xs):
    with tf.device(device):
      floats = [x for x in xs if x.dtype.is_floating]
      with tf.GradientTape() as tape:
        tape.watch(floats)
        y = total(stage(list(xs) if len(xs) > 1 else xs[0], training=True))
      grads = tape.gradient(y, stage.trainable_variables + floats,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      return total(grads) + y

  f = median_seconds(lambda: forward(*xs), repeats)
  fb = median_seconds(lambda: forward_backward(*xs), repeats)
  return max(0.0, f - dispatch), max(0.0, fb - f)


def model_costs(model: keras.Model, found: Sequence[plan.Layout], batch_size: int, device: str,
                num_stages: int = 1, repeats: int = 5) -> plan.ModelCosts:
  """`model`'s stages in each of the layouts `found` (`plan.ModelCosts`) at global batch
  `batch_size`, profiled on `device` (cut as `partition` cuts it into `num_stages`): a copy
  of the model made there (its weights initialised, not copied: only their shapes count)."""
  with tf.device(device):   # the weights there: a layer reading them from here times the link
    copy = partition.cuttable(keras.models.clone_model(model), num_stages)
  inputs, outputs, nodes = partition.graph_nodes(copy)
  n, dispatch, rng = len(nodes), dispatch_seconds(device), np.random.default_rng(0)
  forward, backward = {}, {}
  for layout in found:
    spans = plan.stages(layout, n, batch_size)
    made = partition.split(copy, [0] + [j for _, j, _ in spans])
    for stage, span in zip(made, spans):
      if span not in forward:
        forward[span], backward[span] = _stage_seconds(stage, span[2], device, repeats,
                                                       dispatch, rng)
  seen, weights = set(), []
  for node in nodes:
    fresh = [v for v in node.operation.trainable_weights if id(v) not in seen]
    seen.update(id(v) for v in fresh)
    weights.append(float(sum(int(np.prod(v.shape)) * _itemsize(v.dtype) for v in fresh)))
  cut_bytes = [_per_sample(partition.live(inputs, outputs, nodes, c)) for c in range(1, n)]
  feed = _per_sample(inputs) + _labels_per_sample(outputs)
  return plan.ModelCosts(forward, backward, weights, cut_bytes, feed,
                         _update_per_byte(model, sum(weights), device, repeats))


@dataclasses.dataclass
class LayoutChoice:
  """What `choose_layout` found: the ranked rows (chosen first), the links it priced, the
  report lines, and the devices and gradient sum the layouts use."""
  rows: List[plan.Row]
  link: Optional[network.Link]
  client: Optional[network.Link]
  lines: List[str]
  devices: List[str]
  cross_device_ops: str

  @property
  def layout(self) -> plan.Layout:
    return self.rows[0].layout

  def pipeline_options(self, layout: Optional[plan.Layout] = None) -> Dict[str, object]:
    """The `tfpipe.Pipeline` arguments (besides the model) that train `layout` (None: the
    chosen one)."""
    L = layout or self.layout
    options: Dict[str, object] = {"devices": self.devices[:L.hosts],
                                  "data_parallel": L.data_parallel, "method": L.method,
                                  "micro_batches": L.micro_batches}
    if L.data_parallel > 1:
      options["cross_device_ops"] = self.cross_device_ops
    return options


def choose_layout(model: keras.Model, devices: Sequence[str], batch_size: int,
                  link: Optional[network.Link] = None,
                  client_link: Optional[network.Link] = None,
                  cross_device_ops: str = network.RING, method: str = "1f1b",
                  print_fn: Optional[Callable[[str], object]] = None) -> LayoutChoice:
  """Ranks the layouts of `model` on `devices` (one per host) at global batch `batch_size`.

  link: the links between the hosts (None: probed, the slowest of the ring neighbours').
  client_link: from this program to the first host (None: probed). cross_device_ops: how
  replicas sum their gradients ("ring", or "reduce_to_one_device"). method: the synchronous
  schedule the pipelines run. print_fn: called with each report line (e.g. `print`)."""
  devices = list(devices)
  if len(devices) < 2 or len(set(devices)) != len(devices):
    raise ValueError(f"choose_layout needs 2 or more distinct devices, one per host. "
                     f"Received: {devices}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive integer. Received: {batch_size!r}")
  if method not in ("1f1b", "gpipe", "zb"):
    raise ValueError(f"layouts run a synchronous schedule, 'gpipe', '1f1b' or 'zb'. "
                     f"Received: {method!r}")
  network.check_how(cross_device_ops)
  H = len(devices)
  nodes = partition.graph_nodes(partition.cuttable(model, H))[2]
  found = plan.layouts(H, batch_size, len(nodes), method)
  if link is None:
    link = network.slowest(probe.ring_links(devices))
  if client_link is None:
    client_link = probe.client_links(devices[:1])[0]
  costs = model_costs(model, found, batch_size, devices[0], H)
  rows = plan.rank([plan.predict(l, costs, batch_size, link, client_link, cross_device_ops)
                    for l in found])
  lines = plan.report_lines(rows, link)
  if print_fn is not None:
    for line in lines:
      print_fn(line)
  return LayoutChoice(rows, link, client_link, lines, devices, cross_device_ops)
