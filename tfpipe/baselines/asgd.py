"""Asynchronous SGD with parameter servers (the layer-wise partitioning paper's ASGD baseline), on
`tf.distribute.ParameterServerStrategy` with a `ClusterCoordinator`.

W: workers, P: parameter servers. The model's variables (and the momentum
slots) live on the P servers; this process is the coordinator. Each
scheduled step runs on whichever worker is free: it reads the current
weights, computes a mini-batch gradient, and applies its update to the
servers without waiting for the others (Wang et al.'s layer-wise partitioning paper, algorithm 1,
without the
mutex), so a gradient may have been computed on weights other workers have
already moved: the staleness ASGD trades for throughput.

Synchronous parameter-server data parallelism (Wang et al.'s layer-wise partitioning paper, fig. 4b:
workers
send gradients to a host, which averages and sends the weights back) is not
what this strategy does; in tfpipe it is the `dataparallel` baseline,
`MirroredStrategy` with `ReductionToOneDevice` (reduce on one device, then
broadcast), in one process, or `MultiWorkerMirroredStrategy` across
processes (`tfpipe.multi_worker`).
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe.baselines import epochs as epochs_lib
from tfpipe.cluster import servers as cluster_lib
from tfpipe.runtime import iterators
from tfpipe.stage import keras_step as compile_utils
from tfpipe.training import data

__all__ = ["ASGD"]


def _chief_spec(spec):
  """`spec` with a chief task for this process (the coordinator)."""
  if not spec.get("worker") or not spec.get("ps"):
    raise ValueError(f"ASGD needs a cluster with 'worker' and 'ps' jobs. Received jobs: "
                     f"{sorted(spec)}")
  spec = {job: list(addresses) for job, addresses in spec.items()}
  spec.setdefault("chief", [cluster_lib.client_address(spec)])   # where the tasks reach us
  return spec


class ASGD:
  """Keras-style compile/fit with asynchronous SGD on the parameter servers of `spec`.

  `spec`: a cluster spec dict with "worker" and "ps" jobs (e.g.
  `tfpipe.cluster.LocalCluster({"worker": 2, "ps": 1}).spec`, or TF_CONFIG's).
  Joining the cluster renames this process's TensorFlow job, which leaves
  the variables made before it unreachable: `self.model` is a copy of
  `model` made after joining, and holds the trained weights after `fit`.
  """

  def __init__(self, model, spec, build=None):
    """`build`: a function that builds the model's architecture again, for the copies made
    after joining where `keras.models.clone_model` cannot copy it (a layer whose `get_config`
    fails); they take `model`'s weights either way."""
    if not isinstance(model, keras.Model):
      raise ValueError(f"`model` must be a keras.Model. Received: {type(model).__name__}")
    weights = model.get_weights()   # before joining the cluster
    self.spec = _chief_spec(spec)
    # Its servers answer first (TensorFlow would wait for a missing one forever).
    cluster_lib.check_answering({job: a for job, a in self.spec.items() if job != "chief"})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.spec), task_type="chief", task_id=0, rpc_layer="grpc")
    iterators.wait()   # no dataset iterator is deleted while the context is reset
    self.strategy = tf.distribute.ParameterServerStrategy(resolver)
    cluster_lib.note_connected(self.spec)
    self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
    copy = (lambda: keras.models.clone_model(model)) if build is None else build
    self.model = copy()
    self.model.set_weights(weights)
    with self.strategy.scope():
      self._trained = copy()
      self._trained.set_weights(weights)
      self._velocity = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                        for v in self._trained.trainable_variables]

  def describe(self):
    return (f"{len(self.spec['worker'])} workers, {len(self.spec['ps'])} parameter servers "
            "(ParameterServerStrategy)")

  def summary(self, print_fn=None):
    """Prints what trains the model (one line)."""
    (print_fn or print)(f"tfpipe.ASGD: {self.describe()}")

  def compile(self, optimizer, loss, metrics=None):
    """Takes the learning rate and momentum of `optimizer` (SpecTrain: v = g v + (1-g) grad;
    SGD: v = g v + grad; then W -= lr v), the loss, and accuracy if asked for."""
    optimizer = compile_utils.resolve_optimizer(optimizer)
    config = optimizer.get_config()
    self.learning_rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    self.momentum = float(config.get("momentum", 0.0))
    self.damped = hasattr(optimizer, "smoothed_gradient")  # SpecTrain's smoothed gradient
    self.loss = compile_utils.resolve_loss(loss)
    self.metrics = compile_utils.resolve_metrics(metrics, self.loss)

  def _step_fn(self):
    model, velocity, loss_fn = self._trained, self._velocity, self.loss
    lr, gamma = self.learning_rate, self.momentum
    scale = (1.0 - gamma) if self.damped else 1.0

    @tf.function
    def step(iterator):
      def replica(xb, yb):
        # The weights are read once, at the step's start (the algorithm's "read the current
        # weights"): a layer that reads a weight every time step (an LSTM's loop) would
        # otherwise fetch it from the parameter servers at each one.
        trainable = [tf.identity(v) for v in model.trainable_variables]
        state = [tf.identity(v) for v in model.non_trainable_variables]
        with tf.GradientTape() as tape:
          tape.watch(trainable)
          out, new_state = model.stateless_call(trainable, state, xb, training=True)
          loss = loss_fn(yb, out)
        grads = tape.gradient(loss, trainable)
        for v, value in zip(model.non_trainable_variables, new_state):
          v.assign(value)
        for w, v, g in zip(model.trainable_variables, velocity, grads):
          if g is None:   # a weight the loss does not read: no step, as in Keras
            continue
          # An embedding's rows made dense: the momentum decays on every row.
          g = tf.convert_to_tensor(g)
          # The update runs on the parameter server of the velocity (the weight's, with one
          # server): only the gradient crosses. Run here, the velocity was read out, written
          # back and read out again: 3.7 times the weights a step from the server.
          with tf.device(v.device):
            v.assign(gamma * v + scale * g)
            w.assign_sub(lr * v)
        return loss, tf.shape(yb)[0]
      xb, yb = next(iterator)
      return self.strategy.run(replica, args=(xb, yb))
    return step

  def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose=0, callbacks=None,
          validation_data=None, shuffle=True, steps_per_epoch=None, seed=None):
    """Schedules `steps_per_epoch` (default: the data's batch count) steps per epoch.

    With arrays, each worker builds its own shuffled copy of the data (the
    arrays travel inside the dataset function, so they must fit in a graph:
    < 2 GB). A tf.data.Dataset must be created after this ASGD (after joining
    the cluster); it is repeated on every worker.
    """
    _, num_batches = data.as_dataset(x, y, batch_size, steps_per_epoch, shuffle, seed,
                                     names=data.input_names(self.model))
    if isinstance(x, tf.data.Dataset):
      dataset_fn = lambda: x.repeat()
    else:
      arrays = (tf.nest.map_structure(np.asarray, x), np.asarray(y))   # x may be a dict
      size = batch_size or 32

      def dataset_fn():
        ds = tf.data.Dataset.from_tensor_slices(arrays)
        if shuffle:
          ds = ds.shuffle(len(arrays[1]), seed=seed, reshuffle_each_iteration=True)
        return ds.repeat().batch(size, drop_remainder=True)
    per_worker = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
    step = self._step_fn()

    def train_epoch(cbs):
      # The steps run on whichever worker is free; each step's end is reported as its
      # result arrives, in the order they were scheduled (progress). That is after its
      # traffic, and a fast step's after the next ones': per-step counters (such as
      # `tfpipe.instruments.traffic.LinkTraffic`) count from the epoch's start instead.
      results = [self.coordinator.schedule(step, args=(per_worker,)) for _ in range(num_batches)]
      values = []
      for b, result in enumerate(results):
        values.append(result.fetch())
        cbs.on_train_batch_end(b, {"loss": float(values[-1][0])})
      self.coordinator.join()
      return [float(l) for l, _ in values], sum(int(n) for _, n in values)

    def validation_logs():
      val_x, val_y = (validation_data if isinstance(validation_data, (tuple, list))
                      else (validation_data, None))
      return self.evaluate(val_x, val_y, batch_size, return_dict=True, prefix="val_")

    return epochs_lib.run_epochs(self.model, self._trained, epochs, num_batches, callbacks,
                                 verbose, train_epoch,
                                 validation_logs if validation_data is not None else None,
                                 asynchronous_steps=True)

  def evaluate(self, x=None, y=None, batch_size=None, steps=None, return_dict=False,
               verbose=0, prefix=""):
    """Loss and metrics of the trained weights (copied into `model`), on this process."""
    del verbose
    dataset, num_batches = data.as_dataset(x, y, batch_size, steps,
                                          names=data.input_names(self.model))
    for m in self.metrics:
      m.reset_state()
    total, count = 0.0, 0
    for xb, yb in dataset.take(num_batches):
      out = self.model(xb, training=False)
      n = int(tf.shape(yb)[0])
      total += float(self.loss(yb, out)) * n
      count += n
      for m in self.metrics:
        m.update_state(yb, out)
    logs = {prefix + "loss": total / max(count, 1)}
    logs.update({prefix + m.name: float(m.result()) for m in self.metrics})
    return logs if return_dict else list(logs.values())
