"""Data parallel or pipeline on H emulated hosts: each layout's samples/s predicted beside measured.

For each workload and link rate, H hosts (network namespaces, each TF server
pinned to a core of its own where the machine has one per host) joined by
links the kernel's traffic control caps (`tfpipe.cluster.EmulatedCluster`;
root only). A program on the client host runs `tfpipe.choose_layout` (it
probes the links, profiles the model's stages on the first host and predicts
each layout's samples/s with the simulator), then trains every layout it
ranked (R replicas of a K-stage 1f1b pipeline, R x K = H; gradients summed by a
ring) and measures its samples/s and the bytes each host sends per step, in
the last epoch's steady state (between its windows' ends, from the links'
counters). The table gives, per link, the probed link, each layout's
prediction and measurement, the prediction's error, the layout chosen and the
one measured fastest.

  python bench/layouts.py [--workloads=fcn,transformer --hosts=2
                           --links=10gbit,1gbit,100mbit --steps=8]
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import results_io  # noqa: E402

# name: (model, its options, input shape, classes, global batch); the links benchmark's
# shapes (bench/links.py): the SpecTrain paper's FCN at depth 6 and its transformer.
WORKLOADS = {
    "fcn": ("snn", {"depth": 6}, (28, 28, 1), 10, 256),
    "transformer": ("transformer", {"vocab_size": 20000}, (20,), 2, 64),
}

flags.DEFINE_list("workloads", ["fcn", "transformer"], f"of {', '.join(WORKLOADS)}")
flags.DEFINE_list("hosts", ["2"], "host counts")
flags.DEFINE_list("links", ["10gbit", "1gbit", "100mbit"], "link rates")
flags.DEFINE_integer("steps", 8, "mini-batches per epoch (two epochs; the second is measured)")
flags.DEFINE_integer("steps_per_execution", 2, "mini-batches per window")
flags.DEFINE_integer("timeout", 1800, "seconds one workload at one link may take")
flags.DEFINE_string("results_dir", results_io.RESULTS, "where the table goes")
flags.DEFINE_string("output", "layouts.md", "the table's file name in --results_dir")
FLAGS = flags.FLAGS


def measure(workload, spec, hub, steps, per_window):
  """On the client host (cluster `spec`, JSON; the links' namespace `hub`): the layouts
  chosen and measured."""
  import keras
  import numpy as np
  import tfpipe
  from tfpipe import models
  from tfpipe.cluster import emulation
  from tfpipe.instruments import traffic
  devices = tfpipe.cluster.connect(json.loads(spec))
  name, options, shape, classes, batch = WORKLOADS[workload]

  def make():
    keras.utils.set_random_seed(0)
    return models.build(name, shape, classes, **options)

  start = time.monotonic()
  choice = tfpipe.choose_layout(make(), devices, batch)
  chose_seconds = time.monotonic() - start
  rng = np.random.default_rng(0)
  n = batch * steps
  if len(shape) == 1:
    x = rng.integers(1, options["vocab_size"], (n,) + shape).astype("int32")
  else:
    x = rng.standard_normal((n,) + shape).astype("float32")
  y = rng.integers(0, classes, n)
  rows = []
  for row in choice.rows:
    layout = row.layout
    pipe = tfpipe.Pipeline(make(), **choice.pipeline_options(layout))
    pipe.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 steps_per_execution=per_window)
    ends = []

    class Clock(keras.callbacks.Callback):
      def on_epoch_begin(self, epoch, logs=None):
        ends.clear()

      def on_train_batch_end(self, step, logs=None):
        ends.append((step, time.perf_counter()))

    counter = traffic.LinkTraffic(lambda: emulation.hub_counters(hub))
    pipe.fit(x, y, batch_size=batch, epochs=2, verbose=0, shuffle=False,
             callbacks=[Clock(), counter])
    (a, t0), (b, t1) = ends[0], ends[-1]
    sent = [s for host, (s, _) in counter.per_step().items() if host != "client"]
    rows.append({"layout": layout.name, "predicted": row.samples_per_second,
                 "link_share": row.link_share, "predicted_sent": row.sent,
                 "measured": (b - a) * batch / (t1 - t0), "sent": max(sent)})
    del pipe
  return {"link": choice.link.describe(), "client": choice.client.describe(),
          "choose_seconds": chose_seconds, "rows": rows}


def run(workload, hosts, link):
  """One workload on `hosts` emulated hosts joined by `link`: `measure`'s result, or
  {"error": ...}."""
  import tfpipe
  cores = len(os.sched_getaffinity(0))
  cpus = [str(h % cores) for h in range(hosts)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tfpipe.cluster.EmulatedCluster({"worker": hosts}, link=link, cpus=cpus) as cluster:
    child = cluster.popen([sys.executable, os.path.abspath(__file__), "--inner",
                           cluster.client.netns, workload, json.dumps(cluster.spec),
                           cluster.network.hub, str(FLAGS.steps),
                           str(FLAGS.steps_per_execution)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
    try:
      out, err = child.communicate(timeout=FLAGS.timeout)
    except subprocess.TimeoutExpired:
      child.kill()
      return {"error": f"over {FLAGS.timeout} s"}
  if child.returncode != 0:
    return {"error": (err.strip().splitlines() or ["?"])[-1][:200]}
  return json.loads(out.strip().splitlines()[-1])


def main(argv):
  del argv
  head = ["link", "workload", "hosts", "probed", "layout", "predicted samples/s",
          "measured samples/s", "predicted / measured", "predicted share on links",
          "MB sent per step, busiest host: predicted / measured", "chosen", "measured fastest"]
  table = []
  for workload in FLAGS.workloads:
    for hosts in (int(h) for h in FLAGS.hosts):
      for link in FLAGS.links:
        got = run(workload, hosts, link)
        print(f"{workload} {hosts} hosts {link}: {got}", flush=True)
        if "error" in got:
          table.append([link, workload, hosts, "", "error: " + got["error"]] + [""] * 7)
          continue
        fastest = max(got["rows"], key=lambda r: r["measured"])["layout"]
        for i, r in enumerate(got["rows"]):
          table.append([link, workload, hosts, got["link"], r["layout"],
                        f"{r['predicted']:.0f}", f"{r['measured']:.0f}",
                        f"{r['predicted'] / r['measured']:.2f}", f"{r['link_share']:.0%}",
                        f"{r['predicted_sent'] / 1e6:.1f} / {r['sent'] / 1e6:.1f}",
                        "chosen" if i == 0 else "", "yes" if r["layout"] == fastest else ""])
  command = "python bench/layouts.py " + " ".join(
      f"--{name}={','.join(getattr(FLAGS, name))}" for name in ("workloads", "hosts", "links")
  ) + f" --steps={FLAGS.steps} --steps_per_execution={FLAGS.steps_per_execution}"
  title = ("# Data parallel or pipeline: each layout predicted beside measured on emulated "
           "hosts\n\n"
           f"`{command}` (each host a network namespace with one TF server on a core of its "
           "own; `tfpipe.choose_layout` probes the links and profiles the stages on the first "
           "host, the simulator predicts; each layout then trains two epochs, its samples/s "
           "and bytes taken between the second epoch's window ends; 1f1b, gradients summed "
           "by a ring)")
  results_io.report(FLAGS.results_dir, FLAGS.output, title,
                    results_io.markdown_table(head, table))


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--inner":
    netns, workload, spec, hub, steps, per_window = sys.argv[2:8]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfpipe.cluster import emulation
    emulation.enter(netns)   # before TensorFlow starts a thread
    print(json.dumps(measure(workload, spec, hub, int(steps), int(per_window))), flush=True)
    os._exit(0)
  app.run(main)
