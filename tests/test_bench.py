"""The report scripts run end to end at a tiny size and write their tables."""

import math
import os
import signal
import time

from tests import zygote


def _bench(script, *args):
  """`python bench/SCRIPT ARGS` as a process of its own (a fork of `tests.zygote`)."""
  result = zygote.run([os.path.join("bench", script), *args])
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_accuracy_table(tmp_path):
  out = _bench("accuracy_table.py", "--epochs=1", "--methods=single,gpipe", "--model_scale=0.1",
               "--batch_size=128",
               f"--results_dir={tmp_path}", "--workloads=snn:digits,vgg16:cifar10",
               "--data_dir=" + str(tmp_path / "no_data"))
  assert "| gpipe |" in out and "vgg16:cifar10: skipped, the data is not here" in out
  assert (tmp_path / "accuracy_snn_digits.png").stat().st_size > 1000
  assert "max validation accuracy" in (tmp_path / "accuracy_snn_digits.md").read_text()


def test_throughput_table(tmp_path):
  out = _bench("throughput_table.py", "--methods=pipedream", "--stages=2", "--steps=12",
               "--window=2,11", "--width=32", "--depth=2", f"--results_dir={tmp_path}")
  table = (tmp_path / "throughput.md").read_text()
  assert "| pipedream | 2 |" in table and "| dataparallel | 2 |" in table and "/ single" in out


def test_memory_table(tmp_path):
  _bench("memory_table.py", "--methods=pipedream,vanilla", "--num_stages=2", "--steps=4",
         "--width=32", "--depth=2", f"--results_dir={tmp_path}")
  table = (tmp_path / "memory.md").read_text()
  assert "| pipedream | 0 |" in table and "| vanilla | 0 |" in table


def test_grid_parallel(tmp_path):
  _bench("grid_parallel.py", "--width=16", "--steps=7", "--batch_size=8", "--devices=4",
         "--workloads=snn", f"--results_dir={tmp_path}")
  table = (tmp_path / "grid.md").read_text()
  for grid in ("| single | 1x1 |", "| batch only | 4x1 |", "| model only | 1x4 |", "| grid | 2x2 |"):
    assert "| snn 8 x 16 " + grid in table
  assert "dnn" not in table


def test_steady_state(tmp_path):
  out = _bench("steady_state.py", "--layers=1", "--stages=2", "--epochs=2",
               "--methods=spectrain", "--variants=calls", f"--results_dir={tmp_path}")
  table = (tmp_path / "steady_state.md").read_text()
  assert "| keras fit | calls | 1 |" in table and "| spectrain | calls | 1 |" in table
  # Keras on its input without tf.data's autotuning too (no pause as an iterator is deleted).
  assert "| keras fit | no pause | 1 |" in table and "| x Keras without its pause |" in table
  assert "over" not in table and "spectrain | calls" in out
  assert "| CPU s/epoch | cores busy |" in table
  row = next(l for l in table.splitlines() if l.startswith("| spectrain | calls"))
  cpu, busy = (float(c) for c in row.strip(" |").split(" | ")[-2:])
  assert cpu > 0 and 0 < busy <= 2 * os.cpu_count()


def test_speedup_model(tmp_path):
  _bench("speedup_model.py", "--width=16", "--steps=8", "--batch_size=16",
         f"--results_dir={tmp_path}")
  table = (tmp_path / "speedup_model.md").read_text()
  for row in ("| data parallel (MirroredStrategy), P=2 |", "| layer-wise pipeline (pipedream), K=2 |",
              "| ASGD, 2 workers + 1 parameter server |"):
    assert row in table


