"""Data parallel x pipeline: R replicas of a K-stage pipeline on R x K devices, each stage's
gradients summed over its replicas before its update; equal to the method at the global batch."""

import dataclasses
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.conftest import DEVICES
from tests.test_pipeline import _assert_equals_keras, _stage_weights, LR, MOMENTUM
from tfpipe.rules import optimizers
from tfpipe.stage import mirrors as mirrors_lib, reduction
import tfpipe


_COMPILED, _THREADED = helpers.RUNTIMES[1], helpers.RUNTIMES[0]


_HOSTS = ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"]


@pytest.mark.parametrize("devices,synchronous,tied,rows,expected", [
    (_HOSTS, True, False, False, "ring"),           # across hosts: each replica its own copy
    (_HOSTS, False, False, False, None),            # asynchronous: the weights stay on one
    (_HOSTS, True, True, False, None),              # a tied weight: summed with its twin
    (_HOSTS, True, False, True, None),              # an embedding's rows: kept by the reduction
    (["/job:worker/task:0/cpu:0", "/job:worker/task:0/cpu:1"], True, False, False, None),
    (DEVICES[:2], True, False, False, None),        # one process
    ([DEVICES[0], _HOSTS[1]], True, False, False, None)])   # the client's device and a host
def test_replicas_on_different_hosts_sum_by_a_ring_by_default(devices, synchronous, tied, rows,
                                                                expected):
  assert reduction.default(devices, synchronous, tied, rows) == expected


def test_replicas_in_one_process_keep_one_copy_of_the_weights_by_default():
  pipe = tfpipe.Pipeline(helpers.sequential_mlp(), devices=DEVICES[:2], method="1f1b",
                         micro_batches=2, data_parallel=2)
  pipe.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
  assert [p.mirrors for p in pipe.programs] == [None]
  assert isinstance(pipe.programs[0].cross_device_ops, tf.distribute.ReductionToOneDevice)


@pytest.mark.parametrize("method,runtime", helpers.on_one_worker("keras-fit", [
    ("gpipe", _COMPILED), ("1f1b", _COMPILED), ("zb", _COMPILED), ("interleaved", _COMPILED),
    ("zbv", _COMPILED), ("zb", _THREADED), ("zbv", _THREADED)], key=lambda _: "global-batch"),
    ids=["gpipe", "1f1b", "zb", "interleaved", "zbv", "zb-threaded", "zbv-threaded"])
def test_replicated_synchronous_pipelines_equal_keras_at_the_global_batch(method, runtime):
  # 2 replicas x 2 stages of a model whose cut carries two tensors; 18 samples per batch, 2
  # micro-batches of 9, split 5 + 4 over the replicas: uneven parts weigh by their size.
  # float64, as gpipe's case says.
  # interleaved and zbv: 2 stages on each of a replica's 2 devices.
  pipe = _assert_equals_keras(functools.partial(helpers.skip_model, dtype="float64"), 2, method,
                              loss_dtype="float64", micro_batches=2, batch_size=18,
                              runtime=runtime, data_parallel=2)
  first, second = [DEVICES[0], DEVICES[2]], [DEVICES[1], DEVICES[3]]
  assert pipe.stage_devices == {"interleaved": [first, second, first, second],
                                "zbv": [first, second, second, first]}.get(method,
                                                                           [first, second])


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method", helpers.on_one_worker("replicated-rule", ["pipedream", "vanilla"]))
def test_replicated_asynchronous_pipelines_follow_their_rule_at_the_global_batch(method,
                                                                                 runtime):
  """An asynchronous method's replicas are its stages at R times the batch: the weight rule
  (and its staleness) is unchanged."""
  bs = helpers.batches(10)
  x, y = helpers.as_arrays(bs)
  # float64 (two replicas' gradient sums round otherwise than one mean: see gpipe's case),
  # with the reference given the optimizer's float32 learning rate.
  pipe, compile_ = helpers.pipeline(helpers.sequential_mlp(dtype="float64"), runtime,
                                    num_stages=2, method=method, data_parallel=2)
  loss = keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  expected, _ = helpers.reference_train(pipe.stage_models, loss, bs, method,
                                        float(np.float32(LR)), MOMENTUM)
  compile_(optimizers.SpecTrain(LR, MOMENTUM), loss)
  pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
  for actual, ref in zip(_stage_weights(pipe), expected):
    helpers.assert_weights_close(actual, ref, rtol=1e-9, atol=1e-11)


