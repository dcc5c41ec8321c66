"""Every private Keras and TensorFlow internal tfpipe reads, in one place.

tfpipe takes the train step's semantics from Keras's own machinery: the loss
and metric containers `keras.Model.compile` builds (`CompileLoss`,
`CompileMetrics`: names, weighting, reduction, "accuracy" resolved from the
labels' shape), the optimizer state that `get_config` does not carry
(`exclude_from_weight_decay`, the update count, a variable's slot index, Adam's
moment slots), the model's metric list that callbacks read, a functional model's graph
(its call nodes, and the variables one call reads). From TensorFlow: the payload that
marks a derived error, the profiler's converter from a profile to trace events, the
per-replica values that `tf.distribute`'s cross-device ops reduce, and whether the runtime
has started (the bench scripts fork their measurements before it has). Keras and
TensorFlow may move these: `missing()` names what the installed versions lack (with
`tuning`'s), and a test fails loudly on it.
"""

import logging
from typing import Any, Dict, List, Sequence, Tuple

import keras
import tensorflow as tf
from keras.src.trainers import compile_utils as _compile_utils
from keras.src.trainers import data_adapters as _data_adapters
from tensorflow.python.distribute import values as _tf_distribute_values
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.framework import func_graph as _tf_func_graph
from tensorflow.python.framework import ops as _tf_ops

from tfpipe.compat import tuning

__all__ = ["CompileLoss", "CompileMetrics", "MetricsList", "missing", "functional_graph",
           "call_nodes", "all_layers", "variables_read", "nested_models", "flattened",
           "overrides_compile", "compile_arguments", "data_adapter",
           "copy_weight_decay_exclusions", "trainer_overrides", "is_derived", "per_replica",
           "variable_index", "adam_moments", "uses_weight_decay", "update_count",
           "set_update_count", "learning_rate_value", "model_metrics", "profile_trace_events",
           "profile_events",
           "runtime_started", "num_workers", "drop_reduction_notices"]

# The payload TensorFlow puts on an error that only follows another one (a cancelled receive).
_DERIVED = b"type.googleapis.com/tensorflow.DerivedStatus"


CompileLoss = _compile_utils.CompileLoss


CompileMetrics = _compile_utils.CompileMetrics


MetricsList = _compile_utils.MetricsList


# Optimizer attributes that `exclude_from_weight_decay` sets and `get_config` leaves out.
_EXCLUDED_VARIABLES = "_exclude_from_weight_decay"


_EXCLUDED_PATTERN = "_exclude_from_weight_decay_pattern"


# Adam's first and second moment slots, one per variable (`variable_index`).
_ADAM_MOMENTS = ("_momentums", "_velocities")


# The train-step methods of keras.Model a subclass may override (tfpipe runs its own step).
_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def missing():
  """The Keras internals tfpipe needs that the installed Keras lacks (names), [] when none."""
  optimizer = keras.optimizers.Optimizer
  needs = [(_compile_utils, "CompileLoss"), (_compile_utils, "CompileMetrics"),
           (_compile_utils, "MetricsList"), (optimizer, "_var_key"),
           (optimizer, "_use_weight_decay"), (optimizer, "_get_variable_index"),
           (optimizer, "exclude_from_weight_decay")]
  needs += [(_data_adapters, "get_data_adapter")]
  probe_model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
  probe_model.compile(optimizer="sgd", loss="mse")
  if not hasattr(getattr(probe_model, "_compile_config", None), "config"):
    needs.append((probe_model, "_compile_config"))
  graph = getattr(probe_model, "_functional", None)
  needs += [(graph, "_run_through_graph"), (graph, "_inputs_struct"), (graph, "_nodes_by_depth")]
  needs += [(_tf_context, "FunctionCallOptions"), (_tf_context.Context, "function_call_options"),
            (_tf_distribute_values, "PerReplica"),
            (_tf_context.FunctionCallOptions, "config_proto_serialized"),
            (_tf_func_graph.FuncGraph, "capture_call_time_value"),
            (_tf_ops.Graph, "create_op"), (_tf_ops.Operation, "_add_control_input"),
            (tf.raw_ops, "VariableV2"), (_tf_ops, "_gradient_registry")]
  gone = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needs
          if not hasattr(owner, name)]
  if not isinstance(getattr(getattr(_tf_ops, "_gradient_registry", None), "_registry", {}).get(
      "Pow"), dict):
    gone.append("the gradient registry's Pow entry")
  gone += tuning.missing()
  probe = keras.optimizers.AdamW()
  probe.exclude_from_weight_decay(var_names=["probe"])
  gone += [f"Optimizer.{a}" for a in (_EXCLUDED_VARIABLES, _EXCLUDED_PATTERN, "_iterations",
                                       "_learning_rate") if not hasattr(probe, a)]
  probe.build([keras.Variable([0.0])])
  gone += [f"Adam.{a}" for a in _ADAM_MOMENTS if not hasattr(probe, a)]
  if not hasattr(keras.Model(), "_metrics"):
    gone.append("Model._metrics")
  if not hasattr(_tf_context.context(), "_initialized"):
    gone.append("Context._initialized")
  try:
    _profiler_modules()
  except ImportError as error:
    gone.append(f"the profiler's trace converter ({error})")
  return gone