def test_staleness_advice_ranks_by_the_worst_gap_and_checks_held_out_tasks():
  from bench import staleness_advice
  def run(option, task, lr, accuracy, K=4):
    return {"option": option, "task": task, "learning_rate": lr, "K": K, "seed": 0,
            "val_accuracy": [accuracy / 100]}
  runs = [run("single", t, lr, 70.0) for t in ("a", "b", "c") for lr in (0.1, 0.05)]
  # steady: -1 everywhere; spiky: +2 on average on a and b but -5 once.
  runs += [run("steady", t, lr, 69.0) for t in ("a", "b", "c") for lr in (0.1, 0.05)]
  runs += [run("spiky", "a", 0.1, 75.0), run("spiky", "a", 0.05, 65.0),
           run("spiky", "b", 0.1, 74.0), run("spiky", "b", 0.05, 74.0),
           run("spiky", "c", 0.1, 60.0), run("spiky", "c", 0.05, 71.0)]
  runs += [run("partial", "a", 0.1, 80.0)]   # not run at every setting: not ranked
  ranked = staleness_advice.rank(staleness_advice.gaps(runs, 4), ["a", "b"])["sgd"]
  assert [o for o, _, _ in ranked] == ["steady", "spiky"]
  assert ranked[1][1:] == (-5.0, ("a", 0.05))
  lines = staleness_advice.advice_lines(runs, 4, ["a", "b"], ["c"])
  assert "chosen on a, b: `steady`** (worst gap -1.00 pp, at a lr 0.1)" in lines[0]
  assert "held out (c): worst gap -1.00 pp" in lines[1] and "`steady` -1.00 pp" in lines[1]


def test_staleness(tmp_path):
  args = ["--epochs=1", "--batch_size=2048", "--options=single,2bw", "--stages=2",
          "--seeds=0", "--tasks=teacher,classes", "--choose_on=teacher",
          "--learning_rate_index=0", f"--results_dir={tmp_path}"]
  out = _bench("staleness.py", *args)
  table = (tmp_path / "staleness.md").read_text()
  assert "| 2bw |" in table and "| single |" in table and "[1]" in table
  assert (tmp_path / "staleness_teacher.png").stat().st_size > 1000
  # The advice: ranked on teacher by the worst gap, then held out on classes.
  assert "chosen on teacher" in table and "held out (classes): worst gap" in table
  runs = (tmp_path / "staleness_runs.jsonl").read_text().splitlines()
  assert len(runs) == 4   # 2 options x 2 tasks at the first learning rate, a line each
  assert all("\"learning_rate\": 0.1," in run for run in runs)
  out = _bench("staleness.py", *args)   # resumes: every run is on file, none repeats
  assert "seed=" not in out and (tmp_path / "staleness_runs.jsonl").read_text().splitlines() == runs
  # A report of fewer options, K or tasks still shows every row, K and task on file.
  _bench("staleness.py", "--report_only", "--options=single", "--stages=4", "--tasks=teacher",
         *args[:2], f"--results_dir={tmp_path}")
  table = (tmp_path / "staleness.md").read_text()
  assert "| 2bw |" in table and "## classes" in table
  assert "K=2: best val. accuracy" in table and "K=4: best val. accuracy" in table


def test_sync_schedules(tmp_path):
  out = _bench("sync_schedules.py", "--stages=2", "--micro_batches=4", "--batches=3",
               "--epochs=2", "--width=16", "--depth=3", "--batch_size=16",
               f"--results_dir={tmp_path}")
  table = (tmp_path / "sync_schedules.md").read_text()
  assert all(f"| {m} | " in table for m in ("gpipe", "1f1b", "interleaved", "zb", "zbv"))
  methods = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
  rows = {line.split()[0]: line.split() for line in out.splitlines()
          if line.split() and line.split()[0] in methods}
  assert set(rows) == set(methods)
  # kept micro-batches at stage 0, measured / verified: gpipe M, 1f1b min(K, M), zb min(K, M)
  assert (rows["gpipe"][1], rows["1f1b"][1], rows["zb"][1]) == ("4", "2", "2")
  assert rows["interleaved"].index("/") == 5   # 4 stages on 2 devices
  for row in rows.values():   # every stage, the last's step included, kept what was verified
    n = row.index("/")
    assert row[1:n] == row[n + 1:2 * n]
  assert rows["gpipe"][-5] == "1.00"   # samples/s x gpipe


