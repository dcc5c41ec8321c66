"""Every private Keras and TensorFlow internal tfpipe reads, in one place.

tfpipe takes the train step's semantics from Keras's own machinery: the loss
and metric containers `keras.Model.compile` builds (`CompileLoss`,
`CompileMetrics`: names, weighting, reduction, "accuracy" resolved from the
labels' shape), the optimizer state that `get_config` does not carry
(`exclude_from_weight_decay`, the update count, a variable's slot index, Adam's
moment slots), and the model's metric list that callbacks read. From TensorFlow:
the call options of function calls (the compiled executor's unoptimised window graph), the
gradient registry's entry for Pow (a constant exponent kept constant in a backward function), the
placeholders a traced function feeds at each call (the window groups' carry), the
call-op attribute that skips shape inference through a callee's body (done
once per callee and input signature instead), a control input that spares
TensorFlow's XLA pass a scan of every call's callee, the
payload that marks a derived error, the profiler's converter from a
profile to trace events, the per-replica values that `tf.distribute`'s
cross-device ops reduce, whether the runtime has started (the bench scripts fork
their measurements before it has), and how `tf.function` counts retraces (by code
object). Keras and TensorFlow may move these: `missing()` names what the installed
versions lack, and a test fails loudly on it.
"""

import contextlib
import functools
import logging
import threading

import keras
import tensorflow as tf
from keras.src.trainers import compile_utils as _compile_utils
from keras.src.trainers import data_adapters as _data_adapters
from tensorflow.core.framework import attr_value_pb2 as _tf_attr_value_pb2
from tensorflow.python.distribute import values as _tf_distribute_values
from tensorflow.python.eager import backprop_util as _tf_backprop_util
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.eager.polymorphic_function import (
    function_type_utils as _tf_function_type_utils)
from tensorflow.python.framework import func_graph as _tf_func_graph
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.framework import tensor_util as _tf_tensor_util
from tensorflow.python.ops import resource_variable_ops as _tf_resource_variables

__all__ = ["CompileLoss", "CompileMetrics", "MetricsList", "missing",
           "copy_weight_decay_exclusions", "trainer_overrides", "unoptimised_calls", "optimised_calls",
           "light_calls",
           "calls_inferred_once", "calls_marked", "constant_exponents", "NOT_INLINED", "call_time_value",
           "ResidualCall",
           "is_derived", "variable_index", "adam_moments", "uses_weight_decay", "update_count",
           "set_update_count", "learning_rate_value", "model_metrics", "profile_trace_events",
           "per_replica", "runtime_started", "data_adapter", "nested_models", "flattened",
           "overrides_compile", "compile_arguments", "own_function", "untracked_variable",
           "empty_value", "variables_read"]

# `tf.function(experimental_attributes=NOT_INLINED)`: calls of the function from another
# function's graph stay calls (instantiated and optimised once), not copies of its body.
NOT_INLINED = {"_noinline": True}


def own_function(fn, **options):
  """`tf.function(fn, **options)` whose traces TensorFlow counts for this function alone.

  TensorFlow warns that a function retraces ("5 out of the last 5 calls to ... triggered
  tf.function retracing") counting the traces of every function made from one Python code
  object: every stage's task functions (and every pipeline's windows) share theirs, so one
  `method="auto"` pipeline at K=8, or a process that builds several pipelines, read as one
  function retracing, though each traced once. A partial has no code object, so TensorFlow
  counts by the function itself: one that does retrace still warns."""
  own = functools.partial(fn)
  own.__name__ = getattr(fn, "__name__", "function")   # the traced graph's name, as before
  return tf.function(own, **options)


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
  gone += _residual_calls_missing()
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


def functional_graph(model):
  """The functional graph of `model` (a Sequential's own), or None for a subclassed model."""
  if isinstance(model, keras.Sequential):
    return getattr(model, "_functional", None)
  if hasattr(model, "_nodes_by_depth") and getattr(model, "inputs", None):
    return model
  return None


