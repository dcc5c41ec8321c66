"""What bounds the compiled executor's start-up: each new window function pays again for the
stage functions it calls.

The compiled executor traces each stage task once, as a `tf.function` that a
window's graph calls (not inlined). TensorFlow still instantiates and
optimises (Grappler) the called functions once per *calling* function: each
distinct window (warm-up, steady state, drain) pays again for every stage
function it calls. This script measures that on a stage-like function
(`--layers` dense layers of `--width`, one device): the first call of a new
outer function that calls it, for the first outer function and for later ones,
with Grappler on (as the stage functions run) and off. A later outer function's
first call costing as much as the first one's is the per-window cost; the part
that Grappler off removes is the re-optimisation.

  python bench/window_bound.py [--layers=40 --width=256 --outers=4 --calls=2]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("layers", 40, "dense layers of the stage-like function")
flags.DEFINE_integer("width", 256, "their width")
flags.DEFINE_integer("outers", 4, "outer functions (windows) that call it, one after another")
flags.DEFINE_integer("calls", 2, "calls of the stage function in each outer function")
FLAGS = flags.FLAGS


def _measure(grappler):
  """[(trace s, first call s, second call s)] per outer function, in a fresh TensorFlow."""
  import tensorflow as tf
  from tfpipe import compat
  tf.config.threading.set_intra_op_parallelism_threads(1)
  if not grappler:
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
  weights = [tf.Variable(tf.random.normal([FLAGS.width, FLAGS.width]) * 0.05)
             for _ in range(FLAGS.layers)]

  @tf.function(autograph=False, experimental_attributes=compat.NOT_INLINED)
  def stage(x):
    for w in weights:
      x = tf.nn.relu(tf.matmul(x, w)) + 0.1 * tf.sin(x)
    return x

  def outer_function(calls):
    @tf.function(autograph=False)
    def outer(x):
      for _ in range(calls):
        x = stage(x)
      return x
    return outer

  x = tf.random.normal([8, FLAGS.width])
  rows = []
  for i in range(FLAGS.outers):
    outer = outer_function(FLAGS.calls + i)   # each a distinct graph, as windows are
    start = time.perf_counter()
    outer.get_concrete_function(x)
    traced = time.perf_counter()
    outer(x)
    first = time.perf_counter()
    outer(x)
    rows.append((traced - start, first - traced, time.perf_counter() - first))
  return rows


def main(argv):
  del argv
  from bench import results_io
  # Each mode in a TensorFlow of its own (Grappler's setting is process-wide).
  results = {mode: results_io.in_child(_measure, mode == "on") for mode in ("on", "off")}
  rows = []
  for i in range(FLAGS.outers):
    on, off = results["on"][i], results["off"][i]
    rows.append([i + 1, f"{1000 * on[0]:.0f}", f"{1000 * on[1]:.0f}", f"{1000 * off[1]:.0f}",
                 f"{1000 * (on[1] - off[1]):.0f}", f"{1000 * on[2]:.1f}"])
  print(f"A stage function of {FLAGS.layers} x Dense({FLAGS.width}) called from "
        f"{FLAGS.outers} outer functions in turn (ms):")
  print(results_io.markdown_table(
      ["outer function", "trace", "first call, Grappler on", "first call, Grappler off",
       "re-optimisation", "second call"], rows))
  later = [r[1] for r in results["on"][1:]]
  if later:
    print(f"Later outer functions' first calls: {1000 * min(later):.0f}-{1000 * max(later):.0f}"
          f" ms, the first outer function's {1000 * results['on'][0][1]:.0f} ms: the called "
          "function is instantiated and optimised again for each caller.")


if __name__ == "__main__":
  app.run(main)