def test_data_parallel_pipeline():
  out = _bench("data_parallel_pipeline.py", "--batches=3", "--epochs=2", "--width=16",
               "--depth=2", "--batch_size=16", "--micro_batches=2")
  rows = [line for line in out.splitlines() if line.startswith(("R=", "MirroredStrategy"))]
  assert [r.split()[0] for r in rows[-3:]] == ["R=2", "R=1", "MirroredStrategy"]
  assert rows[-2].split()[-1] == "1.00"


def test_window_bound():
  out = _bench("window_bound.py", "--layers=3", "--width=8", "--outers=3", "--calls=1")
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
  assert [r[0].strip() for r in rows[1:]] == ["1", "2", "3"]   # one row per outer function
  assert all(float(cell) >= 0 for r in rows[1:] for cell in r[1:4] + r[5:])
  assert "Later outer functions' first calls:" in out


def test_startup():
  # Keras and one method, each in a process of its own (what the script measures per row),
  # at the micro-batches asked (gpipe's own default is 4); the row names them.
  out = _bench("startup.py", "--models=mlp", "--stages=2", "--methods=gpipe", "--windows=auto",
               "--micro_batches=2")
  assert "mlp: Keras fit first-epoch extra" in out
  row = next(line for line in out.splitlines() if line.startswith("| gpipe (M=2) | 2 |"))
  extra, ratio, second = (float(cell) for cell in row.split("|")[3:6])
  assert extra >= 0 and ratio >= 0 and second > 0


def test_device_targets(tmp_path):
  # No GPU here: that part's rows name why; the CPU part runs Keras with all cores and with
  # one stage's (the bound), one method in both pools, one more (M=K) in the shared pool.
  out = _bench("device_targets.py", "--parts=gpu,cpu", "--methods=pipedream",
               "--cpu_methods=1f1b", "--cores=2", "--cpu_stages=2", "--cpu_width=32",
               "--cpu_depth=2", "--cpu_batches=4", "--rounds=1", f"--results_dir={tmp_path}")
  assert "Keras fit failed: RuntimeError: no GPU" in out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
  assert [row[0].strip() for row in rows[1:]] == [
      "keras fit, 2 threads", "keras fit, 1 threads",
      "pipedream K=2, a pool of 1 threads per device",
      "pipedream K=2, one shared pool of 2 threads", "1f1b K=2 M=2, one shared pool of 2 threads"]
  # Marginal times at this size are noise (a row can come out negative): numbers, no sign.
  assert all(math.isfinite(float(cell)) for row in rows[1:] for cell in row[1:6])
  note = rows[2][6].strip()   # K stages at one stage's speed (the cells are rounded)
  assert note.startswith("bound for K=2: ") and note.endswith("x Keras")
  assert abs(float(note[len("bound for K=2: "):-len("x Keras")]) - 2 * float(rows[2][2])) <= 0.011
  assert (tmp_path / "device_targets.md").read_text().count("| pipedream K=2") == 2


_IN_CHILD = """
import os, time
from bench import results_io
parent = os.getpid()
print(results_io.in_child(lambda a: (a, os.getpid() != parent), 3))   # forked: another process
try:
  results_io.in_child(lambda: 1 / 0)
except results_io.ChildFailed as e:
  print("failed:", e)
try:
  results_io.in_child(time.sleep, 30, timeout=0.5)
except TimeoutError as e:
  print("timeout:", e)
"""