def functional_graph(model: Any) -> Any:
  """The functional graph of `model` (a Sequential's own), or None for a subclassed model."""
  if isinstance(model, keras.Sequential):
    return getattr(model, "_functional", None)
  if hasattr(model, "_nodes_by_depth") and getattr(model, "inputs", None):
    return model
  return None


def call_nodes(graph: Any) -> List[Any]:
  """The call nodes of a functional graph in topological order, without its input nodes (a
  layer called twice has two)."""
  return [node for depth in sorted(graph._nodes_by_depth, reverse=True)
          for node in graph._nodes_by_depth[depth]
          if node.operation is not None and not node.is_input]


def _operations(graph: Any) -> List[Any]:
  return [node.operation for node in call_nodes(graph)]


def all_layers(model: Any) -> List[Any]:
  """Every layer of `model`, those of nested layers and models too (Keras's own walk)."""
  return list(model._flatten_layers(include_self=False))  # noqa: SLF001


def variables_read(node: Any) -> List[Any]:
  """The Keras variables a functional graph's call `node` reads: its call traced once in a
  graph, with placeholders of its symbolic arguments' shapes and dtypes, under a tape that
  sees each variable read (a layer called twice may read different weights each time, as a
  causal LM's untied reverse embedding)."""
  args, kwargs = node.arguments.args, node.arguments.kwargs
  flat = keras.tree.flatten((args, kwargs))
  symbolic = [i for i, t in enumerate(flat) if isinstance(t, keras.KerasTensor)]
  specs = [tf.TensorSpec(flat[i].shape, flat[i].dtype) for i in symbolic]
  watched = []

  def call(*tensors):
    values = list(flat)
    for i, tensor in zip(symbolic, tensors):
      values[i] = tensor
    a, k = keras.tree.pack_sequence_as((args, kwargs), values)
    with tf.GradientTape() as tape:
      node.operation(*a, **k)
    watched.extend(tape.watched_variables())

  tf.function(call, autograph=False).get_concrete_function(*specs)
  handles = {id(v) for v in watched}
  return [v for v in node.operation.weights if id(getattr(v, "_value", v)) in handles]


def nested_models(model: Any) -> List[Any]:
  """The functional (or Sequential) models `model`'s graph calls as layers: a KerasHub task's
  backbone, say."""
  graph = functional_graph(model)
  if graph is None:
    return []
  return [op for op in _operations(graph) if isinstance(op, keras.Model) and functional_graph(op)]


