"""The slow reference: each method's weight rule (docs/methods.md), a task at a time, one device.

K: stages, k: stage index, b: mini-batch, i: micro-batch, s: version
difference, W: weights, V: smoothed gradients (SpecTrain) or momentum slots
(SGD, Adam's first moment), Q: Adam's second moments, A: accumulated
gradients, E: PipeMare's average weight change. No threads, no compiled
functions, no optimizer code: weights are numpy arrays and the update rules
(SpecTrain `v = gamma*v + (1-gamma)*g; W -= eta*v`, or Keras's SGD, Adam and
AdamW, read from an optimizer's hyperparameters) are written out, in the
model's dtype, with the mitigations of `tfpipe.rules.mitigations` on top. The
tests hold the runtime to these results.

The rules, per task of stage k:
  F   reads the policy's forward weights (current, or predicted s ahead);
      at the last stage it only takes its input: the last stage's forward
      runs with its backward;
  B   reads the forward's own weights ("forward": stash or reused
      prediction) or the weights at backward time ("current", "predicted",
      "corrected": W - d*E, "blend": e^-d * forward's + (1 - e^-d) * current,
      with d the updates since the forward),
      on the inputs of the forwards it covers (concatenated for a
      TiMePReSt mini-batch); a micro-batch's loss is weighted by its share
      of the mini-batch; a micro-batch backward adds to A, a whole one updates;
  U   updates with A and clears it;
  R   (receiving a gradient early) and S (a barrier) change no weights.
Random layers: each stage's non-trainable state (its seed generators) advances
with every forward it runs, in its task order; a backward recomputes each
covered forward with the state that forward read, so it sees the same draws.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfpipe.plan import pieces, policies, tasks, verify
from tfpipe.rules import advice as advice_lib, mitigations, optimizers

__all__ = ["reference_train"]


def _run(model, weights, state, xs, training=True):
  """The stage on `xs` with `weights` and non-trainable `state`; returns (outputs, new state)."""
  inputs = xs[0] if len(xs) == 1 else list(xs)
  ys, new_state = model.stateless_call(weights, state, inputs, training=training)
  return tf.nest.flatten(ys), new_state


def _micro_batches(x, y, M):
  """A mini-batch split as the executors split it (`tfpipe.plan.pieces`): [(xs, y, share)]."""
  xs = list(x) if isinstance(x, (tuple, list)) else [x]
  return [(xs_i, y_i, share) for (xs_i, y_i), share in pieces.split((xs, y), M)]


def _f32(x):
  """`x` as Keras uses a Python hyperparameter it casts (`ops.cast` goes through float32)."""
  return float(np.float32(x))


class _Rule:
  """One stage's optimizer rule in numpy: the update and the prediction s updates ahead."""

  def __init__(self, optimizer, learning_rate, momentum, delay, spike, warmup, decay, weights,
               nesterov=False):
    config = optimizer.get_config() if optimizer is not None else {}
    self.kind = ("spectrain" if optimizer is None or isinstance(optimizer, optimizers.SpecTrain)
                 else "adam" if isinstance(optimizer, keras.optimizers.Adam) else "sgd")
    self.lr = _f32(config.get("learning_rate", learning_rate))   # Keras keeps it in float32
    self.gamma = float(config.get("momentum", momentum)) if self.kind != "adam" else None
    self.config, self.delay, self.spike, self.warmup, self.decay = (config, delay, spike, warmup,
                                                                    decay)
    self.nesterov = nesterov
    self.wd = config.get("weight_decay")
    self.t = 0
    self.V = [np.zeros_like(w) for w in weights]
    self.Q = [np.zeros_like(w) for w in weights]
    self.E = [np.zeros_like(w) for w in weights]

  def update(self, W, grads):
    factor = mitigations.lr_factor(self.delay, self.t, self.warmup)
    a, b = (mitigations.spike_coefficients(self.gamma, self.delay)
            if self.spike and self.gamma and self.delay
            else (self.gamma, 1.0) if self.nesterov and self.gamma   # Nesterov: D = 1's spike
            else (1.0, 0.0))
    gamma = _f32(self.gamma) if self.kind == "sgd" else self.gamma   # Keras casts it so
    for j, g in enumerate(grads):
      dtype, old = W[j].dtype, W[j].copy()
      g = (g * factor).astype(dtype)
      if self.wd:   # Keras decays the weights before the step
        W[j] = (W[j] - W[j] * _f32(self.wd) * self.lr).astype(dtype)
      if self.kind == "spectrain":
        self.V[j] = (self.gamma * self.V[j] + (1.0 - self.gamma) * g).astype(dtype)
        # W - lr*(a*v + (1-a)*g), summed in the order the stage's update rounds it (the
        # optimizer's step, then its correction; `mitigations.StageRule.apply`).
        W[j] = (W[j] - self.lr * self.V[j]).astype(dtype)
        if a != 1.0:
          W[j] = (W[j] + (self.lr * np.asarray(1.0 - a, dtype) * (self.V[j] - g)).astype(dtype)
                  ).astype(dtype)
      elif self.kind == "sgd":
        self.V[j] = (gamma * self.V[j] - self.lr * g).astype(dtype)
        W[j] = (W[j] + a * self.V[j] - self.lr * b * g).astype(dtype)
      else:
        b1, b2 = self.config["beta_1"], self.config["beta_2"]
        self.V[j] = (self.V[j] + (g - self.V[j]) * (1 - b1)).astype(dtype)
        self.Q[j] = (self.Q[j] + (g * g - self.Q[j]) * (1 - b2)).astype(dtype)
        W[j] = (W[j] - self._adam_step(j, self.t + 1)).astype(dtype)
        if self.nesterov:   # W0 - alpha*(b1*m + (1-b1)*g)/(sqrt(v)+eps), the stage's rounding
          W[j] = (W[j] + self._adam_step(j, self.t + 1, (1 - _f32(b1)) * (self.V[j] - g))
                  ).astype(dtype)
      if self.decay is not None:
        self.E[j] = (self.decay * self.E[j] + (1.0 - self.decay) * (W[j] - old)).astype(dtype)
    self.t += 1

  def _adam_step(self, j, t, direction=None):
    """alpha * m / (sqrt(v) + eps) at update t (`direction` in place of m)."""
    b1, b2, eps = self.config["beta_1"], self.config["beta_2"], self.config["epsilon"]
    alpha = self.lr * math.sqrt(1 - _f32(b2) ** t) / (1 - _f32(b1) ** t)
    m = self.V[j] if direction is None else direction
    return m * alpha / (np.sqrt(self.Q[j]) + eps)

  def predict(self, W, s):
    """W s updates ahead along the optimizer's own step (`tfpipe.rules.prediction`'s table)."""
    out = []
    for j, w in enumerate(W):
      if self.kind == "spectrain":
        step = self.lr * self.V[j]
      elif self.kind == "sgd":
        step = -self.V[j]
      else:
        step = self._adam_step(j, self.t) if self.t else np.zeros_like(w)
      if self.wd and self.kind != "spectrain":   # SpecTrain's prediction is the paper's eq. 4
        step = step + self.lr * _f32(self.wd) * w
      out.append((w - s * step).astype(w.dtype))
    return out