def test_in_child_returns_the_result_names_the_error_and_kills_past_its_timeout():
  import pytest
  from bench import results_io
  result = zygote.run(["-c", _IN_CHILD])
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == ["(3, True)", "failed: ZeroDivisionError: division by zero",
                                        "timeout: over 0.5 s"]
  # This process runs TensorFlow (conftest's devices): a fork would share that runtime.
  with pytest.raises(RuntimeError, match="has started TensorFlow's runtime"):
    results_io.in_child(abs, -1)


def test_lm():
  # One decoder layer, two mini-batches: a row per trainer, mixed_float16's loss scaling
  # trained by the synchronous schedule with clipping as Keras trains it.
  out = _bench("lm.py", "--layers=1", "--batches=2", "--epochs=1", "--stages=2",
               "--micro_batches=2", "--methods=1f1b", "--precisions=mixed_float16",
               "--vocabulary=64", "--sequence=8")
  for precision in ("mixed_float16",):
    keras_row = next(l for l in out.splitlines() if l.startswith(f"| {precision} | Keras fit |"))
    row = next(l for l in out.splitlines() if l.startswith(f"| {precision} | 1f1b K=2 M=2 |"))
    speed, ratio, loss = (float(cell) for cell in row.split("|")[3:6])
    assert speed > 0 and ratio > 0 and math.isfinite(loss)
    assert abs(loss - float(keras_row.split("|")[5])) < 0.05   # the same training


def test_predicted_speed(tmp_path):
  out = _bench("predicted_speed.py", "--models=mlp", "--stages=2", "--methods=1f1b,spectrain",
               "--epochs=2", "--mlp_batches=3", "--mlp_width=32", f"--results_dir={tmp_path}")
  table = (tmp_path / "predicted_speed.md").read_text()
  assert "| mlp | 2 | 1f1b | 4 |" in table and "| mlp | 2 | spectrain | 1 |" in table
  assert "Within 20%:" in table and "mlp 2 spectrain" in out


def _curve_run(task, option, K, seed, accuracies):
  return {"task": task, "option": option, "K": K, "seed": seed, "epochs": 4,
          "learning_rate": 0.1, "batch_size": 128, "val_accuracy": accuracies, "loss": [],
          "samples_per_second": 1.0}