def flattened(model: Any) -> Any:
  """A functional model computing what `model` computes, with every nested functional model
  (a KerasHub task's backbone) replaced by its own layers, called on the outer tensors: the
  same layer objects, so the same variables. Its inputs keep `model`'s names and order."""
  graph = functional_graph(model)

  def inline(op):
    inner = functional_graph(op) if isinstance(op, keras.Model) else None
    if inner is None:
      return op

    def call(inputs, *args, **kwargs):
      del args, kwargs   # training and mask: a stage's call passes its own
      # The inner model's inputs are its input structure flattened (a dict's by sorted keys),
      # as the call's own structure flattens.
      return inner._run_through_graph(keras.tree.flatten(inputs), operation_fn=inline)
    return call

  inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name) for t in graph.inputs]
  outputs = graph._run_through_graph(inputs, operation_fn=inline)
  structure = keras.tree.pack_sequence_as(graph._inputs_struct, inputs)
  return keras.Model(structure, outputs, name=model.name)


def overrides_compile(model):
  """Whether `model`'s class has a `compile` of its own (a KerasHub task: defaults of its own
  for the optimizer, loss and metrics)."""
  return type(model).compile is not keras.Model.compile


_COMPILE_ARGUMENTS = ("optimizer", "loss", "loss_weights", "metrics", "weighted_metrics")


def compile_arguments(model, given):
  """The optimizer, loss, loss weights, metrics and weighted metrics `model.compile(**given)`
  resolves (its own defaults for what `given` leaves out), as it passes them to
  `keras.Model.compile`. It compiles `model` with them, as the user's own call would."""
  model.compile(**given)
  config = model._compile_config.config
  return {name: config.get(name) for name in _COMPILE_ARGUMENTS}


def data_adapter(x, steps=None, shuffle=False, class_weight=None):
  """Keras's own data adapter for `x` (a `keras.utils.PyDataset`, a Python generator or
  iterator): what `model.fit` turns such data into (`get_tf_dataset`, `num_batches`, and the
  `on_epoch_begin` / `on_epoch_end` hooks that start and stop a PyDataset's workers)."""
  return _data_adapters.get_data_adapter(x, steps_per_epoch=steps, shuffle=shuffle,
                                         class_weight=class_weight)


def copy_weight_decay_exclusions(source: Any, target: Any,
                                 variable_pairs: Sequence[Tuple[Any, Any]]) -> None:
  """Gives `target` (a stage's optimizer, not built yet) the weight-decay exclusions set on
  `source` with `exclude_from_weight_decay`: the variables of `source` map to the stage's
  copies through `variable_pairs` [(model variable, stage variable)]; names match as they
  are (a stage variable's name ends with its model variable's name)."""
  keys = getattr(source, _EXCLUDED_VARIABLES, None)
  pattern = getattr(source, _EXCLUDED_PATTERN, None)
  if not keys and pattern is None:
    return
  key = source._var_key  # pylint: disable=protected-access
  excluded = [own for src, own in variable_pairs if keys and key(src) in keys]
  target.exclude_from_weight_decay(var_list=excluded or None)
  setattr(target, _EXCLUDED_PATTERN, pattern)


def trainer_overrides(model):
  """The train-step methods `type(model)` overrides from keras.Model, in Keras's order."""
  return [name for name in _STEP_METHODS
          if getattr(type(model), name, None) is not getattr(keras.Model, name, None)]


def is_derived(error: BaseException) -> bool:
  """Whether a TensorFlow error only followed another one (TensorFlow marks it derived): a
  function that calls others across devices may report such a cancellation instead of the
  first error."""
  return _DERIVED in (getattr(error, "experimental_payloads", None) or {})


def per_replica(values: Sequence[Any]) -> Any:
  """`values` (one tensor per replica device) as the `tf.distribute.DistributedValues` that a
  `tf.distribute.CrossDeviceOps` reduces (`tfpipe.stage.reduction`)."""
  return _tf_distribute_values.PerReplica(values)


# Optimizer internals.

def variable_index(optimizer, variable):
  """The index of `variable`'s slots (momentums, velocities) in `optimizer`."""
  return optimizer._get_variable_index(variable)  # pylint: disable=protected-access


def adam_moments(optimizer, index):
  """(m, v): the first and second moment slots of an Adam's variable `index`."""
  return tuple(getattr(optimizer, name)[index] for name in _ADAM_MOMENTS)


def uses_weight_decay(optimizer, variable):
  """Whether `optimizer` decays `variable` (not excluded from weight decay)."""
  return optimizer._use_weight_decay(variable)  # pylint: disable=protected-access


