"""Whole-model decisions across stages: global-norm clipping, made once per mini-batch.

Keras's `global_clipnorm` clips every gradient of the model by one norm, that of
the whole gradient. A synchronous schedule (`tfpipe.SYNCHRONOUS_METHODS`) has
every stage's gradient of mini-batch b accumulated before any stage applies it,
when the schedule is built with joint updates (`schedules.jointly_updated`: the
verifier then lets no stage's update U(b) run before every stage's backwards of
b). The first stage to reach its update of b decides for all:

    n = sqrt(sum over stages k of ||A_k||^2)     (A_k: stage k's accumulated gradient,
                                                  already summed over its replicas; an
                                                  embedding's IndexedSlices counted row by
                                                  row, as Keras counts them)
    c_b = clip * min(1 / n, 1 / clip)             (Keras's `clip_by_global_norm`; NaN
                                                  when n is not finite, as there)

and records it with the update count it holds for (every stage of a synchronous
schedule has applied the same number of updates); each stage's update then
applies c_b * A_k. The decision lives in variables, so it holds across the
compiled executor's windows, and in the threaded executor the updates of one
mini-batch take a lock while they decide (`JointDecision.lock`).

An asynchronous method updates its stages from different mini-batches at
different times: there is no one gradient to take the norm of, and `compile`
refuses `global_clipnorm` there, naming the schedules that take it.
"""

import threading

import tensorflow as tf

__all__ = ["JointDecision", "check"]


def check(optimizer, method, synchronous):
  """Refuses, in one line, `global_clipnorm` on a method whose updates are not joint."""
  clip = getattr(optimizer, "global_clipnorm", None)
  if clip and method not in synchronous:
    raise ValueError(
        f"global_clipnorm={clip} needs every stage's gradient of a mini-batch before any "
        f"stage updates, which method {method!r} (asynchronous) never has: use one of the "
        f"synchronous schedules ({', '.join(synchronous)}), or clipnorm (per variable) or "
        "clipvalue")


class JointDecision:
  """The clip factor of each mini-batch, decided once across `programs` (see the module).

  `clip`: Keras's `global_clipnorm`. `device`: where the decision's variables live.
  """

  def __init__(self, clip, device):
    self.clip = float(clip)
    self.programs = []
    self.lock = threading.Lock()
    with tf.device(device):
      self.decided_for = tf.Variable(tf.constant(-1, tf.int64), trainable=False,
                                     name="joint_decided_for")
      self.factor = tf.Variable(1.0, trainable=False, name="joint_clip_factor")

  def factor_for(self, count):
    """The clip factor of the mini-batch whose update is number `count` (an int64 tensor: the
    updating stage's update count), decided by the first update that asks."""
    count = tf.cast(count, tf.int64)

    def decide():
      squares = [q for p in self.programs for q in p.squared_norms()]
      norm = tf.sqrt(tf.add_n(squares))
      factor = self.clip * tf.minimum(1.0 / norm, 1.0 / self.clip) + (norm - norm)
      with tf.control_dependencies([self.factor.assign(factor),
                                    self.decided_for.assign(count)]):
        return tf.identity(factor)

    return tf.cond(tf.equal(self.decided_for.read_value(), count),
                   lambda: tf.identity(self.factor.read_value()), decide)