def test_replicated_pipeline_predicts_and_evaluates_as_keras():
  model = helpers.sequential_mlp()
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe = tfpipe.Pipeline(model, num_stages=2, method="1f1b", data_parallel=2)
  pipe.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
  helpers.assert_close(pipe.predict(x, batch_size=16, verbose=0),
                             model.predict(x, batch_size=16, verbose=0), rtol=1e-5)
  model.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
  assert pipe.evaluate(x, y, batch_size=16, verbose=0) == pytest.approx(
      model.evaluate(x, y, batch_size=16, verbose=0), rel=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"data_parallel": 0}, "data_parallel=0"),
    ({"data_parallel": "2"}, "data_parallel='2'"),
    ({"data_parallel": 2, "stage_replicas": {0: 2}}, "stage_replicas"),
    ({"method": "interleaved", "stage_replicas": {0: 2}}, "virtual stages"),
    ({"data_parallel": 2, "method": "timeprest"}, "'timeprest'"),
    ({"data_parallel": 3, "devices": DEVICES}, "4 devices cannot hold 3"),
    ({"data_parallel": 2, "devices": DEVICES, "num_stages": 3}, "not num_stages=3"),
])
def test_bad_data_parallel_options_are_refused_by_name(options, message):
  options = dict({"num_stages": 2} if "devices" not in options else {}, **options)
  with pytest.raises(ValueError, match=message):
    tfpipe.Pipeline(helpers.sequential_mlp(), **options)


def test_the_trainer_runs_replicated_and_interleaved_pipelines_and_refuses_bad_ones():
  from trainers import config as config_lib, main
  config = config_lib.TrainConfig(model="snn", dataset="digits", method="1f1b", num_stages=2,
                                  data_parallel=2, snn_width=16, snn_depth=3, batch_size=16,
                                  steps=3, epochs=1, verbose=0, logdir="",
                                  cross_device_ops="hierarchical_copy")
  history, trainer, _ = main.run(config)
  assert trainer.data_parallel == 2 and history["loss"][0] > 0
  assert isinstance(trainer.programs[0].cross_device_ops, tf.distribute.HierarchicalCopyAllReduce)
  history, trainer, _ = main.run(dataclasses.replace(config, method="interleaved",
                                                     data_parallel=1, virtual_stages=2,
                                                     cross_device_ops=None))
  assert trainer.num_stages == 4 and len(set(trainer.devices)) == 2 and history["loss"][0] > 0
  with pytest.raises(ValueError, match="--data_parallel replicates a pipeline"):
    main.run(dataclasses.replace(config, method="single"))
  with pytest.raises(ValueError, match="virtual stages work with interleaved"):
    main.run(dataclasses.replace(config, data_parallel=1, virtual_stages=2))


class _CountingReduction(tf.distribute.ReductionToOneDevice):
  """Reduces as its parent and counts the tensors it summed."""

  def __init__(self):
    super().__init__()
    self.reduced = 0

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    self.reduced += len(value_destination_pairs)
    return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


def test_replicas_gradients_are_summed_by_the_cross_device_ops_given():
  ops = _CountingReduction()
  pipe = _assert_equals_keras(functools.partial(helpers.skip_model, dtype="float64"), 2, "1f1b",
                              loss_dtype="float64", micro_batches=2, batch_size=18,
                              data_parallel=2, cross_device_ops=ops)
  weights = [len(p.trainable) for p in pipe.programs]
  assert ops.reduced >= sum(weights)   # every weight of every stage, at least once per trace
  assert all(p.cross_device_ops is ops for p in pipe.programs)


