"""A stage's task functions: its task bodies traced once per signature.

The compiled executor calls them from its window graphs (one call op per task, the callee
optimised once) or, for small stages, traces their bodies inline; the threaded executor calls
them eagerly. Under XLA each is one compiled call, placed on the stage's device.
"""

import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf

from tfpipe import compat

if TYPE_CHECKING:
  from tfpipe.stage.program import StageProgram

__all__ = ["TaskFunctions", "check_kept_tapes", "forward_ops"]


class TaskFunctions:
  """`bodies` (name -> a stage's Python task body) traced for `device`, with XLA when
  `jit_compile`. `inlinable`: the tasks no tape reads through, which inlined windows call as
  functions TensorFlow inlines when the graph runs (a recomputing backward's parts: measured,
  timeprest, 8 x Dense(32), K=4, 64 mini-batches, first epoch 23.5 s traced per part, 18 s so)."""

  def __init__(self, bodies: Dict[str, Callable[..., Any]], device: str,
               jit_compile: Optional[bool], inlinable: Sequence[str] = ("part_grads",),
               placed: bool = False) -> None:
    self.bodies, self.device, self.jit_compile = bodies, device, jit_compile
    self.placed = placed or jit_compile   # each call from within the device's scope
    self.inlinable = {name: compat.own_function(bodies[name], reduce_retracing=True,
                                                autograph=False)
                      for name in inlinable}
    # The forward, traced once per signature, that TensorFlow inlines into a window graph
    # calling it (`StageProgram.residuals_inlined`).
    self.inlined_forward = compat.own_function(bodies["forward_on"], reduce_retracing=True,
                                               autograph=False)
    # Traced once per signature, called (not inlined) from the window graph.
    self.traced = {name: compat.own_function(body, reduce_retracing=True,
                                              jit_compile=jit_compile, autograph=False,
                                              experimental_attributes=compat.NOT_INLINED)
                   for name, body in bodies.items()}
    self.functions = {name: self._placed(fn) if self.placed else fn
                      for name, fn in self.traced.items()}

  def get(self, name: str, inline: bool = False) -> Callable[..., Any]:
    """Task function `name` for a larger graph: the traced function, which stays one call
    there; with `inline`, its Python body, traced into the caller (each op named in the
    caller's scopes: what the profiled timeline reads), or for the `inlinable` tasks a
    traced function TensorFlow inlines when the graph runs; with XLA always the compiled
    function (one XLA call per task)."""
    if not inline or self.jit_compile:
      return self.functions[name]
    function = self.inlinable.get(name) or self.bodies[name]
    return self._placed(function) if self.placed else function

  def _placed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Calls `fn` from within the stage's device scope: for XLA (which places a call by its
    call site) and for a stage on a TF server (`placed`: a call TensorFlow places itself may
    land on the calling program's device, and its inputs and outputs then cross the links;
    measured, the residual LSTM's 1f1b stage calls sent 312 MB a step from one host).

    Not otherwise: in this process the ops inside already carry the stage's device, and a
    call-site scope made TensorFlow run the stages' calls one at a time (measured).
    """
    def call(*args: Any) -> Any:
      with tf.device(self.device):
        return fn(*args)
    return call


def _forward_trace(program: "StageProgram") -> Any:
  """The forward's trace that the executors then call (a batch of any size is a subtype)."""
  weights = [tf.TensorSpec(v.shape, v.dtype) for v in program.trainable]
  inputs = [tf.TensorSpec([None] + list(t.shape[1:]), t.dtype)
            for t in program.model.inputs] * program.groups_in
  return program.functions.traced["forward_on"].get_concrete_function(weights, inputs)


# What a stage's traced forward shows (its ops, the tf.py_function ops in it), per stage model
# and placement, kept for the model's life: a pipeline compiled again traces no forward to learn
# them again (method="auto" compiles a choice that cannot keep the probe's programs; a Keras
# user compiles again after unfreezing layers): 0.3 s of the 0.35-0.57 s compile of a
# 4-stage transformer.
_FORWARD_FACTS: "weakref.WeakKeyDictionary[Any, Dict[Tuple[Any, ...], Any]]" = (
    weakref.WeakKeyDictionary())


def _forward_fact(program: "StageProgram", name: str, read: Callable[[Any], Any]) -> Any:
  """`read(graph)` of `program`'s traced forward, once per stage model, placement and fact."""
  key = (name, program.device, tuple(program.replica_devices), program.groups_in,
         bool(program.jit_compile))
  facts = _FORWARD_FACTS.setdefault(program.model, {})
  if key not in facts:
    facts[key] = read(_forward_trace(program).graph)
  return facts[key]


def forward_ops(program: "StageProgram") -> int:
  """Ops in one traced forward of `program`'s stage (what an inlined task copies into a
  window)."""
  return int(_forward_fact(program, "ops", lambda graph: len(graph.get_operations())))


def forward_loops(program: "StageProgram") -> bool:
  """Whether one traced forward of `program`'s stage runs a `tf.while_loop` (a recurrent
  layer's loop over time steps), in its graph or the functions it calls."""
  def read(graph: Any) -> bool:
    graph = graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return any(n.op in ("While", "StatelessWhile") for n in nodes)
  return bool(_forward_fact(program, "loops", read))


def _py_functions(graph: Any) -> Tuple[str, ...]:
  """The names of the tf.py_function ops in `graph` and the functions it calls."""
  graph = graph.as_graph_def()
  nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
  # EagerPyFunc: tf.py_function, whose gradient reads that cache (tf.numpy_function's PyFunc
  # has no gradient, so nothing to break).
  return tuple(n.name for n in nodes if n.op == "EagerPyFunc")


def check_kept_tapes(program: "StageProgram") -> None:
  """Refuses a stage whose forward runs a `tf.py_function` when forward tapes are kept.

  TensorFlow keeps one tape per py_function op for its gradient, so two forwards in flight
  (each kept until its backward) overwrite each other's and the backward fails. Tracing the
  forward here (the trace the run then calls, for any batch size) finds such ops before any
  work; once per stage model and placement (`_forward_fact`).
  """
  if program.ops["F"].keeps != "tape":
    return   # recomputed forwards, or the last stage's fused step: no tape outlives a task
  found = _forward_fact(program, "py_functions", _py_functions)
  if found:
    scope = found[0].split("/")[0]   # the layer's name scope (Keras may add a suffix)
    names = [l.name for l in program.model.layers if scope.startswith(l.name)]
    layer = max(names, key=len) if names else scope
    raise ValueError(
        f"stage {program.index} runs a tf.py_function (in {layer!r}), and method "
        f"{program.policy.method!r} keeps each forward's tape until its backward: "
        "TensorFlow's py_function gradient keeps one tape per op, so two forwards in flight "
        "break it. Use a method that recomputes (vanilla, feature_replay, timeprest, "
        "spectrain with spectrain_backward='repredict', or recompute=True for sequential and "
        "gpipe), or write the layer with TensorFlow ops")