def call_nodes(graph):
  """The call nodes of a functional graph in topological order, without its input nodes (a
  layer called twice has two)."""
  return [node for depth in sorted(graph._nodes_by_depth, reverse=True)
          for node in graph._nodes_by_depth[depth]
          if node.operation is not None and not node.is_input]


def _operations(graph):
  return [node.operation for node in call_nodes(graph)]


def all_layers(model):
  """Every layer of `model`, those of nested layers and models too (Keras's own walk)."""
  return list(model._flatten_layers(include_self=False))  # noqa: SLF001


def variables_read(node):
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


def nested_models(model):
  """The functional (or Sequential) models `model`'s graph calls as layers: a KerasHub task's
  backbone, say."""
  graph = functional_graph(model)
  if graph is None:
    return []
  return [op for op in _operations(graph) if isinstance(op, keras.Model) and functional_graph(op)]


def flattened(model):
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


def copy_weight_decay_exclusions(source, target, variable_pairs):
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


@contextlib.contextmanager
def unoptimised_calls():
  """Function calls made in this context skip Grappler: what the compiled executor's window
  functions run under. A window's graph is calls of the stages' task functions (each
  optimised once, with the options it was traced under) and the tensors between them;
  optimising it again per window shape cost more than half the start-up (measured) and
  gained nothing. The call options are part of a function's cache key: every call of one
  function must use the same. A window traced on such a call makes its task calls under
  `optimised_calls`."""
  ctx = _tf_context.context()
  before = ctx.function_call_options
  config = ctx.config
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = _tf_context.FunctionCallOptions(
      executor_type=before.executor_type, config_proto=config)
  _OUTER_OPTIONS.append(before)
  try:
    yield
  finally:
    _OUTER_OPTIONS.pop()
    ctx.function_call_options = before


_OUTER_OPTIONS = []   # the call options each open `unoptimised_calls` replaced


@contextlib.contextmanager
def optimised_calls():
  """Calls traced in this context (inside `unoptimised_calls`: a window traced on its first
  call) take the options from before it, so the task functions they call are optimised (with
  one round of Grappler's optimizers: `_task_options`)."""
  if not _OUTER_OPTIONS:
    yield
    return
  ctx = _tf_context.context()
  now, ctx.function_call_options = ctx.function_call_options, _task_options(_OUTER_OPTIONS[-1])
  try:
    yield
  finally:
    ctx.function_call_options = now


_TASK_OPTIONS = {}   # serialized outer config -> the task calls' options
_LIGHT_OPTIONS = {}   # (serialized config, layout) -> the inlined windows' call options


def _lighten(rewrite, layout=True):
  """One round of Grappler's optimizers, without the memory optimizer and the loop optimizer,
  which found nothing to change in a window's graph (measured: 0 nodes changed, a quarter of
  Grappler's time for an inlined window), and without the layout optimizer unless `layout`
  (it converts convolutions' layouts for GPUs)."""
  rewrite.meta_optimizer_iterations = rewrite.ONE
  rewrite.memory_optimization = rewrite.NO_MEM_OPT
  rewrite.loop_optimization = rewrite.OFF
  if not layout:
    rewrite.layout_optimizer = rewrite.OFF


@contextlib.contextmanager
def light_calls(layout=True):
  """Function calls made in this context run the lighter Grappler of `_lighten`: what the
  compiled executor's inlined windows (their tasks' bodies traced into the window) run under.
  Measured (8 x Dense(32), K=4, window 16, 128 mini-batches, spectrain; layout off):
  start-up 9.8-10.5 s against 12.7-14.3 s; the ms per mini-batch of
  `bench/runtime_overhead.py` the same within its noise at K = 1-8."""
  ctx = _tf_context.context()
  before = ctx.function_call_options
  ctx.function_call_options = _derived_options(
      _LIGHT_OPTIONS, (before.config_proto_serialized, layout), before,
      lambda rewrite: _lighten(rewrite, layout))
  try:
    yield
  finally:
    ctx.function_call_options = before


