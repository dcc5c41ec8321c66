"""Partitioning: cut a Keras Sequential or functional model into K stage sub-models.

n: layers, K: stages. Layers are taken in topological order; a cut after
layer i carries every tensor made at or before i that a later layer (or the
model output) still needs, so a skip connection crossing a cut makes the cut
carry several tensors. Stage sub-models reuse the original layers, hence the
original variables.
"""

import collections
import math

import keras

from tfpipe.plan import balance, names

__all__ = ["Partition", "graph_nodes", "partition", "split", "STRATEGIES"]

STRATEGIES = ("uniform", "params", "profile")

Partition = collections.namedtuple("Partition", ["stages", "cuts", "layer_names", "costs"])


def _functional(model):
  if isinstance(model, keras.Sequential):
    if getattr(model, "_functional", None) is None:
      raise ValueError(
          f"the Sequential model {model.name!r} has no input shape yet; build it "
          "(e.g. start it with keras.Input(shape=...)) before partitioning")
    return model._functional
  if hasattr(model, "_nodes_by_depth") and getattr(model, "inputs", None):
    return model
  raise ValueError(
      f"only Sequential and functional Keras models can be partitioned; {model.name!r} is a "
      f"subclassed {type(model).__name__} (its layers are not a graph tfpipe can cut)")


def graph_nodes(model):
  """The model's call nodes in topological order, without its input nodes.

  Returns (inputs, outputs, nodes). Raises ValueError for a layer called more
  than once (a shared layer cannot sit on one side of a cut).
  """
  fn = _functional(model)
  nodes = []
  for depth in sorted(fn._nodes_by_depth, reverse=True):
    for node in fn._nodes_by_depth[depth]:
      if node.operation is not None and not node.is_input:
        nodes.append(node)
  counts = collections.Counter(id(node.operation) for node in nodes)
  for node in nodes:
    if counts[id(node.operation)] > 1:
      raise ValueError(
          f"layer {node.operation.name!r} is called {counts[id(node.operation)]} times in the "
          "model; tfpipe cuts at layer boundaries and needs every layer called once")
  return list(fn.inputs), list(fn.outputs), nodes


def _live(inputs, outputs, nodes, cut):
  """Tensors made before position `cut` (or model inputs) needed at or after it."""
  made_before = [t for t in inputs]
  for node in nodes[:cut]:
    made_before.extend(node.outputs)
  needed = {id(t) for node in nodes[cut:] for t in node.input_tensors}
  needed |= {id(t) for t in outputs}
  return [t for t in made_before if id(t) in needed]


def split(model, cuts):
  """Builds the K stage sub-models for the given cut positions (see balance.py)."""
  inputs, outputs, nodes = graph_nodes(model)
  n = len(nodes)
  if cuts[0] != 0 or cuts[-1] != n or any(a >= b for a, b in zip(cuts[:-1], cuts[1:])):
    raise ValueError(f"cuts must rise strictly from 0 to {n} (the layer count). Received: {cuts}")
  stages = []
  for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
    live_in = _live(inputs, outputs, nodes, a)
    live_out = _live(inputs, outputs, nodes, b) if b < n else outputs
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
    stage_outputs = []
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


def _param_costs(nodes):
  return [float(sum(math.prod(v.shape) for v in node.operation.weights)) for node in nodes]


def partition(model, num_stages, strategy="uniform", profile=None, recompute=False):
  """Cuts `model` into `num_stages` stage sub-models.

  Args:
    model: a built Sequential or functional Keras model.
    num_stages: K.
    strategy: "uniform" (equal layer counts), "params" (balance parameter
      counts), "profile" (balance measured forward+backward time with
      PipeDream's dynamic program), or the cut positions themselves: K+1
      layer counts rising from 0 to the number of layers (e.g. [0, 1, 5, 9]
      puts the first layer, such as an embedding, alone on stage 0).
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
  _, _, nodes = graph_nodes(model)
  n = len(nodes)
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"`num_stages` must be a positive integer. Received: {num_stages!r}")
  if num_stages > n:
    raise ValueError(
        f"cannot cut model {model.name!r} into {num_stages} stages: it has {n} cuttable "
        f"layer{'s' if n != 1 else ''} ({', '.join(node.operation.name for node in nodes)})")
  if explicit:
    cuts = list(strategy)
    if len(cuts) != num_stages + 1:
      raise ValueError(f"explicit cuts for {num_stages} stages need {num_stages + 1} positions "
                       f"(0, ..., {n}). Received: {cuts}")
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
  stages = split(model, cuts)
  layer_names = [[node.operation.name for node in nodes[a:b]] for a, b in zip(cuts[:-1], cuts[1:])]
  _check_no_shared_weights(model, stages, layer_names)
  return Partition(stages, cuts, layer_names, costs)


def _check_no_shared_weights(model, stages, layer_names):
  """Refuses a cut that puts one weight on two stages (a KerasHub causal LM's head calling the
  backbone's token embedding in reverse): each stage would train its own copy, and they would
  part. Weights shared within one stage are fine."""
  owner = {}
  for k, stage in enumerate(stages):
    for v in stage.weights:
      j = owner.setdefault(id(v), k)
      if j != k:
        raise ValueError(
            f"weight {v.path!r} of model {model.name!r} is used on stages {j} and {k} "
            f"({', '.join(layer_names[j])} / {', '.join(layer_names[k])}): tied weights across "
            "stages are not supported yet. Cut so that every layer using it is on one stage "
            "(partition=[...]), or untie them")
