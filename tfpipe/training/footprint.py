"""A stage's memory, predicted before training: what it holds, and what a step adds.

k: stage index, M: micro-batches, W: the bytes of a stage's trainable weights. Per stage:
  weights:      its variables;
  optimizer:    the optimizer's slots and counters (built at compile);
  accumulators: gradient accumulators of micro-batched methods (built at the first epoch
                whose schedule accumulates);
  versions:     weight copies kept beyond the current weights: the plan's count of distinct
                versions a stage's kept forwards read (PipeDream K-k, 2BW 2, SpecTrain's
                predictions), less the current one, times W;
  activations:  the plan's count of forwards kept at once (GPipe M, 1F1B K-k, zero bubble's
                split backwards, interleaved and V chunks: `tfpipe.plan.verify`) times what
                one unit keeps: its inputs, and the tensors its backward reads, traced
                (`kept_per_unit`); with recomputation the inputs only, and one unit's tensors
                while a backward rebuilds them. The last stage adds its loss's: one tensor the
                size of the predictions (a cross-entropy's softmax, a squared error's
                difference);
  gradients:    one gradient per trainable weight while the backward and update run (W);
  temporaries:  the step's tensors beside those: weight-gradient products, the update's and
                the accumulation's intermediates, TEMPORARIES x the bytes of the weights
                whose gradients are dense (an embedding's table, read by a gather, gets rows
                where they reach the optimizer as rows: `rows_reach_optimizer`);
  runtime:      what a TF process holds beside tensors while it trains (its functions'
                graphs and kernels, transfers in flight): RUNTIME bytes, once per device
                (on its first stage).
TEMPORARIES and RUNTIME are fitted to the peaks measured on emulated hosts (TF servers with
their BFC allocator) across models and schedules (`bench/memory_predicted.py`, which gives
the spread and the best fit). "total" is the fields' sum: the stage's predicted peak above
what its process held before.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfpipe.instruments.memory import variable_bytes
from tfpipe.plan import policies, records, tasks as task_table
from tfpipe.stage import partition as partition_lib

__all__ = ["FIELDS", "TEMPORARIES", "RUNTIME", "kept_per_unit", "sparse_bytes", "predict",
           "unit_shapes", "rows_reach_optimizer"]

FIELDS = ("weights", "optimizer", "accumulators", "versions", "activations", "gradients",
          "temporaries", "runtime")
TEMPORARIES = 3.0        # x the bytes of weights with dense gradients
RUNTIME = 105 << 20      # bytes per device
# Ops whose output is a view of their first input: the same buffer, counted once.
_VIEWS = {"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "StopGradient",
          "Snapshot", "EnsureShape", "PreventGradient", "Bitcast"}
_NOT_HELD = {"ReadVariableOp", "Const", "Placeholder", "VarHandleOp"}


def unit_shapes(model, unit, given=None, first=False):
  """The stage inputs' shapes for `unit` samples: the model's own, their unknown dimensions
  from `given` (shapes of the whole model's inputs, batch axis first, in order: the first
  stage's inputs are they; a later stage's unknown axes, a sequence, take the length they
  share); a ValueError names an input whose shape stays unknown."""
  shapes = []
  for i, t in enumerate(model.inputs):
    dims = list(t.shape[1:])
    if any(d is None for d in dims):
      known = _known_from(dims, given, i if first else None)
      if known is None:
        raise ValueError(
            f"input {i} of {model.name!r} has unknown dimensions {tuple(t.shape)}: give the "
            "shapes of a batch (fit once, or pass input_shapes) to predict its memory")
      dims = known
    shapes.append(tf.TensorSpec([unit] + dims, t.dtype))
  return shapes


def _known_from(dims, given, index=None):
  """`dims` with their unknown sizes from `given`: those of model input `index` where it is
  one, else the one length every given shape's known axes share (a sequence length)."""
  if not given:
    return None
  if index is not None and index < len(given) and len(given[index]) == len(dims) + 1:
    filled = [d if d is not None else g for d, g in zip(dims, list(given[index])[1:])]
    return None if any(d is None for d in filled) else filled
  sizes = {d for shape in given for d in list(shape)[1:] if d is not None}
  if len(sizes) != 1:
    return None
  fill = sizes.pop()
  return [fill if d is None else d for d in dims]


def kept_per_unit(model, specs):
  """(bytes of the inputs, bytes of the tensors the backward reads) of one forward of
  `model` on inputs of `specs`: traced once with a gradient tape, the forward's tensors the
  gradient's ops read, each buffer counted once (a reshape is a view), weights left out."""
  return _stage_trace(model, specs)[:2]


def _stage_trace(model, specs):
  """(`kept_per_unit`'s two, `sparse_bytes`) from one trace."""
  inputs = sum(s.shape.num_elements() * s.dtype.size for s in specs)
  call = lambda xs: model(list(xs) if len(xs) > 1 else xs[0], training=True)
  return (inputs,) + _traced(call, model.trainable_variables, specs, read_inputs=False)


