"""A Pipeline's `compile`: its arguments checked, then a stage program per stage and the
executor that runs them.

Each stage gets its own copy of the optimizer (same config, its
`exclude_from_weight_decay` choices) on its device, the last stage Keras's own
loss and metric containers (`tfpipe.stage.keras_step.KerasStep`).
"""

import keras
import tensorflow as tf

from tfpipe import compat, runtime
from tfpipe.instruments import prediction_error as prediction_error_lib
from tfpipe.plan import policies, tasks as tasks_lib
from tfpipe.rules import joint, mitigations
from tfpipe.stage import keras_step as compile_utils, program as stage, reduction, tracing

__all__ = ["checked_model", "compile_arguments", "check_compile_arguments", "optimizers",
           "programs", "runs_tasks_of", "adopt", "executor"]

_KERAS_DEFAULTS = {"optimizer": "rmsprop", "loss": None, "loss_weights": None, "metrics": None,
                   "weighted_metrics": None}


def checked_model(model):
  """`model`, refused where a pipeline cannot train it: not a Keras model, or one that
  overrides Keras's train step."""
  if not isinstance(model, keras.Model):
    raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
  overrides = compat.trainer_overrides(model)
  if overrides:
    raise ValueError(
        f"{type(model).__name__} overrides {', '.join(overrides)}: a pipeline runs Keras's "
        "own train step split over its stages, so it cannot run yours. Put the custom "
        "computation in a loss, a metric or a layer, or train with model.fit")
  return model


def compile_arguments(model, given, model_arguments):
  """`compile`'s optimizer, loss, loss weights, metrics and weighted metrics from those
  `given`: Keras's defaults for those left out, or where the model's class has a `compile`
  of its own (a KerasHub task) its defaults, resolved by it as `model.compile` would (with
  `model_arguments`, arguments of its own such as a causal LM's `sampler`)."""
  if compat.overrides_compile(model):   # a KerasHub task: its own defaults
    return compat.compile_arguments(model, dict(given, **model_arguments))
  if model_arguments:
    raise TypeError(f"compile() got unexpected keyword arguments {sorted(model_arguments)} "
                    f"({type(model).__name__} takes keras.Model.compile's)")
  return dict(_KERAS_DEFAULTS, **given)


def optimizers(model, optimizer, auto_scale_loss, method):
  """(the optimizer `model.optimizer` is during fit, the one without loss scaling, the loss
  scaling (`tfpipe.rules.joint.loss_scaling`) or None) for `compile`'s `optimizer`; loss
  scaling and global clipping refused by name for an asynchronous `method`. As Keras's
  compile, a mixed_float16 model's optimizer is wrapped in a LossScaleOptimizer."""
  optimizer = compile_utils.resolve_optimizer(optimizer)
  scaling = joint.loss_scaling(model, optimizer, auto_scale_loss)
  inner = scaling[0] if scaling else optimizer
  joint.check(inner, scaling, method, policies.SYNCHRONOUS_METHODS)
  if scaling and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
    optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")
  return optimizer, inner, scaling


def check_compile_arguments(model, loss_weights, run_eagerly, steps_per_execution, jit_compile,
                            auto_scale_loss):
  """Refuses `compile` arguments a pipeline cannot honour, naming them."""
  if steps_per_execution != "auto" and (
      not isinstance(steps_per_execution, int) or isinstance(steps_per_execution, bool)
      or steps_per_execution < 1):
    raise ValueError("`steps_per_execution` must be a positive integer or 'auto'. Received: "
                     f"steps_per_execution={steps_per_execution!r}")
  if isinstance(loss_weights, (list, tuple)) and any(
      isinstance(w, (str, keras.metrics.Metric)) for w in loss_weights):
    raise ValueError(
        f"loss_weights={loss_weights!r} looks like metrics: compile's third argument is "
        "loss_weights, as in keras.Model.compile; pass metrics=[...] by name")
  if run_eagerly:
    raise ValueError("run_eagerly=True is not supported: a pipeline runs traced stage tasks. "
                     "To step through them in Python use Pipeline(executor='threaded')")
  if jit_compile != "auto":
    raise ValueError(f"jit_compile={jit_compile!r}: XLA is a Pipeline option "
                     "(Pipeline(..., jit_compile=True)), not a compile argument")


