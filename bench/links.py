"""Where pipelining pays: bytes on the wire and samples/s on emulated hosts with real links.

Each run is the trainer as a user starts it (`python -m trainers.main` in a
process of its own) with `--cluster=emulated:R,K,LINK`: every TF server on a
host of its own (a network namespace), the hosts joined by veth links whose
rate the kernel's traffic control caps (tfpipe.cluster.emulation; root only).
For each workload, link rate and host count it runs data parallelism across
hosts (MultiWorkerMirroredStrategy, collective all-reduce), asynchronous SGD on
parameter servers (one parameter server, the other hosts workers), and the
1f1b and spectrain pipelines (one stage per host), and reads from the links'
counters the bytes the hosts sent per mini-batch (the same global batch for
each), and samples/s of the second epoch. The table's first column is the
link, so the crossover (where the pipeline overtakes data parallelism) reads
down a column; the ratio column is data parallel / pipeline (1f1b) bytes, to
set beside the SpecTrain paper's 13.4x (its figure 3).

  python bench/links.py [--workloads=fcn,vgg16,transformer,residual_lstm,llama --hosts=2,4
                         --links=10gbit,1gbit,100mbit --steps=8]
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from bench import results_io  # noqa: E402

# The paper's workloads that fit this machine, on offline data of their shapes.
WORKLOADS = {
    "fcn": ["--flagfile=configs/snn_spectrain.cfg", "--snn_depth=6", "--dataset=synthetic",
            "--synthetic_shape=28,28,1", "--batch_size=256"],
    "vgg16": ["--flagfile=configs/vgg16_spectrain.cfg", "--dataset=synthetic",
              "--synthetic_shape=32,32,3"],
    "transformer": ["--flagfile=configs/transformer_spectrain.cfg", "--dataset=synthetic_text"],
    "residual_lstm": ["--flagfile=configs/residual_lstm_spectrain.cfg",
                      "--dataset=synthetic_text"],
    # A KerasHub Llama from config (4 layers of width 256), per token on offline text; AdamW
    # without global clipping, which the asynchronous methods cannot apply.
    "llama": ["--model=llama", "--model_scale=4", "--dataset=grammar_text",
              "--sequence_length=64", "--batch_size=32", "--optimizer=adamw",
              "--learning_rate=1e-3", "--throughput_window="],
}
METHODS = ("dataparallel", "asgd", "1f1b", "spectrain", "1f1b_x2_ring", "1f1b_x2_reduce")
# Data parallel x pipeline: 2 replicas of hosts/2 stages; the replicas' gradients summed by a
# ring (each replica its own weights) or at replica 0 (its host sends the weights out).
REPLICATED = {"1f1b_x2_ring": "ring", "1f1b_x2_reduce": "reduce_to_one_device"}

flags.DEFINE_list("workloads", ["fcn"], f"of {', '.join(WORKLOADS)}")
flags.DEFINE_list("hosts", ["2"], "host counts")
flags.DEFINE_list("links", ["10gbit", "1gbit", "100mbit"], "link shapes, RATE[,DELAY[,LOSS%]]")
flags.DEFINE_list("methods", list(METHODS), f"of {', '.join(METHODS)}")
flags.DEFINE_integer("steps", 8, "mini-batches per epoch (two epochs: the second is timed)")
flags.DEFINE_integer("asgd_steps", 16, "--steps for asgd: its workers run steps at once, so its "
                     "bytes per step are counted over more of them")
flags.DEFINE_bool("transfer_share", True, "trace every host over one more epoch (the trainer's "
                  "--transfer_share): the busiest host's share of time waiting on transfers")
flags.DEFINE_integer("timeout", 900, "seconds one run may take")
flags.DEFINE_string("results_dir", results_io.RESULTS, "where the table goes")
flags.DEFINE_string("output", "links.md", "the table's file name in --results_dir")
flags.DEFINE_string("runs", "links_runs.jsonl", "each run's result, one JSON line, in --results_dir")
flags.DEFINE_bool("resume", False, "keep the runs --runs holds (errors run again) and run the rest")
flags.DEFINE_bool("table_only", False, "run nothing: the table of the runs --runs holds")
flags.DEFINE_list("rerun", [], "with --resume: methods to run again though --runs holds them")
FLAGS = flags.FLAGS


def cluster_flags(method, hosts, link):
  """The trainer's flags that place `method` on `hosts` emulated hosts."""
  if method in REPLICATED:
    return [f"--cluster=emulated:2,{hosts // 2},{link}", f"--num_stages={hosts // 2}",
            "--data_parallel=2", f"--cross_device_ops={REPLICATED[method]}",
            "--partition=uniform", "--method=1f1b"]
  if method == "dataparallel":
    return [f"--cluster=emulated:{hosts},1,{link}"]
  if method == "asgd":
    return [f"--cluster=emulated:{hosts - 1},1,{link}"]
  return [f"--cluster=emulated:1,{hosts},{link}", f"--num_stages={hosts}",
          "--partition=uniform"]