def sparse_bytes(model, specs):
  """Bytes of `model`'s trainable weights whose gradient comes as rows (IndexedSlices: an
  embedding's table read by a gather), on inputs of `specs`."""
  return _stage_trace(model, specs)[2]


def node_traced(node, shapes):
  """(bytes one call of a layer (a graph node of the model) keeps for its backward on inputs
  of `shapes` (TensorSpecs, in `node.input_tensors` order), its inputs included where its
  backward reads them (they may be another node's kept outputs too: summed over a stage's
  nodes, an upper bound); the bytes of the node's weights whose gradients come as rows)."""
  tensors = list(node.input_tensors)

  def call(xs):
    args, kwargs = node.arguments.fill_in({id(t): x for t, x in zip(tensors, xs)})
    return node.operation(*args, **kwargs)

  return _traced(call, node.operation.trainable_variables, shapes, read_inputs=True)


def _traced(call, variables, specs, read_inputs):
  """(bytes the backward reads, bytes of `variables` whose gradients are IndexedSlices)."""
  floats = [s.dtype.is_floating for s in specs]

  @tf.function(autograph=False)
  def step(*xs):
    with tf.GradientTape() as tape:
      watched = [x for x, f in zip(xs, floats) if f]
      tape.watch(watched)
      ys = [y for y in tf.nest.flatten(call(xs)) if y.dtype.is_floating]
      total = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32)) for y in ys]) if ys else 0.0
    return tape.gradient(total, list(variables) + watched)

  function = step.get_concrete_function(*specs)
  graph = function.graph
  gradients = tf.nest.flatten(function.structured_outputs, expand_composites=False)
  sparse = sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size
               for v, g in zip(variables, gradients) if isinstance(g, tf.IndexedSlices))
  ops = graph.get_operations()
  backward = {op.name for op in ops if op.name.startswith("gradient_tape/")}
  not_held = _NOT_HELD - ({"Placeholder"} if read_inputs else set())

  def root(tensor):
    while tensor.op.type in _VIEWS and tensor.op.inputs:
      tensor = tensor.op.inputs[0]
    return tensor

  held = {}
  for op in ops:
    if op.name in backward:
      continue
    for t in op.outputs:
      if not any(c.name in backward for c in t.consumers()):
        continue
      source = root(t)
      if (source.op.type in not_held or not source.shape.is_fully_defined()
          or source.dtype == tf.resource):
        continue
      held[source.ref()] = source.shape.num_elements() * source.dtype.size
  return sum(held.values()), sparse


def _outputs_per_unit(model, specs):
  """Bytes of the model's floating outputs for the units of `specs`."""
  out = model.compute_output_spec(
      [keras.Input(batch_shape=s.shape, dtype=s.dtype) for s in specs]
      if len(specs) > 1 else keras.Input(batch_shape=specs[0].shape, dtype=specs[0].dtype))
  return sum(math.prod(t.shape) * np.dtype(t.dtype).itemsize for t in tf.nest.flatten(out)
             if np.issubdtype(np.dtype(t.dtype), np.floating))


def counts(pipeline, num_batches=None):
  """(per stage, forwards kept at once; per stage, distinct weight versions they read;
  whether the stages accumulate gradients) over an epoch of `num_batches` mini-batches
  (default 2K+2, past the steady state) of the pipeline's schedule, counted as the executors
  count them (`tfpipe.plan.records.kept_peaks`)."""
  K = len(pipeline.programs)
  schedule = policies.build_schedule(pipeline.policy, K, num_batches or 2 * K + 2,
                                     pipeline.micro_batches,
                                     joint=pipeline.programs[0].updates.joint is not None)
  diffs = policies.version_differences(pipeline.policy, schedule,
                                       pipeline.options.version_difference)
  keeps = task_table.keeps_weights(pipeline.policy)
  peaks = [records.kept_peaks(tasks, diffs[k], keeps, k == K - 1)
           for k, tasks in enumerate(schedule)]
  accumulating = any(t.kind == "U" for tasks in schedule for t in tasks)
  return [p[0] for p in peaks], [p[1] for p in peaks], accumulating


def rows_reach_optimizer(pipeline, accumulating):
  """Whether an embedding's gradient reaches its stage's optimizer as rows (IndexedSlices),
  `accumulating` the schedule's micro-batches (`counts`): applied at once, or kept as rows
  by a synchronous schedule (`tfpipe.stage.updates`); never with a whole-model decision
  (clipping, loss scaling) or the replicas' own copies, which make it dense. Otherwise each
  micro-batch's is made dense and added to a dense accumulator (the asynchronous methods'
  rules are written for dense gradients), so the table counts among the dense weights."""
  program = pipeline.programs[0]
  return program.updates.rows_kept() and (not accumulating or program.embedding_rows)


