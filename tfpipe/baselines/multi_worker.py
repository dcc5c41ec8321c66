"""Synchronous data parallelism across processes: `tf.distribute.MultiWorkerMirroredStrategy`.

P: worker processes (TF_CONFIG's "worker" job; this process is its "task").
Every worker runs the same program: `MultiWorkerDataParallel(model)` then
`compile` and `fit` as with Keras. Each global batch is cut into P slices,
worker i trains on slice i, the gradients are summed across the workers
(a collective all-reduce, in the Keras optimizer's `apply`) and every worker
applies the same update, so the
result equals one device training on the global batch. Keras 3's `fit`
does not run under this strategy on TensorFlow (it fails converting
per-replica values), so the loop here is written out with `strategy.run`.

The strategy must exist before TensorFlow runs any op: call
`make_strategy()` at the start of the program (the trainer does).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

from tfpipe import compat
from tfpipe.baselines import epochs as epochs_lib
from tfpipe.cluster import liveness, servers as cluster_lib
from tfpipe.runtime import iterators
from tfpipe.stage import keras_step as compile_utils
from tfpipe.training import data

__all__ = ["make_strategy", "MultiWorkerDataParallel"]

_STRATEGY = {"strategy": None}


def make_strategy(timeout=120.0):
  """The process's MultiWorkerMirroredStrategy (from TF_CONFIG), created once.

  Its workers start in any order, and TensorFlow waits for the others inside
  a call that holds Python's lock and cannot be cancelled. So a small process
  (`tfpipe.cluster.liveness.await_tasks`) probes the other workers until each has
  answered once: if one has not within `timeout` seconds, it names it on
  stderr and kills this process (SIGKILL: TensorFlow may catch SIGTERM).
  """
  if _STRATEGY["strategy"] is None:
    peers = _peers()
    if peers:
      subprocess.Popen([sys.executable, liveness.__file__, json.dumps(peers), str(timeout),
                        str(os.getpid())])
    iterators.wait()   # no dataset iterator is deleted while the context is reset
    _STRATEGY["strategy"] = tf.distribute.MultiWorkerMirroredStrategy()
  return _STRATEGY["strategy"]


class MultiWorkerDataParallel:
  """Keras-style compile/fit of `model`, data parallel over the cluster's worker processes."""

  def __init__(self, model, strategy=None, build=None):
    """`build`: a function that builds the model's architecture again, for the strategy's
    copy where `keras.models.clone_model` cannot copy it (a layer whose `get_config` fails);
    the copy takes `model`'s weights either way."""
    if not isinstance(model, keras.Model):
      raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    self.model = model
    self.strategy = strategy or make_strategy()
    self.workers = compat.num_workers(self.strategy)
    with self.strategy.scope():
      self._trained = keras.models.clone_model(model) if build is None else build()
      self._trained.set_weights(model.get_weights())

  def describe(self):
    return f"MultiWorkerMirroredStrategy over {self.workers} worker processes"

  def summary(self, print_fn=None):
    """Prints what trains the model (one line)."""
    (print_fn or print)(f"tfpipe.MultiWorkerDataParallel: {self.describe()}")

  def compile(self, optimizer, loss, metrics=None):
    del metrics  # the loss is what every worker reports; accuracy needs another all-reduce
    with self.strategy.scope():
      self.optimizer = compile_utils.clone_optimizer(compile_utils.resolve_optimizer(optimizer))
      self.optimizer.build(self._trained.trainable_variables)
    self.loss = compile_utils.resolve_loss(loss)

  def barrier(self):
    """Returns once every worker has called it (a collective sum of one value over the
    workers): a worker done with its own work waits there for the others, its server up (the
    trainer's first worker tracing every host's server, `--transfer_share`)."""
    @tf.function
    def meet():
      ones = self.strategy.run(lambda: tf.constant(1.0))
      return self.strategy.reduce("sum", ones, axis=None)
    return float(meet())

  def _slices(self, dataset):
    """Each worker's slice of every global batch: rows i, i+P, i+2P, ..."""
    P = self.workers

    def per_worker(context):
      i = context.input_pipeline_id
      options = tf.data.Options()
      options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
      take = lambda t: t[i::P]
      return dataset.map(lambda x, y: (tf.nest.map_structure(take, x), take(y))).with_options(
          options)
    return self.strategy.distribute_datasets_from_function(per_worker)

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose=0, callbacks=None,
          shuffle=False, steps_per_epoch=None, seed=None, validation_data=None):
    """Trains; returns a `keras.callbacks.History` with loss and samples_per_second."""
    del validation_data  # evaluate with `evaluate` on one worker
    dataset, num_batches = data.as_dataset(x, y, batch_size, steps_per_epoch, shuffle, seed,
                                           names=data.input_names(self._trained))
    model, loss_fn, optimizer = self._trained, self.loss, self.optimizer

    @tf.function
    def step(batch):
      def replica(xb, yb):
        context = tf.distribute.get_replica_context()
        global_size = context.all_reduce("sum", tf.cast(tf.shape(yb)[0], tf.float32))
        with tf.GradientTape() as tape:
          per_sample = loss_fn.call(yb, model(xb, training=True))
          if per_sample.shape.rank > 1:   # per token: Keras averages over every element
            per_sample = tf.reduce_mean(per_sample, axis=list(range(1, per_sample.shape.rank)))
          loss = tf.reduce_sum(per_sample) / tf.cast(global_size, per_sample.dtype)
        # Keras's TensorFlow optimizer sums the replicas' gradients (an all-reduce) in `apply`.
        optimizer.apply(tape.gradient(loss, model.trainable_variables),
                        model.trainable_variables)
        return loss, global_size
      loss, size = self.strategy.run(replica, args=batch)
      return (self.strategy.reduce("sum", loss, axis=None),
              self.strategy.reduce("mean", size, axis=None))  # the same on every replica

    ended = []   # one entry per epoch trained

    def train_epoch(cbs):
      losses, samples = [], 0
      iterator = iter(self._slices(dataset.take(num_batches)))
      for b, batch in enumerate(iterator):
        loss, size = step(batch)
        losses.append(float(loss))
        samples += int(size)
        cbs.on_train_batch_end(b, {"loss": float(np.mean(losses))})
      ended.append(True)
      if len(ended) == epochs:
        # The last collective is done: a peer that finishes first may now exit, while this
        # worker ends its epoch (callbacks, deleting the iterator) as slowly as it may.
        watchdog.stop()
      iterator = iterators.release(iterator)
      return losses, samples

    with cluster_lib.watch(_peers()) as watchdog:   # a hung peer would stall every all-reduce
      return epochs_lib.run_epochs(self.model, self._trained, epochs, num_batches, callbacks,
                                   verbose, train_epoch)


def _peers():
  """[(job, task, address)] of the other tasks in TF_CONFIG's cluster (none without it)."""
  try:
    spec = cluster_lib.from_tf_config()
    me = json.loads(os.environ["TF_CONFIG"]).get("task", {})
  except (ValueError, KeyError):
    return []
  return [(job, task, address) for job, addresses in spec.items()
          for task, address in enumerate(addresses)
          if (job, task) != (me.get("type"), me.get("index"))]
