"""The synchronous schedules side by side: GPipe, 1F1B with a flush, interleaved 1F1B, ZB-H1, ZB-V.

Trains one MLP (default 8 x 512 SELU on synthetic data, batch 256) with each
schedule at K stages and M micro-batches (default 4 and 8) on K logical CPUs
(one intra-op thread each; interleaved: V x K stages, V per device; zbv: 2K stages in a V),
compiled executor, and
prints per schedule:
  kept:      the most micro-batches of activations each stage kept at once
             (measured by the runtime), beside the verifier's count;
  bubble:    1 - compute share of the stages' time, from the recorded timeline
             (`Pipeline.breakdown`) of the last epoch;
  simulated: the simulator's bubble and samples/s for the same schedule from the
             stage times recorded in that run (`simulator.costs_from_records`) on
             the cores the profile measured the stages to share, and its error
             against the measured samples/s;
  profiled:  the simulator's samples/s from a short profile of the stages
             (`tfpipe.instruments.costs`), and its error;
  cores:     how many cores the profile measured the stages to keep busy at once (both
             predictions divide the work by it);
  closed:    the closed form with unit F, B, W: (K-1)/(M+K-1) for GPipe and 1F1B,
             (K-1)/(VM+K-1) for interleaved, (K-1)/(3M+K-1) for ZB-H1 (ZB-V: none;
             its order is found by list scheduling, `schedules.zero_bubble_v`);
  samples/s: of an unrecorded run (the median of its epochs after the first), and
             its ratio to GPipe's.
All equal plain Keras at the mini-batch size (tests/test_sync_schedules.py). With
more stages than cores (4 stages on this 2-core machine) the stages share cores: the
measured bubble then mixes schedule idling with waiting for a core.

  python bench/sync_schedules.py [--stages=4 --micro_batches=8 --epochs=5]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402

flags.DEFINE_list("methods", ["gpipe", "1f1b", "interleaved", "zb", "zbv"],
                  "synchronous pipeline methods")
flags.DEFINE_integer("stages", 4, "K (devices)")
flags.DEFINE_integer("virtual_stages", 2, "V, stages per device for interleaved")
common.define(micro_batches=8, width=512, depth=8, batch_size=256, batches=16)
flags.DEFINE_integer("epochs", 5, "epochs per run (the first traces)")
flags.DEFINE_string("results_dir", None, "where the table goes (sync_schedules.md); default "
                    "bench/results")
FLAGS = flags.FLAGS


def _closed_form(method, K, M, V):
  if method == "zbv":
    return float("nan")
  return (K - 1) / ({"zb": 3 * M, "interleaved": V * M}.get(method, M) + K - 1)


def main(argv):
  del argv
  import tfpipe
  tfpipe.devices.ensure_logical_cpus(FLAGS.stages, intra_op_threads=1)
  import keras
  from tfpipe.models import mlp
  from tfpipe.instruments import costs as costs_lib
  from tfpipe.plan import policies, simulator, verify

  K, M, V, bs = FLAGS.stages, FLAGS.micro_batches, FLAGS.virtual_stages, FLAGS.batch_size
  rng = np.random.default_rng(0)
  n = bs * FLAGS.batches
  x, y = rng.standard_normal((n, 64)).astype("float32"), rng.integers(0, 10, n)

  def train(method, record):
    keras.utils.set_random_seed(0)
    chunks = {"virtual_stages": V} if method == "interleaved" else {}
    pipe = tfpipe.Pipeline(mlp.snn((64,), 10, width=FLAGS.width, depth=FLAGS.depth),
                           num_stages=K, method=method, micro_batches=M, record=record,
                           **chunks)
    pipe.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # The collection the first epoch's tracing makes due (~0.2 s here) would land in the
    # second epoch, one of those measured: made between the epochs, outside their time.
    collect = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: gc.collect() if epoch == 0 else None)
    history = pipe.fit(x, y, batch_size=bs, epochs=FLAGS.epochs, verbose=0, shuffle=False,
                       callbacks=[collect])
    return pipe, history.history["samples_per_second"]

  rows, rates = [], {}
  for method in FLAGS.methods:
    policy = policies.policy_for(method, virtual_stages=V if method == "interleaved" else None)
    S = K * policy.virtual_stages   # stages
    paper = verify.verify(policies.build_schedule(policy, S, 2, M)).peak_states
    pipe, rate = train(method, record=False)
    rates[method] = statistics.median(rate[1:])
    kept = list(pipe.runtime.peak_saved)
    profiled = costs_lib.measure(pipe, x[:bs], y[:bs])
    from_profile = costs_lib.predict(profiled, method, bs, M, FLAGS.batches,
                                     policy.virtual_stages if S > K else None)
    recorded, _ = train(method, record=True)
    shares = recorded.breakdown(steps=f"{(FLAGS.epochs - 1) * FLAGS.batches},"
                                      f"{FLAGS.epochs * FLAGS.batches - 1}")
    # per device: its stages' compute shares add up (they run one at a time)
    bubble = 1.0 - sum(s["compute"] for s in shares.shares) / K
    last_epoch = [r for r in recorded.records if r.epoch == FLAGS.epochs - 1]
    # The recorded tasks' own times, on the cores the profile saw the stages share.
    costs = dataclasses.replace(
        simulator.costs_from_records(last_epoch, S, M, recompute=policy.recompute),
        cores=profiled.cores, ordered=profiled.ordered)
    sim = simulator.simulate_method(method, costs, FLAGS.batches, micro_batches=M,
                                    virtual_stages=policy.virtual_stages if S > K else None)
    predicted = sim.samples_per_second(bs)
    rows.append((method, kept, paper, bubble, sim.bubble, _closed_form(method, K, M, V),
                 rates[method], predicted, from_profile, profiled.cores))
    print(f"{method}: done ({rates[method]:.0f} samples/s)", flush=True)

  print(f"\nsnn {FLAGS.depth} x {FLAGS.width}, batch {bs}, K={K}, M={M}, V={V}, "
        f"{FLAGS.batches} mini-batches per epoch, compiled executor")
  head = (f"{'method':<12}{'kept per stage (run / verifier)':<40}{'bubble':>8}{'simulated':>10}"
          f"{'closed':>8}{'samples/s':>11}{'x gpipe':>9}{'sim err':>9}{'profiled':>10}"
          f"{'err':>6}{'cores':>7}")
  print(head)
  table = []
  for (method, kept, paper, bubble, sim_bubble, closed, rate, predicted, from_profile,
       cores) in rows:
    base = rates.get("gpipe")
    ratio = f"{rate / base:.2f}" if base else "-"
    kept_text = " ".join(map(str, kept)) + " / " + " ".join(map(str, paper))
    print(f"{method:<12}{kept_text:<40}{bubble:>8.3f}{sim_bubble:>10.3f}{closed:>8.3f}"
          f"{rate:>11.0f}{ratio:>9}{predicted / rate - 1:>+9.0%}{from_profile:>10.0f}"
          f"{from_profile / rate - 1:>+6.0%}{cores:>7.2f}")
    table.append([method, kept_text, f"{bubble:.3f}", f"{sim_bubble:.3f}",
                  "-" if np.isnan(closed) else f"{closed:.3f}", f"{rate:.0f}", ratio,
                  f"{predicted:.0f} ({predicted / rate - 1:+.0%})",
                  f"{from_profile:.0f} ({from_profile / rate - 1:+.0%})", f"{cores:.2f}"])
  from bench import results_io
  results_io.write(FLAGS.results_dir or results_io.RESULTS, "sync_schedules.md", (
      f"# The synchronous schedules side by side\n\n`python bench/sync_schedules.py "
      f"--stages={K} --micro_batches={M}`: SNN {FLAGS.depth} x {FLAGS.width}, batch {bs}, "
      f"V={V}, {FLAGS.batches} mini-batches an epoch, compiled executor, K logical CPUs of "
      "this machine's cores. Bubble: measured from the recorded timeline, and simulated from "
      "the recorded tasks' times on the cores the profile measured; samples/s of an "
      "unrecorded run; predicted samples/s (error) from the recorded tasks and from a short "
      "profile; the cores the profile measured the stages to keep busy at once (both "
      "predictions scale with it).\n\n" + results_io.markdown_table(
          ["method", "kept per stage (run / verifier)", "bubble", "simulated bubble",
           "closed form", "samples/s", "x gpipe", "simulated from the records",
           "from a profile", "profile cores"], table)))


if __name__ == "__main__":
  app.run(main)
