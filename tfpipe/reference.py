"""The slow reference: each method's DESIGN.md weight rule, one task at a time, on one device.

K: stages, k: stage index, b: batch, s: version difference, W: weights, V:
smoothed gradients. No threads, no compiled functions, no optimizer
objects: weights are numpy arrays and the SpecTrain / momentum rule
(`v = gamma*v + (1-gamma)*g; W -= eta*v`) is written out, in the model's dtype. The tests hold
the runtime to these results.
"""

import numpy as np
import tensorflow as tf

from tfpipe import optimizers, policies, schedules

__all__ = ["reference_train"]


def _run(model, weights, xs, training=True):
  state = [tf.convert_to_tensor(v) for v in model.non_trainable_variables]
  inputs = xs[0] if len(xs) == 1 else list(xs)
  ys, _ = model.stateless_call([tf.constant(w) for w in weights] if isinstance(weights[0], np.ndarray)
                               else weights, state, inputs, training=training)
  return tf.nest.flatten(ys)


def reference_train(stage_models, loss_fn, batches, method, learning_rate, momentum,
                    spectrain_backward="reuse", version_difference="paper", epochs=1):
  """Trains the stages by the rule of `method`; returns the final weights of every stage.

  Args:
    stage_models: the K stage sub-models (their variables give the initial weights).
    loss_fn: loss(y_true, y_pred) -> scalar, applied at the last stage.
    batches: a list of (x, y) numpy batches, one epoch.
    method: a pipeline method ("sequential", "vanilla", "pipedream", "spectrain").
    learning_rate, momentum: eta and gamma of the SpecTrain rule.

  Returns:
    (weights, log): weights[k] is a list of numpy arrays; log lists
    (k, kind, b, version) with `version` the update count of stage k whose
    weights the task read (for a prediction: the count it was made at).
  """
  policy = policies.policy_for(method, spectrain_backward)
  K, N = len(stage_models), len(batches)
  W = [[v.numpy().copy() for v in m.trainable_variables] for m in stage_models]
  V = [[np.zeros_like(w) for w in ws] for ws in W]
  updates = [0] * K
  log = []
  dtype = [[v.numpy().dtype for v in m.trainable_variables] for m in stage_models]

  def read(k, source, s):
    if source == "current":
      return [w.copy() for w in W[k]]
    return [optimizers.predict_weights(w, v, learning_rate, s).astype(w.dtype)
            for w, v in zip(W[k], V[k])]

  for _ in range(epochs):
    schedule = schedules.build(policy.schedule, K, N)
    diffs = policies.version_differences(policy, schedule, version_difference)
    outputs, inputs, used, grads_out = {}, {}, {}, {}
    for k, (kind, b) in schedules.global_order(schedule):
      s = diffs[k][(kind, b)]
      model = stage_models[k]
      cast = lambda ws, k=k: [w.astype(d) for w, d in zip(ws, dtype[k])]
      if kind == "F":
        x = batches[b][0]
        xs = (list(x) if isinstance(x, (tuple, list)) else [x]) if k == 0 else outputs.pop((k - 1, b))
        w = read(k, policy.forward, s)
        used[(k, b)] = (w, updates[k])
        inputs[(k, b)] = xs
        log.append((k, "F", b, updates[k]))
        if k < K - 1:
          outputs[(k, b)] = [y.numpy() for y in _run(model, cast(w), xs)]
        continue
      xs = inputs.pop((k, b))
      forward_w, forward_version = used.pop((k, b))
      if policy.backward == "forward":
        w, version = forward_w, forward_version
      else:
        w, version = read(k, policy.backward, s), updates[k]
      log.append((k, "B", b, version))
      w_t = [tf.constant(a) for a in cast(w)]
      xs_t = [tf.constant(x) for x in xs]
      floats = [x for x in xs_t if x.dtype.is_floating] if k > 0 else []
      with tf.GradientTape() as tape:
        tape.watch(w_t + floats)
        ys = _run(model, w_t, xs_t)
        if k == K - 1:
          target = loss_fn(tf.constant(batches[b][1]), ys[0])
        else:
          target = tf.add_n([tf.reduce_sum(y * tf.constant(g, y.dtype))
                             for y, g in zip(ys, grads_out.pop((k, b)))])
      grads = tape.gradient(target, w_t + floats, unconnected_gradients=tf.UnconnectedGradients.ZERO)
      for i, g in enumerate(grads[:len(w_t)]):
        V[k][i] = (momentum * V[k][i] + (1.0 - momentum) * g.numpy()).astype(W[k][i].dtype)
        W[k][i] = (W[k][i] - learning_rate * V[k][i]).astype(W[k][i].dtype)
      updates[k] += 1
      if k > 0:
        grads_out[(k - 1, b)] = [g.numpy() for g in grads[len(w_t):]]
  return W, log