def batch_size(workload):
  """The global batch `workload`'s flags (or its flag file) give."""
  for flag in WORKLOADS[workload]:
    if flag.startswith("--batch_size="):
      return int(flag.split("=", 1)[1])
  for flag in WORKLOADS[workload]:
    if flag.startswith("--flagfile="):
      with open(os.path.join(ROOT, flag.split("=", 1)[1])) as f:
        for line in f:
          if line.startswith("--batch_size="):
            return int(line.split("=", 1)[1])
  raise ValueError(f"no --batch_size for workload {workload!r}")


def run(workload, method, hosts, link):
  """{"samples/s", "sent" (MB per step, all hosts), "max_host" (MB per step, the busiest)} of
  one trainer run, or {"error": ...}."""
  argv = [sys.executable, "-m", "trainers.main", *WORKLOADS[workload],
          f"--method={'1f1b' if method in REPLICATED else method}",
          "--epochs=2", f"--steps={FLAGS.asgd_steps if method == 'asgd' else FLAGS.steps}",
          "--logdir=", "--verbose=2", *(["--transfer_share"] if FLAGS.transfer_share else []),
          *[f for f in cluster_flags(method, hosts, link) if not f.startswith("--method=")]]
  start = time.monotonic()
  try:
    result = run_child(argv, FLAGS.timeout)
  except subprocess.TimeoutExpired:   # killed; its hosts are removed at the next start
    return {"error": f"timed out after {FLAGS.timeout} s (--timeout)"}
  if result.returncode != 0:
    lines = result.stderr.strip().splitlines() or ["?"]
    said = [line for line in lines if line.startswith("error:")]   # the trainer's own line
    return {"error": (said or lines)[-1][:200]}
  return dict(parse(result.stdout, batch_size(workload), _rate(link)),
              seconds=time.monotonic() - start)


def run_child(argv, timeout):
  """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout)` in the
  repository, save that a SIGTERM to this process goes to the child too: the trainer then
  removes its emulated hosts and exits, and this process exits (143) once it has, so that
  stopping the benchmark leaves no trainer running. Past `timeout` the child is killed
  (SIGKILL) and TimeoutExpired raised."""
  child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT)
  stopped = []

  def stop(signum, _):
    stopped.append(signum)
    child.send_signal(signum)

  previous = signal.signal(signal.SIGTERM, stop)
  try:
    out, err = child.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    child.kill()
    child.communicate()
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
  if stopped:
    sys.exit(128 + stopped[0])
  return subprocess.CompletedProcess(argv, child.returncode, out, err)


def parse(out, batch, rate):
  """{"samples/s", "busy", "sent", "max_host", "whole_fit"} of a trainer's output, for a global
  batch of `batch` on links of `rate` bits/s: "busy" is the busiest host's busier direction,
  its bytes per step at the link's rate, as a share of the step."""
  speed = re.search(r"^samples/s, whole last epoch\s+([\d.]+)", out, re.M)
  line = re.search(r"^bytes on the links per step.*$", out, re.M)
  moved = [(float(a), float(b)) for a, b in
           re.findall(r"(?:worker|ps)/\d+ ([\d.e+-]+)/([\d.e+-]+)", line.group(0))]
  hosts_sent = [sent for sent, _ in moved]
  samples = float(speed.group(1)) if speed else None
  busy = (max(max(pair) for pair in moved) * 8e6 / rate) / (batch / samples) if samples else None
  traced = re.search(r"^time on each host.*$", out, re.M)
  waiting = ([float(w) / 100 for w in re.findall(r"waiting on transfers ([\d.e+-]+)%",
                                                 traced.group(0).split("):", 1)[-1])]
             if traced else [])
  untraced = re.search(r"^time on each host: not traced \((.*)\)$", out, re.M)
  return {"samples/s": samples, "busy": busy, "sent": sum(hosts_sent), "max_host": max(hosts_sent),
          "whole_fit": "over the whole fit" in line.group(0),
          **({"waiting": max(waiting)} if waiting else {}),
          **({"untraced": untraced.group(1)} if untraced else {})}


