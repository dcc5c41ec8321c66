"""Wang et al.'s speedup model against measurement: data parallel, ASGD and layer-wise
(pipelined) model parallelism on its fully connected DNN, 2 workers here.

Measures on this machine T_calc (one device's time for a batch), T_comm (moving
one copy of the weights between two devices) and the time to move one batch
of activations, predicts each method's speedup with `tfpipe.plan.analytic`
(eq. 8 for data parallel and ASGD, the layer-wise model for the pipeline),
then trains each and prints predicted beside measured. ASGD runs last: it
joins a cluster of local TF servers (2 workers, 1 parameter server). Writes
bench/results/speedup_model.md.

  python bench/speedup_model.py [--width=1024 --batch_size=256 --steps=40]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common, results_io  # noqa: E402

common.define(width=1024, batch_size=256, results_dir=results_io.RESULTS)
flags.DEFINE_integer("steps", 40, "steps per runner")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import keras
  import tensorflow as tf
  import tfpipe
  from tfpipe.plan import analytic
  from tfpipe.models import mlp
  from tfpipe.instruments.throughput import ThroughputMeter
  devices = tfpipe.devices.ensure_logical_cpus(2, intra_op_threads=1)
  rng = np.random.default_rng(0)
  n = FLAGS.batch_size * FLAGS.steps
  x, y = rng.standard_normal((n, 784)).astype("float32"), rng.integers(0, 10, n)
  window = (5, FLAGS.steps - 1)

  def model():
    keras.utils.set_random_seed(0)
    return mlp.dnn((784,), 10, width=FLAGS.width)

  def measure(method, **options):
    trainer = tfpipe.create(model(), method, **options)
    trainer.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    meter = ThroughputMeter(FLAGS.batch_size, window)
    trainer.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False,
                callbacks=[meter])
    return meter.samples_per_second()

  single = measure("single")
  t_calc = FLAGS.batch_size / single
  weights = model().trainable_variables
  with tf.device(devices[0]):
    held = [tf.identity(w) for w in weights]
    batch = tf.ones((FLAGS.batch_size, FLAGS.width))

  def copy(tensors):
    with tf.device(devices[1]):
      return [tf.identity(t).numpy() for t in tensors]
  t_comm = results_io.median_seconds(lambda: copy(held))
  t_act = results_io.median_seconds(lambda: copy([batch]))
  rows = [["single", "-", "1.00", f"{single:.0f}"]]
  dp = measure("dataparallel", num_stages=2)
  rows.append(["data parallel (MirroredStrategy), P=2",
               f"{analytic.data_parallel_speedup(2, t_calc, t_comm):.2f}", f"{dp / single:.2f}",
               f"{dp:.0f}"])
  lw = measure("pipedream", num_stages=2)
  rows.append(["layer-wise pipeline (pipedream), K=2",
               f"{analytic.layerwise_speedup(t_calc, 2, t_act):.2f}", f"{lw / single:.2f}",
               f"{lw:.0f}"])
  print(f"T_calc {1e3 * t_calc:.1f} ms, T_comm {1e3 * t_comm:.1f} ms, activations "
        f"{1e3 * t_act:.2f} ms", flush=True)
  with tfpipe.cluster.LocalCluster({"worker": 2, "ps": 1}) as local:
    asgd = tfpipe.create(model(), "asgd", spec=local.spec)
    asgd.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = asgd.fit(x, y, batch_size=FLAGS.batch_size, epochs=3, shuffle=False)
    rate = statistics.median(history.history["samples_per_second"][1:])
  rows.append(["ASGD, 2 workers + 1 parameter server",
               f"{analytic.data_parallel_speedup(2, t_calc, t_comm):.2f}", f"{rate / single:.2f}",
               f"{rate:.0f}"])
  title = (f"the layer-wise partitioning paper's DNN (7 x {FLAGS.width} sigmoid), batch {FLAGS.batch_size}, 2 logical "
           f"CPUs on this machine's cores: T_calc {1e3 * t_calc:.1f} ms, T_comm "
           f"{1e3 * t_comm:.1f} ms (one copy of the weights), {1e3 * t_act:.2f} ms per batch "
           "of activations; speedup over one device")
  table = results_io.markdown_table(
      ["method", "predicted speedup", "measured speedup", "samples/s"], rows)
  results_io.report(FLAGS.results_dir, "speedup_model.md", title, table)
  os._exit(0)  # the cluster this process joined is gone; skip TensorFlow's teardown


if __name__ == "__main__":
  app.run(main)