def _task_options(outer):
  """The call options of a window's task calls: `outer`'s, with one round of Grappler's
  optimizers instead of two. Each new window optimises again every task function it calls
  (`bench/window_bound.py`); measured on a 12-layer Llama at K=4 (spectrain, 5 epochs, two
  runs each): first epoch 24.9 / 25.7 s against 27.9 / 28.2 s with two rounds, later epochs
  no slower (median 1.87 / 1.95 s against 2.58 / 2.58 s). Made once per outer config, so
  every window's calls of one function carry the same options."""
  def one_round(rewrite):
    rewrite.meta_optimizer_iterations = rewrite.ONE
  return _derived_options(_TASK_OPTIONS, outer.config_proto_serialized, outer, one_round)


def _derived_options(cache, key, outer, edit):
  """`outer`'s call options with `edit` applied to their Grappler rewrite options, made once
  per `key` in `cache`: every call of one function must carry the same options (they are part
  of its cache key)."""
  if key not in cache:
    config = tf.compat.v1.ConfigProto.FromString(outer.config_proto_serialized)
    edit(config.graph_options.rewrite_options)
    cache[key] = _tf_context.FunctionCallOptions(executor_type=outer.executor_type,
                                                 config_proto=config)
  return cache[key]


# Function-call ops: TensorFlow infers their output shapes by running shape inference over
# the callee's whole body (nested calls included) at every call site, unless the call op
# carries this attribute (its outputs then take the callee's signature's shapes).
_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")
_NO_CALL_SHAPE_INFERENCE = "_disable_call_shape_inference"
_SHAPE_INFERENCE = threading.local()   # .once: calls made in this thread infer once per key
_INFERRED = {}   # (callee, inputs' dtypes and shapes) -> output shapes
_MAX_INFERRED = 10_000


@contextlib.contextmanager
def calls_inferred_once():
  """Function calls put into a graph in this context (in this thread) run TensorFlow's shape
  inference through the callee's body once per callee and input signature (the inputs'
  dtypes and shapes: what the inference reads of them, with the shapes of resource inputs,
  which the callee's signature fixes); a repeated call takes the output shapes inferred
  then. A window calls each stage function many times with the same shapes: inferring at
  every call took 8.8 s of creating the call ops (12-layer Llama, K=4, i_timeprest), 0.45 s
  once per signature."""
  _install_call_cache()
  with _set_in_thread(_SHAPE_INFERENCE, "once", True):
    yield


@contextlib.contextmanager
def _set_in_thread(local, name, value):
  """`local.name` (a `threading.local`'s) is `value` in this context, then what it was."""
  before = getattr(local, name, None)
  setattr(local, name, value)
  try:
    yield
  finally:
    setattr(local, name, before)


# TensorFlow's XLA pass `EncapsulateSubgraphsPass` runs on every function it instantiates,
# XLA or not. To find the nodes related to reference variables it instantiates the callee of
# every call op afresh (and their callees, ten levels deep), scans its body and releases it,
# in both directions: each call site costs about its callee's size (measured, a 12-layer
# Llama at K=4 with 8 micro-batches: 2.4-3.7 s of the first call; 400 calls of an 800-op
# function: 2.1 s). A node whose input comes from a node with a reference-typed output counts
# as related without that scan; only XLA's kernels read the answer.
_MARKER = "tfpipe_call_marker"
_MARKS = threading.local()   # .markers: {device: marker op} while `calls_marked` is open


@contextlib.contextmanager
def calls_marked(devices):
  """Call ops put into the current graph in this context (in this thread) take a control
  input from a marker of their device: a legacy variable op (a reference-typed output, never
  read, created here once per device, before any call) that spares TensorFlow's
  `EncapsulateSubgraphsPass` its scan of their callees (see `_MARKER`). For graphs whose
  calls run without XLA (the pass's answer only tells XLA kernels how to alias variables).
  Made first because `tf.function` chains the stateful ops that take no resource in the
  order they were made: made later, a marker would wait on such an op of the window."""
  _install_call_cache()
  graph = tf.compat.v1.get_default_graph()
  markers = {}
  with graph.control_dependencies(None):
    for device in devices:
      with graph.device(device):
        op = tf.raw_ops.VariableV2(shape=[], dtype=tf.float32, shared_name=_MARKER).op
      markers.setdefault(op.device, op)
  with _set_in_thread(_MARKS, "markers", markers):
    yield