def reference_train(stage_models, loss_fn, batches, method, learning_rate, momentum,
                    spectrain_backward="reuse", version_difference=None, epochs=1,
                    micro_batches=None, recompute=None, lockstep=False, optimizer=None,
                    spike_compensation=None, delay_momentum=False, lr_rescheduling=None,
                    discrepancy_decay=None, nesterov=None, delay_compensation=None,
                    advice=False):
  """Trains the stages by the rule of `method`; returns the final weights of every stage.

  Args:
    stage_models: the K stage sub-models (their variables give the initial weights).
    loss_fn: loss(y_true, y_pred) -> scalar, applied at the last stage (for several outputs
      the batches' labels are tuples, and it takes tuples of labels and lists of outputs).
    batches: a list of (x, y) numpy mini-batches, one epoch.
    method: a pipeline method (`tfpipe.PIPELINE_METHODS`).
    learning_rate, momentum: eta and gamma of the SpecTrain rule.
    micro_batches, recompute, lockstep: as in `tfpipe.Pipeline`.
    optimizer: None (the SpecTrain rule with learning_rate and momentum), or a
      SpecTrain, SGD, Adam or AdamW object whose hyperparameters the rules read.
    spike_compensation, delay_momentum, lr_rescheduling, discrepancy_decay,
      nesterov, delay_compensation, advice: as in `tfpipe.Pipeline` (`tfpipe.rules.mitigations`;
      left None, the method's plain values, or with `advice` what `tfpipe.rules.advice`
      resolves for the method and optimizer),
      the delay D_k of stage k being the largest exact version difference of its
      forwards.

  Returns:
    (weights, log): weights[k] is a list of numpy arrays; log lists
    (k, kind, b, i, version) with `version` the update count of stage k whose
    weights the task read (for a prediction: the count it was made at).
  """
  policy = policies.policy_for(method, spectrain_backward, recompute, lockstep)
  K = len(stage_models)
  rule_optimizer = optimizer if optimizer is not None else optimizers.SpecTrain(learning_rate,
                                                                                momentum)
  batch_norm = any(advice_lib.batch_norm_layers(m) for m in stage_models)
  M = ((advice and advice_lib.micro_batches(policy, rule_optimizer, K, micro_batches,
                                          version_difference, batch_norm))
       or policies.micro_batches_for(policy, micro_batches, K))
  delays = mitigations.delays_for(policy.schedule, K, M, policy.virtual_stages)
  asked = {"version_difference": version_difference, "spike_compensation": spike_compensation,
           "nesterov": nesterov, "delay_compensation": delay_compensation}
  unset = [n for n, v in asked.items() if v is None]
  if advice:
    asked.update(advice_lib.resolve(policy, M, K, rule_optimizer, unset, any(delays), asked))
  else:   # the method's own rule
    asked.update(advice_lib.plain(policy, unset, M))
  version_difference, spike_compensation = asked["version_difference"], asked["spike_compensation"]
  nesterov, delay_compensation = asked["nesterov"], asked["delay_compensation"]
  if lr_rescheduling is None:
    lr_rescheduling = mitigations.DEFAULT_LR_RESCHEDULING if policy.corrects else 0
  if discrepancy_decay is None:
    discrepancy_decay = mitigations.DEFAULT_DISCREPANCY_DECAY
  decay = discrepancy_decay if policy.corrects else None
  rules = []
  W = [[v.numpy().copy() for v in m.trainable_variables] for m in stage_models]
  for k, d in enumerate(delays):
    rule = _Rule(optimizer, learning_rate, momentum, d, spike_compensation, lr_rescheduling, decay,
                 W[k], nesterov)
    if delay_momentum:
      rule.gamma = mitigations.delay_momentum(rule.gamma, d)
    rules.append(rule)
  replay = _Replay(stage_models, loss_fn, policy, M, W, rules, delay_compensation)
  for _ in range(epochs):
    replay.epoch(batches, version_difference)
  return replay.W, replay.log