def test_time_to_accuracy_counts_epochs_to_the_target_and_seconds_from_the_timed_runs(tmp_path):
  import json
  runs = [_curve_run("classes", "single", 2, 0, [0.5, 0.7, 0.8, 0.8]),
          _curve_run("classes", "spectrain", 4, 0, [0.5, 0.6, 0.7, 0.79]),   # 0.5 pp short
          _curve_run("classes", "spectrain+mb2+nesterov", 4, 0, [0.6, 0.8, 0.8, 0.8]),
          _curve_run("classes", "2bw", 4, 0, [0.1, 0.2, 0.3, 0.4])]
  (tmp_path / "staleness_runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
  names = ["gpipe M=K", "gpipe M=2K", "1f1b M=K", "1f1b M=2K", "zb M=K", "zb M=2K",
           "dataparallel", "spectrain", "spectrain advised", "2bw", "auto"]
  timed = [{"task": "classes", "candidate": n, "K": 4, "first": 2.0, "later": 1.0 + i / 10,
            "chosen": "synchronous" if n == "auto" else None,
            "chosen_name": "1f1b M=4" if n == "auto" else None,
            "profile": 1.5 if n == "auto" else 0.0} for i, n in enumerate(names)]
  timed += [{"task": "classes", "candidate": n, "K": 4, "first": 2.0, "later": later,
             "chosen": None, "chosen_name": None, "profile": 0.0}
            for n, later in [("1f1b M=1", 1.5), ("1f1b M=K/2", 1.6)]]
  (tmp_path / "time_to_accuracy.jsonl").write_text(
      "".join(json.dumps(t) + "\n" for t in timed))
  out = _bench("time_to_accuracy.py", "--tasks=classes", "--stages=4", "--seeds=0",
               "--choose_on=classes", "--epochs=4", "--norun_missing",
               f"--results_dir={tmp_path}")
  table = (tmp_path / "time_to_accuracy.md").read_text()
  # Target 79.5%: the reference reaches it at epoch 3, the advised spectrain at epoch 2.
  assert "| sgd | 4 | spectrain advised | 0.67 | 1/1 |" in table
  assert "| sgd | 4 | spectrain | - | 0/1 |" in table and "| sgd | 4 | 2bw | - | 0/1 |" in table
  # Seconds: first epoch + 2 more for the schedules (gpipe M=K: 2 + 2 x 1.0 = 4.0; 1f1b M=1:
  # 2 + 2 x 1.5 = 5.0), one fewer epoch for the advised spectrain, the fastest: 2 + 1 x 1.8;
  # auto follows the synchronous curve: 2 + 2 x 2.0.
  row = next(line for line in table.splitlines() if line.startswith("| classes | 4 |"))
  cells = [c.strip() for c in row.split("|")[1:-1]]
  assert cells[2] == "5.0" and cells[3] == "5.2"   # 1f1b at M = 1 and K/2
  assert cells[4] == "4.0" and cells[12] == "**3.8**" and cells[11] == "- (0/1)"
  assert cells[14] == "6.0" and cells[15] == "1f1b M=4"
  assert cells[16] == "1.58" and cells[17] == "1.18"   # 6.0 / 3.8; (6.0 - 1.5) / 3.8
  assert "auto (its profile included) within 10% of the fastest: 0 of 1" in out
  assert "It kept its probe without a profile" in out and "on 0 of 1" in out
  assert ("Its profile, where it ran, took 39%-39% of the fastest column's time (over 10% on "
          "1 of 1") in out
  # A probe kept without a profile: marked, and no profile share.
  timed[-3]["kept"], timed[-3]["profile"], timed[-3]["chosen_name"] = True, 0.0, "1f1b M=2"
  (tmp_path / "time_to_accuracy.jsonl").write_text(
      "".join(json.dumps(t) + "\n" for t in timed))
  out = _bench("time_to_accuracy.py", "--tasks=classes", "--stages=4", "--seeds=0",
               "--choose_on=classes", "--epochs=4", "--norun_missing",
               f"--results_dir={tmp_path}")
  assert "| 1f1b M=2 (kept) | 1.58 | 1.58 |" in out
  assert "on 1 of 1. It ran no profile." in out and "timings, one each)" in out
  # Timings taken again: each candidate's seconds are their medians (1f1b M=1's later epoch
  # 1.5, 0.5 and 0.6 s: 0.6, so 2 + 2 x 0.6).
  timed += [dict(timed[-2], later=later) for later in (0.5, 0.6)]
  (tmp_path / "time_to_accuracy.jsonl").write_text(
      "".join(json.dumps(t) + "\n" for t in timed))
  out = _bench("time_to_accuracy.py", "--tasks=classes", "--stages=4", "--seeds=0",
               "--choose_on=classes", "--epochs=4", "--norun_missing",
               f"--results_dir={tmp_path}")
  row = next(line for line in out.splitlines() if line.startswith("| classes | 4 |"))
  assert row.split("|")[3].strip() == "**3.2**" and "timings, 1-3 each)" in out


def test_memory_fit_refuses_a_cap_it_cannot_read():
  result = zygote.run([os.path.join("bench", "memory_fit.py"), "--cap=lots"])
  assert result.returncode != 0
  assert "--cap must be a number of bytes > 0, optionally with k, m or g. Received: 'lots'" in (
      result.stderr)


# Loads the bench script as a module (in a process of its own: its absl flags would clash with
# the trainer's, which tests parse in this process) and prints its comparisons of one result:
# two stages on host 0 (interleaved: the runtime on its first), one on host 1; peaks above
# idle 750 and 450, as 2 x the dense bytes and a runtime of 150 would have them.
_COMPARE = """
import importlib.util, json
spec = importlib.util.spec_from_file_location("memory_predicted", "bench/memory_predicted.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
first = {"total": 500, "temporaries": 300, "runtime": 100}   # 100 dense bytes at 3.0
second = {"total": 400, "temporaries": 300, "runtime": 0}
result = {"predicted": [first, first, second], "host_of_stage": [0, 1, 0],
          "peaks": [850, 500], "idle": [100, 50]}
print(json.dumps([bench.compare(result), bench.compare(result, (2.0, 150.0)),
                  bench.best_fit([result])]))
"""


def test_memory_predicted_sets_predictions_beside_peaks_and_fits_its_two_terms():
  import json
  from tfpipe.training import footprint
  assert footprint.TEMPORARIES == 3.0   # the rows above are written at it
  result = zygote.run(["-c", _COMPARE])
  assert result.returncode == 0, result.stderr[-2000:]
  plain, at_fit, fit = json.loads(result.stdout.strip().splitlines()[-1])
  assert plain == [[900, 750, 150 / 750], [500, 450, 50 / 450]]
  assert at_fit == [[750, 750, 0.0], [450, 450, 0.0]]
  assert [round(v, 6) for v in fit] == [2.0, 150.0]


def test_memory_predicted_refuses_an_unknown_model():
  result = zygote.run([os.path.join("bench", "memory_predicted.py"), "--models=bigram"])
  assert result.returncode != 0 and "--models takes llama, transformer, vgg16" in result.stderr


def test_memory_predicted_refuses_an_allocator_it_does_not_know():
  result = zygote.run([os.path.join("bench", "memory_predicted.py"),
                       "--allocators=bfc,bfc:4096"])
  assert result.returncode != 0
  assert "--allocators takes bfc, malloc or malloc:BYTES. Received: 'bfc:4096'" in result.stderr


_LINKS = """
import importlib.util, json
spec = importlib.util.spec_from_file_location("links", "bench/links.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
out = ("samples/s, whole last epoch  100.0\\n"
       "bytes on the links per step (over 3 steps of the last epoch), MB sent/received: "
       "worker/0 2.5/10, worker/1 7.5/1, client 0.5/0.1; 10.5 MB sent in all\\n")
traced = ("time on each host, traced over 2.8 s of one more epoch (waiting on transfers: a "
          "receive or all-reduce pending, nothing to compute): worker/0 computing 3%, waiting on "
          "transfers 81%, idle 16%; worker/1 computing 9.5%, waiting on transfers 0.5%, idle 90%\\n")
untraced = "time on each host: not traced (the trace of 198.18.0.3:4 holds no op)\\n"
def timed_out(argv, timeout):
  raise bench.subprocess.TimeoutExpired(argv, timeout)
bench.FLAGS(["links", "--timeout=7"])
bench.run_child = timed_out
failed = bench.parse(out + untraced, 50, 1e8)
print(json.dumps([bench.parse(out, 50, 1e8), bench.batch_size("vgg16"), bench.batch_size("fcn"),
                  bench.parse(out + traced, 50, 1e8)["waiting"], failed, bench._cell(failed),
                  bench.run("fcn", "1f1b", 2, "10gbit")]))
"""


def test_links_reads_bytes_and_the_busiest_links_share_of_a_step_and_records_a_timeout():
  import json
  result = zygote.run(["-c", _LINKS])
  assert result.returncode == 0, result.stderr[-2000:]
  parsed, vgg16, fcn, waiting, untraced, cell, timed_out = json.loads(
      result.stdout.strip().splitlines()[-1])
  # Hosts sent 2.5 + 7.5 MB (the client's link left out); worker/0 received the most, 10 MB:
  # 0.8 s at 100 Mbit/s of a 0.5 s step (50 samples at 100/s).
  assert parsed["sent"] == 10.0 and parsed["max_host"] == 7.5
  assert math.isclose(parsed["busy"], 1.6)
  assert not parsed["whole_fit"] and "waiting" not in parsed   # a run without the trace
  assert math.isclose(waiting, 0.81)   # the busiest host's share, from the trace's line
  # A trace that failed: the trainer's reason kept, and the cell says so.
  assert untraced["untraced"] == "the trace of 198.18.0.3:4 holds no op"
  assert "waiting" not in untraced and cell.endswith(", waiting not traced\u2020")
  assert (vgg16, fcn) == (64, 256)   # from the config's flag file, from the workload's flags
  # A run past --timeout is a cell's error, and the table goes on.
  assert timed_out == {"error": "timed out after 7 s (--timeout)"}


_LINKS_STOPPED = """
import importlib.util, subprocess, sys, time
spec = importlib.util.spec_from_file_location("links", "bench/links.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
start = time.monotonic()
try:
  bench.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1)
except subprocess.TimeoutExpired:
  print("timed out in", round(time.monotonic() - start), "s", flush=True)
mark = sys.argv[1]
child = ("import signal, sys, time\\n"
         "def stop(*_):\\n  open(%r, 'w').write('stopped')\\n  sys.exit(7)\\n"
         "signal.signal(signal.SIGTERM, stop)\\nopen(%r, 'w').write('ready')\\n"
         "time.sleep(60)\\n") % (mark, mark)
bench.run_child([sys.executable, "-c", child], 60)
print("not stopped", flush=True)
"""


def test_links_kills_a_run_past_its_timeout_and_a_sigterm_stops_its_run_too(tmp_path):
  mark = tmp_path / "child"
  started = zygote.start(["-c", _LINKS_STOPPED, str(mark)])
  deadline = time.monotonic() + 60
  while not (mark.exists() and mark.read_text() == "ready") and time.monotonic() < deadline:
    time.sleep(0.05)
  os.kill(started.pid, signal.SIGTERM)   # the benchmark's process alone, as `kill PID` does
  out, err = started.communicate(timeout=60)
  assert out.splitlines()[0] == "timed out in 1 s", err[-2000:]
  # The child was told (its handler ran) and the benchmark exited as SIGTERM asks, after it.
  assert mark.read_text() == "stopped"
  assert started.returncode == 128 + signal.SIGTERM and "not stopped" not in out


# The soak's weight comparison (bench/faults.py) on Keras .weights.h5 files made here: the same
# weights, one value off by one ulp, and a file with a layer fewer.
_WEIGHTS = """
import importlib.util, json, os, sys, tempfile
import keras, numpy as np
spec = importlib.util.spec_from_file_location("faults", "bench/faults.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
folder = tempfile.mkdtemp()
def saved(name, change=None, depth=2):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,))] + [keras.layers.Dense(4) for _ in range(depth)])
  if change:
    weights = model.get_weights()
    weights[0][1, 2] = np.nextafter(weights[0][1, 2], np.float32(np.inf))
    model.set_weights(weights)
  path = os.path.join(folder, name + ".weights.h5")
  model.save_weights(path)
  return path
reference = saved("reference")
print(json.dumps([bench.compare_weights(saved("same"), reference),
                  bench.compare_weights(saved("ulp", change=True), reference),
                  bench.compare_weights(saved("short", depth=1), reference),
                  bench.compare_weights(os.path.join(folder, "none.weights.h5"), reference)]))
"""


def test_the_soak_compares_final_weights_bit_for_bit():
  import json
  result = zygote.run(["-c", _WEIGHTS])
  assert result.returncode == 0, result.stderr[-2000:]
  same, ulp, short, none = json.loads(result.stdout.strip().splitlines()[-1])
  assert same == "equal, bit for bit (4 arrays, 36 values)"
  assert ulp.startswith("DIFFERENT in 1 of 4 arrays (largest difference ")
  assert short == "DIFFERENT: 2 arrays written against 4"
  assert none == "DIFFERENT: 0 arrays written against 4"