def test_replicate_sums_the_copies_gradients_with_an_unused_copy_as_zeros():
  w = tf.Variable([1.0, 2.0])
  devices = [DEVICES[0], DEVICES[1]]
  for name in reduction.NAMES:
    if name == "nccl":
      continue   # GPUs only
    ops = reduction.choose(devices, name)

    @tf.function
    def grads():
      with tf.GradientTape() as tape:
        (a, unused), (b, c) = reduction.replicate([tf.convert_to_tensor(w), w * 2.0], devices,
                                                  ops)
        with tf.device(devices[1]):
          loss = tf.reduce_sum(a * 3.0) + tf.reduce_sum(b * b) + tf.reduce_sum(c)
      return tape.gradient(loss, w)

    np.testing.assert_allclose(grads().numpy(), [3 + 2 + 2, 3 + 4 + 2])


def _loops(graph_def):
  """(device, name) of every while loop in a GraphDef and the functions it holds."""
  nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
  return [(n.device, n.name) for n in nodes if n.op in ("While", "StatelessWhile")]


def test_a_replicas_recurrent_loop_and_its_gradient_are_placed_on_its_device():
  # Where TensorFlow sees higher-order gradients possible (two tapes watching, or a
  # persistent one), it wraps a while loop in a function whose gradient's loop has no
  # device, and the loop ran on the caller's default device (on TF servers: the client).
  inputs = keras.Input((6,), dtype="int32")
  model = keras.Model(inputs, keras.layers.LSTM(5)(keras.layers.Embedding(30, 4)(inputs)))
  weights = [tf.convert_to_tensor(v) for v in model.trainable_variables]
  devices = DEVICES[1:3]

  @tf.function
  def step(x):
    with tf.device(devices[0]), tf.GradientTape() as tape:
      tape.watch(weights)
      state = [tf.convert_to_tensor(v) for v in model.non_trainable_variables]
      ys, _, _ = reduction.replicated_call(model, weights, state, [x], True, devices,
                                           reduction.choose(devices), persistent=False)
      loss = tf.reduce_sum(ys[0])
    with tf.device(devices[0]):   # as a stage takes it
      return tape.gradient(loss, weights)

  graph = step.get_concrete_function(tf.TensorSpec((4, 6), tf.int32)).graph.as_graph_def()
  loops = _loops(graph)
  assert len(loops) == 4   # each replica's forward and gradient
  placed = [tf.DeviceSpec.from_string(d).device_index if d else None for d, _ in loops]
  assert placed.count(1) == placed.count(2) == 2, loops


def test_cross_device_ops_default_to_mirrored_strategys_choice_and_refuse_bad_values():
  assert isinstance(reduction.choose(DEVICES[:2]), tf.distribute.ReductionToOneDevice)
  assert isinstance(reduction.choose(["/gpu:0", "/gpu:1"]), tf.distribute.NcclAllReduce)
  assert isinstance(reduction.choose(["/job:worker/task:0/gpu:0", "/job:worker/task:1/gpu:0"]),
                    tf.distribute.ReductionToOneDevice)
  for bad, message in (("rings", "unknown `cross_device_ops` 'rings'"), (3, "Received: 3")):
    with pytest.raises(ValueError, match=message):
      tfpipe.Pipeline(helpers.sequential_mlp(), num_stages=2, method="1f1b", data_parallel=2,
                      cross_device_ops=bad)


@pytest.mark.parametrize("method,runtime", helpers.on_one_worker("keras-fit", [
    ("gpipe", _COMPILED), ("1f1b", _COMPILED), ("zb", _COMPILED), ("interleaved", _COMPILED),
    ("zbv", _COMPILED), ("1f1b", _THREADED), ("sequential", _COMPILED)], key=lambda _: "ring"),
    ids=["gpipe", "1f1b", "zb", "interleaved", "zbv", "1f1b-threaded", "sequential"])