class _Replay:
  """The rule played out task by task: per stage k its weights `W[k]`, accumulated gradients
  `A[k]`, weights before its last update `P[k]` (2BW), the sum and count of the weights its
  micro-batches' gradients read (`R[k]`, `reads_seen[k]`: DC-ASGD), its update rule, its
  non-trainable state `S[k]`, the table's ops for it and its update count; `log` (see
  `reference_train`)."""

  def __init__(self, stage_models, loss_fn, policy, M, W, rules, delay_compensation):
    K = self.K = len(stage_models)
    self.models, self.loss_fn, self.policy, self.M = stage_models, loss_fn, policy, M
    self.W, self.rules, self.delay_compensation = W, rules, delay_compensation
    self.A = [[np.zeros_like(w) for w in ws] for ws in W]
    self.P = [[w.copy() for w in ws] for ws in W]
    self.R, self.reads_seen = [[np.zeros_like(w) for w in ws] for ws in W], [0] * K
    self.S = [[tf.convert_to_tensor(v) for v in m.non_trainable_variables] for m in stage_models]
    self.ops = [tasks.ops(policy, last=k == K - 1) for k in range(K)]   # the executors' table
    self.updates = [0] * K
    self.log = []

  def compensate(self, g, current, read_weights):
    return mitigations.compensate(np.asarray(self.delay_compensation, g.dtype), g, current,
                                  read_weights)

  def read(self, k, source, s):
    if source == "predicted" and s:
      return self.rules[k].predict(self.W[k], s)
    if source == "corrected":
      return [(w - s * e).astype(w.dtype) for w, e in zip(self.W[k], self.rules[k].E)]
    if source == "delayed" and not s:
      return [p.copy() for p in self.P[k]]
    return [w.copy() for w in self.W[k]]

  def version(self, k, source, s):
    """The update count of the weights `read` gives (2BW's second buffer: one less)."""
    return self.updates[k] - (source == "delayed" and not s and self.updates[k] > 0)

  def update(self, k, grads):
    self.P[k] = [w.copy() for w in self.W[k]]
    self.rules[k].update(self.W[k], grads)
    self.updates[k] += 1

  def epoch(self, batches, version_difference):
    """One epoch of `batches` in the method's task order."""
    K, M = self.K, self.M
    schedule = policies.build_schedule(self.policy, K, len(batches), M)
    self.diffs = policies.version_differences(self.policy, schedule, version_difference)
    self.covers = [verify.covered_units(stage_tasks) for stage_tasks in schedule]
    self.split = {b: _micro_batches(x, y, M) for b, (x, y) in enumerate(batches)}
    self.outputs, self.inputs, self.used, self.grads_out, self.halves = {}, {}, {}, {}, {}
    for k, task in verify.verify(schedule).order:
      kind, b, i = task
      unit = (b, i)
      if kind == "F":
        self._forward(k, task)
      elif kind == "W":   # a split backward's weight half: what its B computed, accumulated
        self.A[k] = [a + g for a, g in zip(self.A[k], self.halves.pop((k, unit)))]
      elif kind == "U":
        if self.delay_compensation:   # the mini-batch's gradient, from the mean of its reads
          mean = [r / max(1, self.reads_seen[k]) for r in self.R[k]]
          self.A[k] = [self.compensate(g, c, r) for g, c, r in zip(self.A[k], self.W[k], mean)]
          self.R[k], self.reads_seen[k] = [np.zeros_like(r) for r in self.R[k]], 0
        self.update(k, self.A[k])
        self.A[k] = [np.zeros_like(a) for a in self.A[k]]
      elif kind == "B":
        self._backward(k, task)

  def _forward(self, k, task):
    kind, b, i = task
    unit, s = (b, i), self.diffs[k][task]
    xs = self.split[b][i or 0][0] if k == 0 else self.outputs.pop((k - 1, unit))
    source = self.ops[k]["F"].reads or self.ops[k]["B"].reads   # the last: its step's weights
    w = self.read(k, source, s)
    self.used[(k, unit)] = (w, self.version(k, source, s), s)
    if k < self.K - 1:
      self.log.append((k, "F", b, i, self.version(k, source, s)))
      self.inputs[(k, unit)] = (xs, self.S[k])
      ys, self.S[k] = _run(self.models[k], [tf.constant(a) for a in w], self.S[k], xs)
      self.outputs[(k, unit)] = [y.numpy() for y in ys]
    else:
      self.inputs[(k, unit)] = (xs, None)   # the last stage runs its forward with the backward

  def _backward_weights(self, k, task, units):
    """(the weights a backward of `units` reads, their update count): at the last stage its
    forward's, else as the table's `reads` says."""
    _, b, i = task
    forward_w, forward_version, forward_s = self.used.pop((k, units[0]))
    for u in units[1:]:
      self.used.pop((k, u))
    reads = self.ops[k]["B"].reads
    if k == self.K - 1:  # forward and backward as one step, with the forward's weights
      w, read_version = self.read(k, reads, forward_s), self.version(k, reads, forward_s)
      self.log.append((k, "F", b, i, read_version))
    elif reads == "kept":
      w, read_version = forward_w, forward_version
    elif reads == "blend":
      sigma = mitigations.blend_factor(self.updates[k] - forward_version)
      w = [(sigma * f + (1.0 - sigma) * c).astype(c.dtype) for f, c in zip(forward_w, self.W[k])]
      read_version = self.updates[k]
    else:
      d = self.updates[k] - forward_version if reads == "corrected" else self.diffs[k][task]
      w, read_version = self.read(k, reads, d), self.updates[k]
    return w, read_version

  def _backward(self, k, task):
    K, (_, b, i) = self.K, task
    unit, units = (b, i), self.covers[k][task]
    parts = [self.inputs.pop((k, u)) for u in units]
    share = sum(self.split[b][u[1] or 0][2] for u in units)
    w, read_version = self._backward_weights(k, task, units)
    if k == K - 1:
      parts = [([np.concatenate(p) for p in zip(*[xs for xs, _ in parts])], self.S[k])]
    self.log.append((k, "B", b, i, read_version))
    w_t = [tf.constant(a) for a in w]
    parts = [([tf.constant(x) for x in xs], state) for xs, state in parts]
    floats = [x for xs, _ in parts for x in xs if x.dtype.is_floating] if k > 0 else []
    with tf.GradientTape() as tape:
      tape.watch(w_t + floats)
      runs = [_run(self.models[k], w_t, state, xs) for xs, state in parts]
      ys = [tf.concat(list(y), 0) for y in zip(*[r[0] for r in runs])]
      if k == K - 1:
        self.S[k] = runs[0][1]
        target = self._loss([self.split[b][u[1] or 0][1] for u in units], ys, share)
      else:
        target = tf.add_n([tf.reduce_sum(y * tf.constant(g, y.dtype))
                           for y, g in zip(ys, self.grads_out.pop((k, unit)))])
    grads = tape.gradient(target, w_t + floats, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    # Dense, also an embedding's (IndexedSlices): the update rules are written for arrays.
    weight_grads = [tf.convert_to_tensor(g).numpy() for g in grads[:len(w_t)]]
    if self.ops[k]["B"].op == "backward_input":   # its W adds them
      self.halves[(k, unit)] = weight_grads
    elif i is None:
      if self.delay_compensation:   # DC-ASGD: from the weights read to the current ones
        weight_grads = [self.compensate(g, c, r) for g, c, r in zip(weight_grads, self.W[k], w)]
      self.update(k, weight_grads)
    else:
      self.A[k] = [a + g for a, g in zip(self.A[k], weight_grads)]
      if self.delay_compensation:
        self.R[k] = [r + x for r, x in zip(self.R[k], w)]
        self.reads_seen[k] += 1
    if k > 0:
      n = len(floats) // len(parts)
      per_part = [grads[len(w_t) + j * n:len(w_t) + (j + 1) * n] for j in range(len(parts))]
      self.grads_out[(k - 1, unit)] = [np.concatenate([g.numpy() for g in gs])
                                       for gs in zip(*per_part)]

  def _loss(self, labels, ys, share):
    """The last stage's loss on `labels` (its units'), weighted by their `share`."""
    if isinstance(labels[0], tuple):   # several outputs: a tuple of labels, one each
      y_true = tuple(tf.constant(np.concatenate(p)) for p in zip(*labels))
      return self.loss_fn(y_true, ys) * tf.constant(share, ys[0].dtype)
    y_true = np.concatenate(labels)
    return self.loss_fn(tf.constant(y_true), ys[0]) * tf.constant(share, ys[0].dtype)
