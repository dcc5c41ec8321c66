"""How tfpipe tunes TensorFlow's graphs, process-wide, through its internals.

The call options of function calls (the compiled executor's unoptimised window graph and
its lighter inlined calls), the gradient registry's entry for Pow (a constant exponent kept
constant in a backward function), the placeholders a traced function feeds at each call (the
window groups' carry), the call-op attribute that skips shape inference through a callee's
body (done once per callee and input signature instead), a control input that spares
TensorFlow's XLA pass a scan of every call's callee, a forward call that returns its
residuals (`ResidualCall`), variables made outside every trace, and how `tf.function` counts
retraces (by code object). `missing()` names what the installed TensorFlow lacks.
"""

import contextlib
import functools
import threading
from typing import Any, Callable, List, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2 as _tf_attr_value_pb2
from tensorflow.python.eager import backprop_util as _tf_backprop_util
from tensorflow.python.eager import context as _tf_context
from tensorflow.python.eager.polymorphic_function import (
    function_type_utils as _tf_function_type_utils)
from tensorflow.python.framework import ops as _tf_ops
from tensorflow.python.framework import tensor_util as _tf_tensor_util
from tensorflow.python.ops import resource_variable_ops as _tf_resource_variables

__all__ = ["NOT_INLINED", "own_function", "unoptimised_calls", "optimised_calls", "light_calls",
           "calls_inferred_once", "calls_marked", "constant_exponents", "ResidualCall", "missing",
           "untracked_variable", "empty_value", "call_time_value"]

# `tf.function(experimental_attributes=NOT_INLINED)`: calls of the function from another
# function's graph stay calls (instantiated and optimised once), not copies of its body.
NOT_INLINED = {"_noinline": True}


def own_function(fn: Callable[..., Any], **options: Any) -> Any:
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
  compiled executor's inlined windows (their tasks' bodies traced into the window) run under:
  a shorter start-up, the same time per mini-batch
  (measured: `bench/results/history.md`, "Figures the code cited")."""
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
  (`bench/window_bound.py`): one round starts a 12-layer Llama sooner and its later epochs run
  no slower (measured: `bench/results/history.md`, "Figures the code cited"). Made once per
  outer config, so
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
# in both directions: each call site costs about its callee's size (seconds of a 12-layer
# Llama's first call, measured: `bench/results/history.md`, "Figures the code cited"). A node
# whose input comes from a node with a reference-typed output counts
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
# rewritten as a multiplication: a Llama's RMSNorm squares its input, and keeping the exponent
# constant saves CPU time every epoch (measured: `bench/results/history.md`, "Figures the code
# cited").
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

  def __init__(self, concrete: Any) -> None:
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

  def call(self, args: Any) -> Tuple[Any, List[Any]]:
    """(the function's structured outputs, the residuals: a list of tensors)."""
    bound = _tf_function_type_utils.canonicalize_function_inputs(
        args, {}, self._concrete.function_type)
    flat = self._concrete.function_type.unpack_inputs(bound)
    outs = self._forward.call_flat(*(list(flat) + list(self._concrete.captured_inputs)))
    structured = self._concrete.function_type.pack_output(outs[:self._outputs])
    return structured, [outs[s] for s in self._sources if isinstance(s, int)]

  @property
  def outputs(self) -> Any:
    """The function's outputs as it returns them (its graph's tensors: dtypes and shapes)."""
    return self._concrete.structured_outputs

  @staticmethod
  def trainable_output(tensor: Any) -> bool:
    """Whether an output of this dtype takes a gradient (`gradients` reads it)."""
    return _tf_backprop_util.IsTrainable(tensor)

  def gradients(self, residuals: Sequence[Any], doutputs: Any) -> List[Any]:
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


def missing():
  """What `ResidualCall` reads of TensorFlow that the installed version lacks (names)."""
  probe = tf.function(lambda x: x * x, autograph=False)
  concrete = probe.get_concrete_function(tf.TensorSpec([], tf.float32))
  rewrite = getattr(concrete, "_delayed_rewrite_functions", None)
  needs = [(rewrite, "forward_backward"), (rewrite, "_num_inference_outputs"),
           (concrete.function_type, "unpack_inputs"), (concrete.function_type, "pack_output"),
           (_tf_function_type_utils, "canonicalize_function_inputs"),
           (_tf_backprop_util, "IsTrainable"), (_tf_ops, "tensor_id")]
  return [f"{type(owner).__name__}.{name}" for owner, name in needs if not hasattr(owner, name)]


def untracked_variable(dtype: Any, device: str) -> Any:
  """A variable of any shape (a variant: any value) on `device`, made now even while a
  `tf.function` traces again (whose variable creators refuse new variables after its first
  trace): a buffer that lives outside every trace (`tfpipe.runtime.parked`), not a weight."""
  with tf.init_scope(), tf.device(device):
    return _tf_resource_variables.ResourceVariable(
        empty_value(dtype), trainable=False, shape=tf.TensorShape(None), name="tfpipe_carry")


def empty_value(dtype: Any) -> Any:
  """An empty value of `dtype`: no elements, or for a variant an empty list of tensors (what
  a while loop accumulates)."""
  if dtype == tf.variant:
    return tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1, tf.int32),
                                      max_num_elements=0, element_dtype=tf.float32)
  return tf.zeros([0], dtype)


def call_time_value(graph: Any, closure: Callable[[], Any], specs: Sequence[Any],
                    key: str) -> Any:
  """Placeholders in `graph` (a `tf.function`'s graph being traced) of `specs`, fed with
  `closure()` (tensors) each time the function is called: an input that its signature does
  not carry, so the signature can be fixed before the input's shapes are known (the compiled
  executor's window groups)."""
  return graph.capture_call_time_value(closure, specs, key=key)
