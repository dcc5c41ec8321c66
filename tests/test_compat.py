"""Private Keras and TensorFlow internals: all in `tfpipe.compat`, all present."""

import ast
import contextlib
import pathlib

import pytest

from tfpipe import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl")


def test_installed_keras_and_tensorflow_have_every_internal_tfpipe_reads():
  assert compat.missing() == []


def _private_imports(path):
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    found += [n for n in names if n.startswith(_PRIVATE_MODULES)]
  return found


def test_only_the_compat_module_imports_private_keras_or_tensorflow_modules():
  files = sorted((ROOT / "tfpipe").rglob("*.py")) + sorted((ROOT / "trainers").rglob("*.py"))
  offenders = {str(p.relative_to(ROOT)): _private_imports(p) for p in files
               if p.parent.name != "compat"}
  assert {p: names for p, names in offenders.items() if names} == {}
  for module in ("access.py", "tuning.py"):   # the check sees such imports
    assert _private_imports(ROOT / "tfpipe" / "compat" / module)


def test_a_windows_task_calls_run_one_round_of_grappler_and_the_window_none(grappler):
  del grappler
  import tensorflow as tf
  from tensorflow.python.eager import context
  ctx = context.context()
  rewrite = lambda: tf.compat.v1.ConfigProto.FromString(
      ctx.function_call_options.config_proto_serialized).graph_options.rewrite_options
  before = ctx.function_call_options
  with compat.unoptimised_calls():
    assert rewrite().disable_meta_optimizer   # the window's own graph
    with compat.optimised_calls():
      assert not rewrite().disable_meta_optimizer   # its task calls
      assert rewrite().meta_optimizer_iterations == rewrite().ONE
      first = ctx.function_call_options
    with compat.optimised_calls():
      assert ctx.function_call_options is first   # the same options for every window
  assert ctx.function_call_options is before
  with compat.optimised_calls():   # outside a window: as they were
    assert ctx.function_call_options is before


@pytest.mark.parametrize("layout", [True, False])
def test_inlined_windows_run_one_round_without_the_memory_and_loop_optimizers(layout):
  import tensorflow as tf
  from tensorflow.python.eager import context
  ctx = context.context()
  rewrite = lambda: tf.compat.v1.ConfigProto.FromString(
      ctx.function_call_options.config_proto_serialized).graph_options.rewrite_options
  before, kept = ctx.function_call_options, rewrite()
  with compat.light_calls(layout):
    r = rewrite()
    assert r.meta_optimizer_iterations == r.ONE
    assert r.memory_optimization == r.NO_MEM_OPT and r.loop_optimization == r.OFF
    assert (r.layout_optimizer == r.OFF) != layout
    assert r.disable_meta_optimizer == kept.disable_meta_optimizer   # the rest as it was
    first = ctx.function_call_options
  with compat.light_calls(layout):
    assert ctx.function_call_options is first   # the same options for every call
  assert ctx.function_call_options is before


def test_calls_in_the_switch_infer_shapes_once_per_signature_and_get_the_same_shapes():
  import tensorflow as tf
  inner = tf.function(lambda x: tf.reduce_sum(x, axis=1),
                      input_signature=[tf.TensorSpec([None, 4], tf.float32)])
  found = {}

  @tf.function(autograph=False)
  def outer(x, y):
    found["plain"] = inner(x)   # TensorFlow's own: inferred through the body, not [None]
    with compat.calls_inferred_once():
      found["first"], found["again"], found["other"] = inner(x), inner(x), inner(y)
    found["after"] = inner(x)
    return found["again"]

  outer(tf.ones([3, 4]), tf.ones([5, 4]))
  assert [found[k].shape.as_list() for k in ("plain", "first", "again", "other", "after")] == [
      [3], [3], [3], [5], [3]]
  skipped = {k: "_disable_call_shape_inference" in t.op.node_def.attr for k, t in found.items()}
  assert skipped == {"plain": False, "first": False, "again": True, "other": False,
                     "after": False}