def update_count(optimizer):
  """`optimizer`'s count of updates, not divided by gradient_accumulation_steps."""
  return int(optimizer._iterations.numpy())  # pylint: disable=protected-access


def set_update_count(optimizer, count):
  """Sets `optimizer`'s count of updates (`iterations` divides it by
  gradient_accumulation_steps when that is set): the tf.Variable under Keras's, 40 us, not 90."""
  optimizer._iterations.value.assign(count)  # pylint: disable=protected-access


def learning_rate_value(optimizer):
  """`optimizer`'s learning rate as stored: a variable, or a schedule (a LossScaleOptimizer's:
  its inner optimizer's, which its `learning_rate` reads and writes)."""
  if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    optimizer = optimizer.inner_optimizer
  return optimizer._learning_rate  # pylint: disable=protected-access


def model_metrics(model):
  """The list of metrics `model.metrics` reads (callbacks see the pipeline's through it)."""
  return model._metrics  # pylint: disable=protected-access


# The profiler.

def _profiler_modules() -> Tuple[Any, Any]:
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin
  from tensorflow.tsl.profiler.protobuf import trace_events_pb2
  return plugin, trace_events_pb2


def profile_trace_events(path: str) -> List[Tuple[str, int, int, Dict[str, Any]]]:
  """The trace events of one `.xplane.pb` profile file, through TensorFlow's own converter:
  [(name, start ps, duration ps, args)]."""
  plugin, trace_events_pb2 = _profiler_modules()
  data, ok = plugin.xspace_to_tools_data([path], "trace_viewer", {})
  if not ok:
    raise RuntimeError(f"the profile {path} could not be read: {data[:200]!r}")
  trace = trace_events_pb2.Trace.FromString(data)
  return [(e.name, e.timestamp_ps, e.duration_ps, dict(e.args)) for e in trace.trace_events]


def profile_events(path):
  """Every event of one `.xplane.pb` profile file, read from the profile itself (TensorFlow's
  trace-viewer converter keeps a sample of a large trace's events: a Llama's stage kept 20 of
  23,178): [(name, start ps, duration ps, args)] as `profile_trace_events` gives them, an
  op's args holding its "long_name" ("NAME:TYPE")."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    space = xplane_pb2.XSpace.FromString(f.read())
  out = []
  for plane in space.planes:
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}

    def value(stat):
      which = stat.WhichOneof("value")
      got = getattr(stat, which) if which else None
      return stat_names.get(got, got) if which == "ref_value" else got

    for line in plane.lines:
      base = line.timestamp_ns * 1000
      for event in line.events:
        meta = plane.event_metadata[event.metadata_id]
        args = {stat_names.get(s.metadata_id, str(s.metadata_id)): value(s)
                for s in list(meta.stats) + list(event.stats)}
        if meta.display_name and ":" in meta.name:   # an op: "NAME:TYPE"
          args["long_name"] = meta.name
        out.append((meta.display_name or meta.name, base + event.offset_ps, event.duration_ps,
                    args))
  return out


def runtime_started():
  """Whether this process has started TensorFlow's runtime (run an op, listed or configured
  its devices): a process forked after that would share it."""
  context = _tf_context.context_safe()
  return context is not None and context._initialized  # noqa: SLF001


def num_workers(strategy):
  """The worker processes a multi-worker `tf.distribute` strategy spans."""
  return strategy.extended._num_workers


class _ReductionNotices(logging.Filter):
  """Drops `tf.distribute`'s INFO notice of each traced reduction ("Reduce to ... then
  broadcast to ..."): a replicated stage traces one per weight group."""

  def filter(self, record):
    return not (record.levelno == logging.INFO
                and str(record.msg).startswith("Reduce to "))


_NOTICES = _ReductionNotices()


def drop_reduction_notices() -> None:
  """Keeps TensorFlow's logger from printing a line per traced cross-device reduction."""
  logger = tf.get_logger()
  if _NOTICES not in logger.filters:
    logger.addFilter(_NOTICES)