def predict(pipeline, batch_size, input_shapes=None):
  """Per stage, {field: bytes} (`FIELDS`) and "total", predicted before training at
  `batch_size` (after `compile`). `input_shapes`: the model inputs' shapes where the model
  leaves some unknown (a sequence length)."""
  if not getattr(pipeline, "programs", None):
    raise RuntimeError("compile the pipeline first: its optimizer's slots and accumulators "
                       "are built there")
  if batch_size is None:
    raise ValueError("memory() needs a batch size: pass batch_size=, or fit first")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"`batch_size` must be an integer >= 1. Received: {batch_size!r}")
  M = pipeline.micro_batches or 1
  unit = -(-batch_size // M)
  states, versions, accumulating = counts(pipeline)
  as_rows = rows_reach_optimizer(pipeline, accumulating)
  ops = task_table.ops(pipeline.policy)
  current = 0 if ops["F"].reads == "predicted" else 1
  rows = []
  for k, program in enumerate(pipeline.programs):
    specs = unit_shapes(program.model, unit, input_shapes, first=k == 0)
    inputs, kept, sparse = _stage_trace(program.model, specs)
    trainable = variable_bytes(program.trainable)
    if program.is_last:
      kept += _outputs_per_unit(program.model, specs)
    if pipeline.policy.recompute and not program.is_last:
      activations = states[k] * inputs + kept
    else:
      activations = states[k] * (inputs + kept)
    row = {
        "weights": trainable + variable_bytes(program.non_trainable),
        "optimizer": variable_bytes(program.optimizer.variables),
        # Built at the first epoch whose schedule accumulates: one per trainable weight (and
        # the sum of the weights read, for delay compensation).
        "accumulators": (trainable * (2 if program.rule.delay_compensation else 1)
                         if accumulating else 0),
        "versions": max(0, versions[k] - current) * trainable,
        "activations": activations,
        "gradients": trainable,
        "temporaries": int(TEMPORARIES * max(0, trainable - (sparse if as_rows else 0))),
        "runtime": RUNTIME if pipeline.devices.index(pipeline.devices[k]) == k else 0,
    }
    row["total"] = sum(row.values())
    rows.append(row)
  return rows


def _spec(tensor, unit, given):
  dims = list(tensor.shape[1:])
  if any(d is None for d in dims):
    dims = _known_from(dims, given)
    if dims is None:
      raise ValueError(f"a tensor of shape {tuple(tensor.shape)} has unknown dimensions: give "
                       "the shapes of a batch (e.g. fit once, or pass input_shapes)")
  return tf.TensorSpec([unit] + dims, tensor.dtype)


def _per_unit(tensors, unit, given):
  return sum(_spec(t, unit, given).shape.num_elements() * tf.as_dtype(t.dtype).size
             for t in tensors)


class LayerCosts:
  """Per graph node of `model` (the partitioner's, `tfpipe.stage.partition.graph_nodes`), the
  bytes a stage holding it pays, for units of `unit` samples: `trainable` and `fixed`
  (non-trainable) weight bytes, `dense` (trainable bytes whose gradients are dense), `kept`
  (what its backward reads, `node_traced`); per cut position the bytes of the tensors crossing
  it (`inputs`, the stage's inputs), and the model outputs' (`outputs`, what the last stage's
  loss keeps)."""

  def __init__(self, model, unit, input_shapes=None):
    model_inputs, outputs, nodes = partition_lib.graph_nodes(model)
    seen = set()
    self.trainable, self.fixed, self.kept, self.dense = [], [], [], []
    for node in nodes:
      fresh = [v for v in node.operation.trainable_variables if id(v) not in seen]
      frozen = [v for v in node.operation.non_trainable_variables if id(v) not in seen]
      seen |= {id(v) for v in fresh + frozen}
      self.trainable.append(variable_bytes(fresh))
      self.fixed.append(variable_bytes(frozen))
      specs = [_spec(t, unit, input_shapes) for t in node.input_tensors]
      kept, sparse = node_traced(node, specs)
      self.kept.append(kept)
      self.dense.append(max(0, self.trainable[-1] - sparse))
    self.inputs = [_per_unit(partition_lib.live(model_inputs, outputs, nodes, a), unit,
                             input_shapes) for a in range(len(nodes))]
    self.outputs = sum(_per_unit([t], unit, input_shapes) for t in outputs
                       if tf.as_dtype(t.dtype).is_floating)

  def stage(self, k, a, b, states, versions, slots, accumulating, recompute, as_rows=True):
    """Predicted bytes of stage k holding nodes a..b-1 (`predict`'s fields summed, but for
    the device's `RUNTIME`): `states`/`versions` its plan counts, `slots` optimizer bytes per
    trainable byte, `as_rows` `rows_reach_optimizer`'s."""
    trainable = sum(self.trainable[a:b])
    dense = sum(self.dense[a:b]) if as_rows else trainable
    last = b == len(self.kept)
    kept = sum(self.kept[a:b]) + (self.outputs if last else 0)
    activations = (states * self.inputs[a] + kept if recompute and not last
                   else states * (self.inputs[a] + kept))
    return int(trainable * (1 + slots + (1 if accumulating else 0) + max(0, versions) + 1)
               + TEMPORARIES * dense + sum(self.fixed[a:b]) + activations)