def test_calls_in_a_marked_graph_take_their_devices_marker_and_no_other_op_does():
  import tensorflow as tf
  inner = tf.function(lambda x: x * 2.0)
  found = {}

  @tf.function(autograph=False)
  def outer(x):
    with compat.calls_marked(["/device:CPU:0"]):
      with tf.device("/device:CPU:0"):
        found["marked"] = inner(x)
        found["plain op"] = x + 1.0
      found["other device"] = inner(x + 2.0)   # no marker of its device
    found["after"] = inner(x + 3.0)
    return found["marked"] + found["other device"] + found["after"]

  assert outer(tf.ones([2])).numpy().tolist() == [16.0, 16.0]   # 2 + 6 + 8
  controls = {k: [c.type for c in t.op.control_inputs] for k, t in found.items()}
  assert controls == {"marked": ["VariableV2"], "plain op": [], "other device": [],
                      "after": []}
  marker = found["marked"].op.control_inputs[0]
  assert marker.outputs[0].dtype._is_ref_dtype   # what spares the pass its scan  # noqa: SLF001


def _backward_pow_exponents(constant):
  """Whether each Pow op's exponent in the gradient function of a called forward (a
  `_noinline` function whose tape the caller reads) reads the function's arguments or only
  constants; and the gradient."""
  import tensorflow as tf
  forward = tf.function(lambda x, w: tf.pow(x, 2.0) * w, autograph=False,
                        experimental_attributes=compat.NOT_INLINED)

  @tf.function(autograph=False)
  def outer(x, w):
    with (compat.constant_exponents() if constant else contextlib.nullcontext()):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(forward(x, w))
      return tape.gradient(y, x)

  x, w = tf.constant([1.5, -2.0, 3.0]), tf.constant([1.0, 2.0, 0.5])
  graph = outer.get_concrete_function(x, w).graph.as_graph_def()
  sources = []
  for function in graph.library.function:
    if "backward" not in function.signature.name:
      continue
    nodes = {n.name: n for n in function.node_def}
    args = {a.name for a in function.signature.input_arg}

    def reads_argument(name):
      name = name.lstrip("^").split(":")[0]
      return name in args or any(reads_argument(i) for i in nodes[name].input)

    sources += ["argument" if reads_argument(node.input[1]) else "constant"
                for node in function.node_def if node.op == "Pow"]
  return sources, outer(x, w).numpy()


def test_a_kept_forwards_gradient_keeps_a_constant_exponent_constant():
  import numpy as np
  plain, expected = _backward_pow_exponents(constant=False)
  folded, gradient = _backward_pow_exponents(constant=True)
  assert "argument" in plain   # TensorFlow's own: the exponent taken from the forward
  assert folded and set(folded) == {"constant"}   # what Grappler rewrites
  np.testing.assert_array_equal(gradient, expected)
  np.testing.assert_allclose(gradient, [3.0, -8.0, 3.0])   # 2 x w


@contextlib.contextmanager
def _retracing_warnings():
  """The lines TensorFlow logs to say that a tf.function retraces too often."""
  import logging

  import tensorflow as tf

  class Lines(logging.Handler):
    def __init__(self):
      super().__init__(logging.WARNING)
      self.lines = []

    def emit(self, record):
      if "triggered tf.function retracing" in record.getMessage():
        self.lines.append(record.getMessage())
  handler = Lines()
  tf.get_logger().addHandler(handler)
  try:
    yield handler.lines
  finally:
    tf.get_logger().removeHandler(handler)


class _Traced:
  def __init__(self, make):
    self.function = make(self.run)

  def run(self, x):
    return x * 2.0


def test_own_functions_count_their_own_traces_and_still_warn_where_one_retraces():
  import tensorflow as tf
  with _retracing_warnings() as shared:
    for _ in range(6):   # six objects, each tracing its method once
      _Traced(lambda fn: tf.function(fn, autograph=False)).function(tf.ones([2]))
  assert shared   # TensorFlow counts them as one function retracing
  with _retracing_warnings() as own:
    for _ in range(6):
      _Traced(lambda fn: compat.own_function(fn, autograph=False)).function(tf.ones([2]))
  assert own == []
  with _retracing_warnings() as retraced:
    one = _Traced(lambda fn: compat.own_function(fn, autograph=False))
    for n in range(1, 7):   # one function traced at six shapes
      one.function(tf.ones([n, n, n]))
  assert retraced
  assert one.function.get_concrete_function(tf.ones([2])).name.decode().startswith(
      "__inference_run")   # traced under the method's own name


def test_pipelines_built_one_after_another_log_no_retracing_warning():
  import keras
  import tfpipe
  from tests import helpers
  x, y = helpers.as_arrays(helpers.batches(n=2))
  with _retracing_warnings() as lines:
    for seed in range(6):   # a sweep: each pipeline traces its own windows and stages once
      pipe = tfpipe.Pipeline(helpers.mlp(seed=seed), num_stages=2, method="pipedream")
      pipe.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
      pipe.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert lines == []
