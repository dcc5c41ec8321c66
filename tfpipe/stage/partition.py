"""Partitioning: cut a Keras Sequential or functional model into K stage sub-models.

n: layers, K: stages. Layers are taken in topological order; a cut after
layer i carries every tensor made at or before i that a later layer (or the
model output) still needs, so a skip connection crossing a cut makes the cut
carry several tensors. Stage sub-models reuse the original layers, hence the
original variables. A nested functional model (a KerasHub task's backbone) is
cut through where needed: its layers count as the model's own (`cuttable`). A layer
called on several stages (a causal LM's head calling the token embedding again)
puts its weights on each of them. Those that several stages read (a tied embedding) are
`Partition.shared`, and a synchronous schedule trains them as one (`tfpipe.rules.joint`);
a stage that holds a weight but does not read it (an untied embedding's reverse kernel on
the first stage) lists it in `Partition.unread`: its copy never steps, and the model and
checkpoints take the reader's.
"""

import collections
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import balance, names

__all__ = ["Partition", "graph_nodes", "partition", "from_cuts", "split", "STRATEGIES", "cuttable",
           "live", "shared_weights", "check_shared"]

Place = Tuple[int, int]   # a weight's place: (stage, index in its trainable variables)
Places = Tuple[Place, ...]

STRATEGIES = ("uniform", "params", "profile")

Partition = collections.namedtuple("Partition", ["stages", "cuts", "layer_names", "costs", "shared",
                                                 "unread"], defaults=((), ()))
Partition.__doc__ = """The stage sub-models, the cut positions, each stage's layer names, the
per-layer costs balanced, `shared`: per weight that several stages read, [(stage, index
in that stage's trainable variables), ...] (trainable weights only), and `unread`: per stage,
the indices of the trainable weights it holds but does not read while another stage does."""


def _functional(model: Any) -> Any:
  graph = compat.functional_graph(model)
  if graph is not None:
    return graph
  if isinstance(model, keras.Sequential):
    raise ValueError(
        f"the Sequential model {model.name!r} has no input shape yet; build it "
        "(e.g. start it with keras.Input(shape=...)) before partitioning")
  raise ValueError(
      f"only Sequential and functional Keras models can be partitioned; {model.name!r} is a "
      f"subclassed {type(model).__name__} (its layers are not a graph tfpipe can cut)")


def graph_nodes(model: Any) -> Tuple[List[Any], List[Any], List[Any]]:
  """The model's call nodes in topological order, without its input nodes (a layer called
  twice has two). Returns (inputs, outputs, nodes)."""
  fn = _functional(model)
  return list(fn.inputs), list(fn.outputs), compat.call_nodes(fn)


def cuttable(model: Any, num_stages: int = 1, named: bool = False) -> Any:
  """`model`, or the same computation with the layers of the functional models it nests as
  its own (`compat.flattened`): for a KerasHub task (its backbone is one layer of it), when
  its top level has fewer layers than `num_stages`, or when the cut names layers (`named`).
  Otherwise a nested model stays one layer (a block), as it is where its layers' names are not
  unique across the model."""
  _functional(model)
  if not compat.nested_models(model):
    return model
  top = len(graph_nodes(model)[2])
  if not (type(model).__module__.startswith("keras_hub.") or num_stages > top or named):
    return model
  try:
    return compat.flattened(model)
  except ValueError:   # layer names repeat across the nested models: they stay blocks
    return model


def _held(stages: Sequence[Any]) -> List[Tuple[Any, Places]]:
  """Per trainable weight several stages hold: [(stage, index in its trainable variables),
  ...], in stage order."""
  places = collections.defaultdict(list)
  variables = {}
  for k, stage in enumerate(stages):
    for j, v in enumerate(stage.trainable_variables):
      places[id(v)].append((k, j))
      variables[id(v)] = v
  return [(variables[key], tuple(p)) for key, p in places.items() if len(p) > 1]


def _read_by(node: Any) -> List[Any]:
  """The weights call `node` reads (`compat.variables_read`); all of its layer's where its call
  cannot be traced apart from the model (then its weights count as shared, as before any
  weight was told apart: trained as one on the synchronous schedules)."""
  try:
    return compat.variables_read(node)
  except (TypeError, ValueError, NotImplementedError, tf.errors.OpError):
    return list(node.operation.weights)


def _readers(stages: Sequence[Any],
             stage_nodes: Sequence[Sequence[Any]]) -> List[Tuple[Places, Places]]:
  """Per weight several stages hold: (the places that read it, all its places). A stage
  reads a weight when one of its call nodes (`stage_nodes[k]`) of a layer holding it does
  (one trace of that call, `_read_by`)."""
  reads = {}
  out = []
  for v, places in _held(stages):
    readers = []
    for k, j in places:
      for node in stage_nodes[k]:
        if any(w is v for w in node.operation.weights):
          if id(node) not in reads:
            reads[id(node)] = {id(w) for w in _read_by(node)}
          if id(v) in reads[id(node)]:
            readers.append((k, j))
            break
    out.append((tuple(readers), places))
  return out


