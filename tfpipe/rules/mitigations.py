"""Staleness mitigations that change a stage's update, beyond which weights a task reads.

k: stage, D_k: the stage's delay, the most updates stage k applies (for
earlier mini-batches) between a forward and its own update: the largest
`exact` forward version difference of its schedule (1F1B: K-1-k). t: the
stage's update count before this update, lr: the learning rate, gamma: the
momentum, g: the gradient the update applies. Each rule is written for the
SpecTrain form (v = gamma*v + (1-gamma)*g; W -= lr*v) and for Keras's SGD
(m = gamma*m - lr*g; W += m), the optimizers with a momentum to act on.

- Spike compensation (Kosson et al., MLSys 2021). A delayed gradient still
  gets the momentum's total weight, but late. The update puts the share the
  delay missed into one spike:
  W -= lr * (a*v + b*(1-gamma)*g), with a = gamma^D, b = (1-gamma^D)/(1-gamma)
  (SGD: W += a*m - lr*b*g). D = 0 leaves the update as it is.
- Delay-aware momentum (Mitliagkas et al. 2016, "asynchrony begets
  momentum"). A delay of D acts as an implicit momentum D/(D+1), so stage k
  runs with gamma_k = max(0, gamma - D_k/(D_k+1)).
- PipeMare learning-rate rescheduling (Yang et al., MLSys 2021). Update t of
  stage k applies its gradient scaled by tau_k^(-p_t), tau_k = max(1, D_k),
  p_t = max(0, 1 - t/T) over T warm-up updates: slow stages start slow.
  (For both optimizers this is the learning rate of that gradient's step.)
- PipeMare discrepancy correction (method "pipemare"): the stage keeps
  delta, an average of its weight changes, delta = c*delta + (1-c)*(W_new -
  W_old) after each update (c: `discrepancy_decay`), and a backward d
  updates after its forward reads W - d*delta: the forward's weights,
  estimated without a stash.
- Nesterov look-ahead (Ajanthan et al., ICML 2025, "Nesterov method for
  asynchronous pipeline parallel optimization"; its code runs PipeDream's
  weight stashing with a Nesterov momentum step): every stage's update looks
  ahead along its momentum, W -= lr * (gamma*v + (1-gamma)*g) (SGD:
  W += gamma*m - lr*g). It is spike compensation's update with D = 1
  (a = gamma, b = 1), at every stage whatever its delay. With Adam (the
  paper's code runs PyTorch's NAdam): the step looks ahead along the first
  moment the same way, W -= alpha * (b1*m + (1-b1)*g) / (sqrt(v) + eps),
  alpha = lr * sqrt(1 - b2^t) / (1 - b1^t), m and v after this update: NAdam's
  step (Dozat 2016) without its momentum schedule.
- Delay compensation (DC-ASGD, Zheng et al., ICML 2017): a gradient g taken
  at weights W_read, applied to weights W, is first moved along a diagonal
  estimate of the Hessian to g + lam * g * g * (W - W_read) (elementwise;
  lam: `delay_compensation`). W_read is what the backward read: the forward's
  stash (pipedream), 2BW's buffer, SpecTrain's prediction; a backward that
  reads the current weights (vanilla) has nothing to compensate.
- I-TiMePReSt (Dutta, Chaki, De 2025; method "i_timeprest"): a backward d
  updates after its forward reads the intermediate weights
  e^-d * W_forward + (1 - e^-d) * W_current: the stale weights count less
  the staler they are.
"""

import dataclasses
import math
from typing import Any, Collection, Sequence

import keras
import tensorflow as tf
from keras import ops

from tfpipe import compat
from tfpipe.plan import schedules, versions
from tfpipe.rules import prediction

__all__ = ["StageRule", "stage_delays", "delay_momentum", "lr_factor", "blend_factor",
           "spike_coefficients", "momentum_of", "adam_of", "check_optimizer", "compensate",
           "DEFAULT_LR_RESCHEDULING", "DEFAULT_DISCREPANCY_DECAY"]

DEFAULT_LR_RESCHEDULING = 500   # PipeMare warm-up updates when method="pipemare"
DEFAULT_DISCREPANCY_DECAY = 0.9


def stage_delays(schedule):
  """D_k per stage: the largest `exact` version difference of a forward of stage k."""
  diffs = versions.exact_version_differences(schedule)
  return [max([s for t, s in d.items() if t.kind == "F"], default=0) for d in diffs]


def delays_for(schedule_name, K, M=1, V=1):
  """D_k of the steady state of schedule `schedule_name` (enough mini-batches to reach it; V:
  stages per device)."""
  return stage_delays(schedules.build(schedule_name, K, 2 * K + 4, M, V))


def delay_momentum(momentum, delay):
  return max(0.0, momentum - delay / (delay + 1.0))


def lr_factor(delay, step, warmup):
  """tau^-p of PipeMare's rescheduling (Python numbers; `stage.py` forms the same in TF)."""
  if not warmup:
    return 1.0
  p = max(0.0, 1.0 - step / warmup)
  return max(1.0, float(delay)) ** -p


def blend_factor(d: float) -> float:
  """I-TiMePReSt's weight of the stale (forward) version, d updates old."""
  return math.exp(-d)


def spike_coefficients(momentum, delay):
  a = momentum ** delay
  return a, (1.0 - a) / (1.0 - momentum)


def compensate(lam: Any, g: Any, current: Any, read: Any) -> Any:
  """DC-ASGD's gradient `g` (taken at `read`) moved to the weights `current`, for numpy arrays
  or tensors alike."""
  return g + lam * g * g * (current - read)