def test_replicas_with_their_own_weights_and_a_ring_all_reduce_equal_keras(method, runtime):
  """cross_device_ops="ring": each replica updates its own copy of its stage's weights with
  the ring's sum; the copies stay equal to the stage's (which equal Keras)."""
  pipe = _assert_equals_keras(functools.partial(helpers.skip_model, dtype="float64"), 2, method,
                              loss_dtype="float64",
                              micro_batches=None if method == "sequential" else 2,
                              batch_size=18, runtime=runtime, data_parallel=2,
                              cross_device_ops="ring")
  assert all(p.mirrors is not None for p in pipe.programs)
  for p in pipe.programs:
    for copy in p.mirrors.weights:
      for own, mirror in zip(p.trainable, copy):
        np.testing.assert_array_equal(mirror.numpy(), own.numpy())
        where = tf.DeviceSpec.from_string(mirror.value.device)
        wanted = tf.DeviceSpec.from_string(p.replica_devices[1])
        # on the second replica's device, not the first's
        assert (where.device_type, where.device_index) == (wanted.device_type, wanted.device_index)


def test_ring_replicas_of_a_recomputed_zero_bubble_backward_equal_keras():
  # Its input half recomputes the forward for the input gradients alone: a tape that saw the
  # weights there ran the replicas' own updates too, and they stepped twice.
  _assert_equals_keras(functools.partial(helpers.skip_model, dtype="float64"), 2, "zb",
                       loss_dtype="float64", micro_batches=2, batch_size=18, data_parallel=2,
                       cross_device_ops="ring", recompute=True)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_ring_all_reduce_sums_every_replicas_tensors_on_every_replica(replicas):
  devices = [DEVICES[r % len(DEVICES)] for r in range(replicas)]
  rng = np.random.default_rng(replicas)
  values = [[rng.standard_normal(shape) for shape in ((3, 5), (7,), ())] for _ in devices]
  sums = mirrors_lib.ring_all_reduce(
      [[tf.constant(v) for v in vs] for vs in values], devices)
  for r in range(replicas):
    for j in range(3):
      np.testing.assert_allclose(sums[r][j].numpy(), sum(vs[j] for vs in values), rtol=1e-12)
      np.testing.assert_array_equal(sums[r][j].numpy(), sums[0][j].numpy())   # one sum, copied


@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_ring_replicas_with_global_norm_clipping_equal_keras(method):
  """A whole-model decision (global_clipnorm) reads the summed gradients' norm: each backward
  sums over the replicas, and every replica applies the same clipped step."""
  bs = helpers.batches(8, batch_size=18)
  x, y = helpers.as_arrays(bs)
  loss = lambda: keras.losses.SparseCategoricalCrossentropy(dtype="float64")
  optimizer = lambda: keras.optimizers.SGD(LR, momentum=MOMENTUM, global_clipnorm=0.05)
  build = functools.partial(helpers.skip_model, dtype="float64")
  expected = helpers.keras_fit_weights(build(), optimizer(), loss(), x, y, batch_size=18,
                                       shuffle=False, verbose=0)
  model = build()
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=2, data_parallel=2,
                         cross_device_ops="ring")
  pipe.compile(optimizer(), loss())
  pipe.fit(x, y, batch_size=18, shuffle=False, verbose=0)
  assert all(p.mirrors is not None and p.mirrors.summing() for p in pipe.programs)
  helpers.assert_weights_close(model.get_weights(), expected)
  for p in pipe.programs:
    for own, mirror in zip(p.trainable, p.mirrors.weights[0]):
      np.testing.assert_array_equal(mirror.numpy(), own.numpy())


def test_ring_is_refused_for_an_asynchronous_method_by_name():
  with pytest.raises(ValueError, match="needs a synchronous schedule; 'pipedream' is not one"):
    pipe = tfpipe.Pipeline(helpers.sequential_mlp(), num_stages=2, method="pipedream",
                           data_parallel=2, cross_device_ops="ring")
    pipe.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy())