def main(argv):
  del argv
  runs = os.path.join(FLAGS.results_dir, FLAGS.runs)
  done = _read_runs(runs) if FLAGS.resume or FLAGS.table_only else {}
  if FLAGS.table_only:
    return write_table(done)
  if not FLAGS.resume and os.path.exists(runs):
    os.remove(runs)
  for workload in FLAGS.workloads:
    for hosts in (int(h) for h in FLAGS.hosts):
      for link in FLAGS.links:
        for method in FLAGS.methods:
          key = (workload, hosts, link, method)
          if key in done and "error" not in done[key] and method not in FLAGS.rerun:
            continue
          done[key] = run(workload, method, hosts, link)
          print(f"{workload} {hosts} hosts {link} {method}: {done[key]}", flush=True)
          with open(runs, "a") as f:
            f.write(json.dumps({"key": key, "result": done[key]}) + "\n")
  write_table(done)


def _read_runs(path):
  """{(workload, hosts, link, method): result} of the runs `path` holds (the last of each)."""
  done = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        record = json.loads(line)
        done[tuple(record["key"])] = record["result"]
  return done


def _cell(r):
  if r is None:
    return "not run"
  if "error" in r:
    return "error: " + r["error"]
  return (f"{r['samples/s']:.3g} /s, {r['sent']:.3g} MB" + ("*" if r["whole_fit"] else "")
          + f", link {100 * r['busy']:.0f}%"
          + (f", waiting {100 * r['waiting']:.2g}%" if "waiting" in r else "")
          + (", waiting not traced†" if "untraced" in r else ""))


def write_table(done):
  """The table of the runs `done` holds for the flags' workloads, hosts, links and methods."""
  rows = []
  for workload in FLAGS.workloads:
    for hosts in (int(h) for h in FLAGS.hosts):
      for link in FLAGS.links:
        got = {m: done.get((workload, hosts, link, m)) for m in FLAGS.methods}
        dp, pp = got.get("dataparallel") or {}, got.get("1f1b") or {}
        ratio = (f"{dp['sent'] / pp['sent']:.1f}x" if "sent" in dp and "sent" in pp
                 and pp["sent"] else "")
        faster = (f"{pp['samples/s'] / dp['samples/s']:.2f}" if dp.get("samples/s")
                  and pp.get("samples/s") else "")
        rows.append([link, workload, hosts] + [_cell(got[m]) for m in FLAGS.methods]
                    + [ratio, faster])
  head = (["link", "workload", "hosts"] + [f"{m}: samples/s, MB sent per step, link busy, "
                                           "waiting on transfers" for m in FLAGS.methods]
          + ["bytes dataparallel / 1f1b", "samples/s 1f1b / dataparallel"])
  command = "python bench/links.py " + " ".join(
      f"--{name}={','.join(getattr(FLAGS, name))}" for name in ("workloads", "hosts", "links",
                                                                "methods")) + (
      f" --steps={FLAGS.steps}") + (
      f" --asgd_steps={FLAGS.asgd_steps}" if "asgd" in FLAGS.methods else "") + (
      f" --output={FLAGS.output}" if FLAGS.output != "links.md" else "")
  title = ("# Bytes on the wire and samples/s on emulated hosts\n\n"
           f"`{command}` (each run the trainer with `--cluster=emulated:...`; MB sent per "
           "mini-batch by all hosts together, read from the links' counters, the client's "
           "own link not counted; samples/s of the second epoch; link busy: the busiest host's "
           "busier direction, its bytes per step at the link's rate as a share of the step, "
           "near 100%: the link bounds the run; read from the counters; waiting on transfers: "
           "from a trace of every host's server over one more epoch, the busiest host's share "
           "of time with a receive or all-reduce pending and nothing to compute, which counts "
           "a peer still computing too; runs before the trace have none). * the "
           "run's epochs were one window of steps each, so its bytes are the whole fit's per "
           "step: the weights sent out at the start and written back to the client at its end "
           "included. † the trainer's trace of the hosts failed (why: `untraced` in "
           f"{FLAGS.runs})")
  rows.sort(key=lambda r: (r[1], r[2], -_rate(r[0])))
  results_io.report(FLAGS.results_dir, FLAGS.output, title, results_io.markdown_table(head, rows))


def _rate(link):
  from tfpipe.cluster import links
  return links.parse(link).rate


if __name__ == "__main__":
  app.run(main)
