"""The Keras internals tfpipe reads, in one place.

tfpipe takes the train step's semantics from Keras's own machinery: the loss
and metric containers `keras.Model.compile` builds (`CompileLoss`,
`CompileMetrics`: names, weighting, reduction, "accuracy" resolved from the
labels' shape), and the optimizer state that `get_config` does not carry
(`exclude_from_weight_decay`). These live in `keras.src`, which Keras may
move: `missing()` names what an installed Keras lacks, and
`tests/test_keras_compat.py` fails loudly on it.
"""

import contextlib

import keras
from keras.src.trainers import compile_utils as _compile_utils
from tensorflow.python.eager import context as _tf_context

__all__ = ["CompileLoss", "CompileMetrics", "MetricsList", "missing",
           "copy_weight_decay_exclusions", "trainer_overrides", "unoptimised_calls", "NOT_INLINED",
           "is_derived"]

# `tf.function(experimental_attributes=NOT_INLINED)`: calls of the function from another
# function's graph stay calls (instantiated and optimised once), not copies of its body.
NOT_INLINED = {"_noinline": True}

# The payload TensorFlow puts on an error that only follows another one (a cancelled receive).
_DERIVED = b"type.googleapis.com/tensorflow.DerivedStatus"

CompileLoss = _compile_utils.CompileLoss
CompileMetrics = _compile_utils.CompileMetrics
MetricsList = _compile_utils.MetricsList

# Optimizer attributes that `exclude_from_weight_decay` sets and `get_config` leaves out.
_EXCLUDED_VARIABLES = "_exclude_from_weight_decay"
_EXCLUDED_PATTERN = "_exclude_from_weight_decay_pattern"

# The train-step methods of keras.Model a subclass may override (tfpipe runs its own step).
_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def missing():
  """The Keras internals tfpipe needs that the installed Keras lacks (names), [] when none."""
  needs = [(_compile_utils, "CompileLoss"), (_compile_utils, "CompileMetrics"),
           (_compile_utils, "MetricsList"), (keras.optimizers.Optimizer, "_var_key"),
           (keras.optimizers.Optimizer, "_use_weight_decay"),
           (keras.optimizers.Optimizer, "exclude_from_weight_decay")]
  needs += [(_tf_context, "FunctionCallOptions"), (_tf_context.Context, "function_call_options")]
  gone = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in needs
          if not hasattr(owner, name)]
  probe = keras.optimizers.AdamW()
  probe.exclude_from_weight_decay(var_names=["probe"])
  gone += [f"Optimizer.{a}" for a in (_EXCLUDED_VARIABLES, _EXCLUDED_PATTERN)
           if not hasattr(probe, a)]
  return gone


def copy_weight_decay_exclusions(source, target, variable_pairs):
  """Gives `target` (a stage's optimizer, not built yet) the weight-decay exclusions set on
  `source` with `exclude_from_weight_decay`: the variables of `source` map to the stage's
  copies through `variable_pairs` [(model variable, stage variable)]; names match as they
  are (a stage variable's name ends with its model variable's name)."""
  keys = getattr(source, _EXCLUDED_VARIABLES, None)
  pattern = getattr(source, _EXCLUDED_PATTERN, None)
  if not keys and pattern is None:
    return
  excluded = [own for src, own in variable_pairs if keys and source._var_key(src) in keys]  # pylint: disable=protected-access
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
  function must use the same."""
  ctx = _tf_context.context()
  before = ctx.function_call_options
  config = ctx.config
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = _tf_context.FunctionCallOptions(
      executor_type=before.executor_type, config_proto=config)
  try:
    yield
  finally:
    ctx.function_call_options = before


def is_derived(error):
  """Whether a TensorFlow error only followed another one (TensorFlow marks it derived): a
  function that calls others across devices may report such a cancellation instead of the
  first error."""
  return _DERIVED in (getattr(error, "experimental_payloads", None) or {})