def shared_weights(stages: Sequence[Any], stage_nodes: Sequence[Sequence[Any]]
                   ) -> Tuple[Tuple[Places, ...], Tuple[Tuple[int, ...], ...]]:
  """(shared, unread). `shared`: per trainable weight that several stages read, [(stage, index
  in its trainable variables), ...], in stage order. `unread`: per stage, the indices of the
  trainable weights it holds but does not read while another stage reads them.
  `stage_nodes`: each stage's call nodes (of the model cut), to tell a weight a stage reads
  from one it only holds."""
  shared: List[Places] = []
  unread: List[List[int]] = [[] for _ in stages]
  for readers, places in _readers(stages, stage_nodes):
    if len(readers) > 1:
      shared.append(readers)
    if readers:
      for k, j in places:
        if (k, j) not in readers:
          unread[k].append(j)
  return tuple(shared), tuple(tuple(j) for j in unread)


def live(inputs: Sequence[Any], outputs: Sequence[Any], nodes: Sequence[Any],
         cut: int) -> List[Any]:
  """Tensors made before position `cut` (or model inputs) needed at or after it."""
  made_before = [t for t in inputs]
  for node in nodes[:cut]:
    made_before.extend(node.outputs)
  needed = {id(t) for node in nodes[cut:] for t in node.input_tensors}
  needed |= {id(t) for t in outputs}
  return [t for t in made_before if id(t) in needed]


def split(model: Any, cuts: Sequence[int]) -> List[Any]:
  """Builds the K stage sub-models for the given cut positions (see balance.py)."""
  inputs, outputs, nodes = graph_nodes(model)
  n = len(nodes)
  if cuts[0] != 0 or cuts[-1] != n or any(a >= b for a, b in zip(cuts[:-1], cuts[1:])):
    raise ValueError(f"cuts must rise strictly from 0 to {n} (the layer count). Received: {cuts}")
  stages = []
  for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
    live_in = live(inputs, outputs, nodes, a)
    live_out = live(inputs, outputs, nodes, b) if b < n else outputs
    tensor_map = {}
    stage_inputs = []
    for i, t in enumerate(live_in):
      new = keras.Input(shape=t.shape[1:], dtype=t.dtype, name=f"stage{j}_in{i}")
      tensor_map[id(t)] = new
      stage_inputs.append(new)
    for node in nodes[a:b]:
      args, kwargs = node.arguments.fill_in(tensor_map)
      result = node.operation(*args, **kwargs)
      for old, new in zip(node.outputs, keras.tree.flatten(result)):
        tensor_map[id(old)] = new
    stage_outputs: List[Any] = []
    for t in live_out:
      out = tensor_map[id(t)]
      if any(out is x for x in stage_inputs):  # pass-through of a skip connection
        # In the tensor's own dtype: a layer of the default policy would round a float64
        # (or float16) tensor to float32 and back.
        floating = keras.backend.is_float_dtype(out.dtype)
        out = keras.layers.Identity(name=f"stage{j}_pass{len(stage_outputs)}",
                                    dtype=out.dtype if floating else None)(out)
      stage_outputs.append(out)
    stages.append(keras.Model(stage_inputs[0] if len(stage_inputs) == 1 else stage_inputs,
                              stage_outputs[0] if len(stage_outputs) == 1 else stage_outputs,
                              name=f"{model.name}_stage{j}"))
  return stages


def _param_costs(nodes: Sequence[Any]) -> List[float]:
  return [float(sum(math.prod(v.shape) for v in node.operation.weights)) for node in nodes]