def programs(pipe, options, rules, optimizer, step, scaling=None):
  """One `tfpipe.stage.program.StageProgram` per stage of `pipe` under `options` (resolved for
  `optimizer`) and each stage's update rule, the last with `step`'s loss and metrics; refuses
  a stage whose forward cannot keep its tape. `scaling`: (initial scale, growth steps) of
  dynamic loss scaling (`tfpipe.rules.joint`), or None."""
  K = pipe.num_stages
  metrics = [step.metrics] if step.metrics is not None else []
  result = []
  clip = getattr(optimizer, "global_clipnorm", None)
  # global_clipnorm and loss scaling: decided once per mini-batch over every stage's gradient
  # (`tfpipe.rules.joint`); a stage's own optimizer must not clip by its own part's norm.
  shared = pipe.partition.shared   # weights several stages hold: one summed gradient
  decision = (joint.JointDecision(clip, scaling, pipe.devices[0], shared)
              if clip or scaling or shared else None)
  overrides = {"global_clipnorm": None} if clip else {}
  for k, (sub, device) in enumerate(zip(pipe.partition.stages, pipe.devices)):
    last = k == K - 1
    with tf.device(device):  # the optimizer's step counter and slots live with the stage
      stage_optimizer = compile_utils.clone_optimizer(optimizer, **overrides)
    if options.delay_momentum:
      stage_optimizer.momentum = mitigations.delay_momentum(stage_optimizer.momentum,
                                                             rules[k].delay)
    result.append(stage.StageProgram(
        k, K, sub, device, stage_optimizer, options.policy,
        loss=step.loss if last else None, metrics=metrics if last else (),
        loss_tracker=step.loss_tracker if last else None, jit_compile=pipe.jit_compile,
        replica_devices=pipe.stage_devices[k], rule=rules[k],
        reg_trackers=[p.reg_tracker for p in result if p.reg_tracker] if last else None,
        optimizer_source=optimizer, grouped=pipe.data_parallel > 1,
        cross_device_ops=(pipe.cross_device_ops if pipe.cross_device_ops is not None else
                          reduction.default(pipe.stage_devices[k], options.policy.method in
                                            policies.SYNCHRONOUS_METHODS,
                                            any(s == k for place in shared for s, _ in place),
                                            decision is None and stage.embeds(sub))),
        output_structure=pipe.model.output if last and len(pipe.model.outputs) > 1 else None,
        unread=pipe.partition.unread[k]))
  for p in result:
    tracing.check_kept_tapes(p)
    p.updates.joint = decision
  if decision is not None:
    decision.set_programs([p.updates for p in result])
  return result


def runs_tasks_of(stage_programs, policy):
  """Whether `stage_programs` run `policy`'s tasks as they are: the same task-table rows, the
  same predicted and kept weights (a synchronous schedule's programs at another M, or
  another schedule of the same rows)."""
  return all(tasks_lib.ops(policy, last=p.is_last) == p.ops
             and policy.predicts == p.policy.predicts
             and policy.keeps_previous == p.policy.keeps_previous for p in stage_programs)


def adopt(stage_programs, policy, rules):
  """Gives `stage_programs` `policy` where their tasks and update rules stay as they are
  (`runs_tasks_of`, and the same rules): True; else False, and nothing changed."""
  if not runs_tasks_of(stage_programs, policy) or any(
      rule != p.rule for p, rule in zip(stage_programs, rules)):
    return False
  for p in stage_programs:
    p.policy = policy
  return True


def executor(pipe, stage_programs, window):
  """The executor `pipe.options` names on `stage_programs`, with the prediction error's hook."""
  options = pipe.options
  maxsize = max(pipe.num_stages, options.micro_batches)
  if options.executor == "compiled":
    result = runtime.CompiledRuntime(stage_programs, window=window, record=options.record,
                                     maxsize=maxsize)
  else:
    result = runtime.Runtime(stage_programs, record=options.record, maxsize=maxsize)
  recorder = options.prediction_error
  if recorder is not None:
    for p in stage_programs:
      prediction_error_lib.check(p.optimizer)
    result.update_hooks.append(
        lambda k, program: recorder.observe_optimizer(k, program.trainable, program.optimizer))
  return result