def _mark(graph, op):
  """Gives call op `op` its device's marker (`calls_marked`), when one is open in `graph`."""
  markers = getattr(_MARKS, "markers", None)
  marker = markers.get(op.device) if markers else None
  if marker is not None and marker.graph is graph:
    op._add_control_input(marker)  # noqa: SLF001


# A forward traced as a function call whose tape a later task reads (a kept forward crossing a
# call: `tfpipe.stage.tracing`) gets its gradient as a function of its own, which takes every
# forward tensor it reads as an input: for Pow(x, 2), the exponent. Its `x ** (2 - 1)` then
# has an exponent Grappler cannot see, so it runs as Eigen's generic power instead of being
# rewritten as a multiplication. Measured (12-layer Llama, K=4, spectrain, perf): 7% of the
# steady state's CPU time (RMSNorm squares its input); with the exponent kept constant, 5%
# less CPU time per epoch in two alternating pairs.
_POW_GRADIENT = []   # TensorFlow's Pow gradient, once wrapped (`constant_exponents`)
_EXPONENTS = threading.local()   # .constant: Pow gradients built in this thread fold


@contextlib.contextmanager
def constant_exponents():
  """Pow gradients built in this context (in this thread) read a constant exponent (one
  value, known when the forward was traced) as a constant of the gradient's own graph, not
  as a tensor taken from the forward: the same values, and a backward function Grappler can
  simplify. Elsewhere TensorFlow's gradient runs unchanged."""
  _install_pow_gradient()
  with _set_in_thread(_EXPONENTS, "constant", True):
    yield


class _WithExponent:
  """A Pow op as its gradient reads it, with `exponent` as its second input."""

  def __init__(self, op, exponent):
    self._op, self.inputs, self.outputs = op, [op.inputs[0], exponent], op.outputs

  def __getattr__(self, name):
    return getattr(self._op, name)


def _install_pow_gradient():
  """Wraps TensorFlow's registered Pow gradient (once) for `constant_exponents`."""
  if _POW_GRADIENT:
    return
  entry = _tf_ops._gradient_registry._registry["Pow"]  # noqa: SLF001
  original = entry["type"]

  def gradient(op, grad):
    y = op.inputs[1]
    if getattr(_EXPONENTS, "constant", False) and not isinstance(y, _tf_ops.EagerTensor):
      value = _tf_tensor_util.constant_value(y)
      if value is not None and value.size == 1:
        return original(_WithExponent(op, tf.constant(value, dtype=y.dtype)), grad)
    return original(op, grad)

  entry["type"] = gradient
  _POW_GRADIENT.append(original)


def _input_key(tensor):
  shape = tensor.shape
  return tensor.dtype, (tuple(shape.as_list()) if shape.rank is not None else None)


_CREATE_OP = []   # Graph.create_op as TensorFlow defines it, once wrapped