def partition(model: Any, num_stages: int, strategy: Any = "uniform",
              profile: Optional[Callable[..., Any]] = None, recompute: bool = False) -> Partition:
  """Cuts `model` into `num_stages` stage sub-models.

  Args:
    model: a built Sequential or functional Keras model.
    num_stages: K.
    strategy: "uniform" (equal layer counts), "params" (balance parameter
      counts), "profile" (balance measured forward+backward time with
      PipeDream's dynamic program), or the cut positions themselves: K+1
      layer counts rising from 0 to the number of layer calls, in the order
      the model runs them (a Sequential model's `model.layers`; e.g.
      [0, 1, 5, 9] puts the first layer, such as an embedding, alone on
      stage 0; what Keras adds to the graph, such as an
      `Embedding(mask_zero=True)`'s mask, is not counted and goes with the
      layer before it), or the
      names of the K-1 layers that start stages 1..K-1 (e.g.
      ["transformer_layer_2", "transformer_layer_4", "token_embedding"]: names
      inside a nested backbone count).
    profile: for "profile", a callable nodes -> (forward_times, backward_times)
      (see `layer_profile.profile_nodes`).
    recompute: for "profile": non-last stages run each forward twice (methods
      whose backward recomputes the forward), and the balance accounts for it.

  Returns:
    A `Partition(stages, cuts, layer_names, costs)`.
  """
  explicit = isinstance(strategy, (list, tuple))
  if not explicit:
    strategy = names.lookup("partition strategy", strategy, STRATEGIES)
  named = explicit and bool(strategy) and all(isinstance(c, str) for c in strategy)
  model = cuttable(model, num_stages if isinstance(num_stages, int) else 1, named)
  _, _, nodes = graph_nodes(model)
  n = len(nodes)
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"`num_stages` must be a positive integer. Received: {num_stages!r}")
  if num_stages > n:
    raise ValueError(
        f"cannot cut model {model.name!r} into {num_stages} stages: it has {n} cuttable "
        f"layer{'s' if n != 1 else ''} ({', '.join(node.operation.name for node in nodes)})")
  if explicit and strategy and all(isinstance(c, str) for c in strategy):
    strategy = _named_cuts(model, nodes, strategy)
  elif explicit:
    strategy = _layer_cuts(model, nodes, list(strategy), num_stages)
  if explicit:
    cuts = list(strategy)
    costs = [1.0] * n
  elif strategy == "uniform":
    costs = [1.0] * n
    cuts = balance.uniform(n, num_stages)
  elif strategy == "params":
    costs = _param_costs(nodes)
    cuts = balance.min_max(costs, num_stages)
  else:
    if profile is None:
      raise ValueError("partition strategy 'profile' needs a `profile` callable")
    forward, backward = profile(nodes)
    costs = [f + b for f, b in zip(forward, backward)]
    if recompute:
      cuts = balance.min_max([c + f for c, f in zip(costs, forward)], num_stages, last_costs=costs)
    else:
      cuts = balance.min_max(costs, num_stages)
  return from_cuts(model, cuts, costs)


def from_cuts(model: Any, cuts: Sequence[int], costs: Sequence[float]) -> Partition:
  """The `Partition` of `model` (a `cuttable` one) at node positions `cuts`, whose layer
  costs were `costs`."""
  nodes = graph_nodes(model)[2]
  stages = split(model, cuts)
  layer_names = [[node.operation.name for node in nodes[a:b]] for a, b in zip(cuts[:-1], cuts[1:])]
  stage_nodes = [nodes[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
  return Partition(stages, list(cuts), layer_names, costs, *shared_weights(stages, stage_nodes))


def _layer_cuts(model: Any, nodes: Sequence[Any], cuts: Sequence[int],
                num_stages: int) -> List[int]:
  """Cut positions among `nodes` from positions among the model's layer calls in the order
  it runs them (a Sequential model's: `model.layers`): cut c starts a stage at layer call c.
  Nodes that are no layer (an operation Keras adds, such as an `Embedding(mask_zero=True)`'s
  mask) are not counted and stay with the layer before them."""
  starts = [i for i, node in enumerate(nodes) if isinstance(node.operation, keras.layers.Layer)]
  n = len(starts)
  if len(cuts) != num_stages + 1:
    raise ValueError(f"explicit cuts for {num_stages} stages need {num_stages + 1} positions "
                     f"(0, ..., {n}: the layers of model {model.name!r}). Received: {cuts}")
  if (any(not isinstance(c, int) or isinstance(c, bool) for c in cuts) or cuts[0] != 0
      or cuts[-1] != n or any(a >= b for a, b in zip(cuts[:-1], cuts[1:]))):
    raise ValueError(f"cuts must rise strictly from 0 to {n} (the layer count of model "
                     f"{model.name!r}, masks Keras adds not counted). Received: {cuts}")
  return [0] + [starts[c] for c in cuts[1:-1]] + [len(nodes)]


def _named_cuts(model: Any, nodes: Sequence[Any], first_layers: Sequence[str]) -> List[int]:
  """Cut positions from the names of the layers that start stages 1..K-1 (layers inside a
  nested model, such as a KerasHub backbone's "transformer_layer_3", count as the model's;
  a layer called twice starts a stage at its first call after the stage before's start)."""
  names = [node.operation.name for node in nodes]
  cuts = [0]
  for name in first_layers:
    if name not in names[cuts[-1] + 1:]:
      raise ValueError(f"partition names layer {name!r}, which model {model.name!r} does not "
                       f"call after {names[cuts[-1]]!r}; its layers in order: "
                       f"{', '.join(names)}")
    cuts.append(names.index(name, cuts[-1] + 1))
  return cuts + [len(nodes)]


def check_shared(model: Any, partition: Partition, method: str,
                 synchronous: Sequence[str]) -> None:
  """Refuses, in one line, weights held by several stages under a method whose stages update
  at different times (their copies would part), naming the schedules that train them."""
  if partition.shared and method not in synchronous:
    (j, a), (k, _) = partition.shared[0][:2]
    v = partition.stages[j].trainable_variables[a]
    raise ValueError(
        f"weight {v.path!r} of model {model.name!r} is used on stages {j} and {k} (a layer "
        f"called on both, such as a tied embedding), and method {method!r} (asynchronous) "
        "updates each stage on its own, so the copies would part: use one of the synchronous "
        f"schedules ({', '.join(synchronous)}), which sum their gradients into one update, or "
        "cut so that every layer using it is on one stage (partition=[...])")