def adam_of(optimizer):
  """`optimizer` when it is an Adam (AdamW included) whose step the Adam rules cover (no
  amsgrad), else None."""
  if isinstance(optimizer, keras.optimizers.Adam) and not optimizer.amsgrad:
    return optimizer
  return None


def momentum_of(optimizer):
  """The momentum the rules act on, or None for an optimizer they do not cover."""
  if hasattr(optimizer, "smoothed_gradient"):
    return optimizer.momentum
  if isinstance(optimizer, keras.optimizers.SGD) and not optimizer.nesterov:
    return optimizer.momentum
  return None


def check_optimizer(optimizer, option):
  """The update rules above are written for momentum SGD with nothing else in the update."""
  name = type(optimizer).__name__
  adam = option == "nesterov"   # the one rule also written for Adam
  if momentum_of(optimizer) is None and not (adam and adam_of(optimizer) is not None):
    amsgrad = " with amsgrad=True" if adam and getattr(optimizer, "amsgrad", False) else ""
    raise ValueError(
        f"{option} changes a momentum SGD{' or Adam' if adam else ''} update: use "
        f"tfpipe.optimizers.SpecTrain, keras.optimizers.SGD (not Nesterov)"
        f"{' or keras.optimizers.Adam (not amsgrad)' if adam else ''}. Received: {name}{amsgrad}")
  extras = [a for a in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay",
                        "gradient_accumulation_steps")
            if getattr(optimizer, a, None)] + (["use_ema"] if optimizer.use_ema else [])
  if extras:
    raise ValueError(f"{option} is defined for an update without {', '.join(extras)}. Received: "
                     f"{name} with {', '.join(f'{a}={getattr(optimizer, a)}' for a in extras)}")


@dataclasses.dataclass(frozen=True)
class StageRule:
  """What stage k's update does beyond its optimizer's step (all off: the step itself)."""
  delay: int = 0
  spike_compensation: bool = False
  lr_rescheduling: int = 0        # T, PipeMare's warm-up updates (0: off)
  discrepancy_decay: float = None  # c, when the stage keeps delta (method "pipemare")
  nesterov: bool = False          # Nesterov's look-ahead step
  delay_compensation: float = 0.0  # lam of DC-ASGD (0: off): `StageProgram` applies it

  def coefficients(self, momentum):
    """(a, b) of the momentum step W -= lr*(a*v + b*(1-gamma)*g) (spike compensation's form),
    or None for the optimizer's own step."""
    if self.spike_compensation and self.delay > 0 and momentum:
      return spike_coefficients(momentum, self.delay)
    if self.nesterov and momentum:
      return momentum, 1.0
    return None

  def apply(self, optimizer: Any, grads: Sequence[Any], variables: Sequence[Any],
            deltas: Sequence[Any], unused: Collection[int] = ()) -> None:
    """One update of `variables` with `grads` (inside a tf.function). `unused`: the indices of
    variables the loss does not depend on (no gradient), which Keras's optimizer leaves
    alone (no step, no weight decay, their slots untouched): so do we."""
    if unused:
      pairs = [(g, v) for j, (g, v) in enumerate(zip(grads, variables)) if j not in unused]
      grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
      if deltas:
        deltas = [d for j, d in enumerate(deltas) if j not in unused]
    grads, variables = list(grads), list(variables)
    if self.lr_rescheduling and self.delay > 1:
      t = tf.cast(optimizer.iterations, tf.float64)
      p = tf.maximum(tf.constant(0.0, tf.float64), 1.0 - t / float(self.lr_rescheduling))
      factor = tf.pow(tf.constant(float(self.delay), tf.float64), -p)
      grads = [g * tf.cast(factor, g.dtype) for g in grads]
    spike = self.coefficients(momentum_of(optimizer))
    adam = adam_of(optimizer) if self.nesterov else None
    lr = optimizer.learning_rate if spike or adam else None   # this update's rate (read before it)
    old = [tf.convert_to_tensor(v) for v in variables] if deltas else None
    optimizer.apply(grads, variables)
    if adam:   # W was W0 - alpha*m/(sqrt(v)+eps); is W0 - alpha*(b1*m + (1-b1)*g)/(sqrt(v)+eps)
      alphas = {}   # per dtype, at the update count this update reached
      for g, v in zip(grads, variables):
        dtype = v.dtype
        if dtype not in alphas:
          alphas[dtype] = prediction.adam_rate(adam, dtype, ops.cast(lr, dtype))
        m, second = compat.adam_moments(adam, compat.variable_index(adam, v))
        v.assign_add(alphas[dtype] * (1.0 - ops.cast(adam.beta_1, dtype)) * (m - ops.cast(g, dtype))
                     / (ops.sqrt(second) + adam.epsilon))
    if spike:
      a, b = spike
      for g, v in zip(grads, variables):
        rate, g = ops.cast(lr, v.dtype), ops.cast(g, v.dtype)
        if hasattr(optimizer, "smoothed_gradient"):   # W was W0 - lr*v; is W0 - lr*(a*v + (1-a)*g)
          s = optimizer.smoothed_gradient(v)
          v.assign_add(rate * (1.0 - a) * (s - g))
        else:   # W was W0 + m; is W0 + a*m - lr*b*g
          m = optimizer.momentums[compat.variable_index(optimizer, v)]
          v.assign_add((a - 1.0) * m - rate * b * g)
    if deltas:
      c = self.discrepancy_decay
      for d, v, w in zip(deltas, variables, old):
        d.assign(c * d + (1.0 - c) * (tf.convert_to_tensor(v) - w))