def _install_call_cache():
  """Wraps `Graph.create_op` (once) so that call ops made inside `calls_inferred_once` infer
  once per key and those made inside `calls_marked` take their marker; elsewhere it is
  TensorFlow's, unchanged."""
  if _CREATE_OP:
    return
  original = _tf_ops.Graph.create_op
  skip = {_NO_CALL_SHAPE_INFERENCE: _tf_attr_value_pb2.AttrValue(b=True)}

  def create_op(graph, op_type, inputs, *args, **kwargs):
    if op_type not in _CALL_OPS:
      return original(graph, op_type, inputs, *args, **kwargs)
    op = create_call(graph, op_type, inputs, *args, **kwargs)
    _mark(graph, op)
    return op

  def create_call(graph, op_type, inputs, *args, **kwargs):
    if not getattr(_SHAPE_INFERENCE, "once", False):
      return original(graph, op_type, inputs, *args, **kwargs)
    attrs = args[3] if len(args) > 3 else kwargs.get("attrs")
    key = (attrs["f"].func.name, tuple(_input_key(t) for t in inputs))
    shapes = _INFERRED.get(key)
    if shapes is None:
      op = original(graph, op_type, inputs, *args, **kwargs)
      if len(_INFERRED) >= _MAX_INFERRED:
        _INFERRED.clear()
      _INFERRED[key] = [t.shape for t in op.outputs]
      return op
    if len(args) > 3:   # attrs given by position: (dtypes, input_types, name, attrs, ...)
      args = args[:3] + (dict(attrs, **skip),) + args[4:]
    else:
      kwargs["attrs"] = dict(attrs, **skip)
    op = original(graph, op_type, inputs, *args, **kwargs)
    for t, shape in zip(op.outputs, shapes):
      t.set_shape(shape)
    return op

  create_op.__doc__ = original.__doc__
  _CREATE_OP.append(original)
  _tf_ops.Graph.create_op = create_op


class ResidualCall:
  """A `tf.function` called in a graph being traced the way TensorFlow's gradient of the call
  rewrites it: the call also outputs the forward's tensors its gradient reads (the residuals),
  and `gradients` later takes the gradient from them, in this graph or another one the
  residuals were carried into, without a tape and without running the forward again.

  TensorFlow does the same when a tape reads through a call in one graph (its "delayed
  rewrite": the same forward and backward functions, traced once per function); here the
  two halves may sit in two graphs, e.g. two calls of a window function. Made for one
  concrete function (`tf.function.get_concrete_function` of the arguments picks it).
  """

  def __init__(self, concrete):
    self._concrete = concrete
    rewrite = self._concrete._delayed_rewrite_functions  # noqa: SLF001
    self._forward, self._backward = rewrite.forward_backward()
    self._outputs = rewrite._num_inference_outputs  # noqa: SLF001
    graph = self._concrete.graph
    made = graph.outputs[:len(self._forward.function_type.flat_outputs)]
    position = {_tf_ops.tensor_id(t): i for i, t in enumerate(made)}
    # Each input the backward captured: a forward output (its index) or a value of its own.
    self._sources = [position.get(_tf_ops.tensor_id(c), c)
                     for c in self._backward.captured_inputs]
    if any(not isinstance(s, int) and not isinstance(s, _tf_ops.EagerTensor)
           for s in self._sources):
      raise NotImplementedError("the backward reads a tensor of another graph")
    self.trainable = [_tf_backprop_util.IsTrainable(t) for t in made[:self._outputs]]
    residual = [made[s] for s in self._sources if isinstance(s, int)]
    self.residual_types = [t.dtype for t in residual]   # and shapes (batch sizes unknown)
    self.residual_shapes = [t.shape for t in residual]
    self.num_args = len(graph.inputs) - len(self._concrete.captured_inputs)

  def call(self, args):
    """(the function's structured outputs, the residuals: a list of tensors)."""
    bound = _tf_function_type_utils.canonicalize_function_inputs(
        args, {}, self._concrete.function_type)
    flat = self._concrete.function_type.unpack_inputs(bound)
    outs = self._forward.call_flat(*(list(flat) + list(self._concrete.captured_inputs)))
    structured = self._concrete.function_type.pack_output(outs[:self._outputs])
    return structured, [outs[s] for s in self._sources if isinstance(s, int)]

  @property
  def outputs(self):
    """The function's outputs as it returns them (its graph's tensors: dtypes and shapes)."""
    return self._concrete.structured_outputs

  @staticmethod
  def trainable_output(tensor):
    """Whether an output of this dtype takes a gradient (`gradients` reads it)."""
    return _tf_backprop_util.IsTrainable(tensor)

  def gradients(self, residuals, doutputs):
    """The gradients of the function's flat arguments (None: none), given the call's
    `residuals` and its outputs' gradients `doutputs` (`outputs`' structure; those of
    outputs that take none, `trainable_output` False, are ignored)."""
    carried = iter(residuals)
    captured = [next(carried) if isinstance(s, int) else s for s in self._sources]
    flat = [d for d, o in zip(tf.nest.flatten(doutputs), tf.nest.flatten(self.outputs))
            if o is not None]
    if len(flat) != len(self.trainable):
      raise ValueError(f"{len(flat)} output gradients for {len(self.trainable)} outputs")
    cleaned = [d for d, t in zip(flat, self.trainable) if t]
    grads = self._backward._call_flat(cleaned, captured)  # noqa: SLF001
    return list(grads)[:self.num_args]


def _residual_calls_missing():
  """What `ResidualCall` reads of TensorFlow that the installed version lacks (names)."""
  probe = tf.function(lambda x: x * x, autograph=False)
  concrete = probe.get_concrete_function(tf.TensorSpec([], tf.float32))
  rewrite = getattr(concrete, "_delayed_rewrite_functions", None)
  needs = [(rewrite, "forward_backward"), (rewrite, "_num_inference_outputs"),
           (concrete.function_type, "unpack_inputs"), (concrete.function_type, "pack_output"),
           (_tf_function_type_utils, "canonicalize_function_inputs"),
           (_tf_backprop_util, "IsTrainable"), (_tf_ops, "tensor_id")]
  return [f"{type(owner).__name__}.{name}" for owner, name in needs if not hasattr(owner, name)]


def untracked_variable(dtype, device):
  """A variable of any shape (a variant: any value) on `device`, made now even while a
  `tf.function` traces again (whose variable creators refuse new variables after its first
  trace): a buffer that lives outside every trace (`tfpipe.runtime.parked`), not a weight."""
  with tf.init_scope(), tf.device(device):
    return _tf_resource_variables.ResourceVariable(
        empty_value(dtype), trainable=False, shape=tf.TensorShape(None), name="tfpipe_carry")


def empty_value(dtype):
  """An empty value of `dtype`: no elements, or for a variant an empty list of tensors (what
  a while loop accumulates)."""
  if dtype == tf.variant:
    return tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1, tf.int32),
                                      max_num_elements=0, element_dtype=tf.float32)
  return tf.zeros([0], dtype)


def call_time_value(graph, closure, specs, key):
  """Placeholders in `graph` (a `tf.function`'s graph being traced) of `specs`, fed with
  `closure()` (tensors) each time the function is called: an input that its signature does
  not carry, so the signature can be fixed before the input's shapes are known (the compiled
  executor's window groups)."""
  return graph.capture_call_time_value(closure, specs, key=key)


def is_derived(error):
  """Whether a TensorFlow error only followed another one (TensorFlow marks it derived): a
  function that calls others across devices may report such a cancellation instead of the
  first error."""
  return _DERIVED in (getattr(error, "experimental_payloads", None) or {})


def per_replica(values):
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

def _profiler_modules():
  # pylint: disable=g-import-not-at-top
  from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin
  from tensorflow.tsl.profiler.protobuf import trace_events_pb2
  return plugin, trace_events_pb2


def profile_trace_events(path):
  """The trace events of one `.xplane.pb` profile file, through TensorFlow's own converter:
  [(name, start ps, duration ps, args)]."""
  plugin, trace_events_pb2 = _profiler_modules()
  data, ok = plugin.xspace_to_tools_data([path], "trace_viewer", {})
  if not ok:
    raise RuntimeError(f"the profile {path} could not be read: {data[:200]!r}")
  trace = trace_events_pb2.Trace.FromString(data)
  return [(e.name, e.timestamp_ps, e.duration_ps, dict(e.args)) for e in trace.trace_events]


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


def drop_reduction_notices():
  """Keeps TensorFlow's logger from printing a line per traced cross-device reduction."""
  logger = tf.get_logger()
  if _NOTICES not in logger.filters:
    logger.addFilter(_NOTICES)
