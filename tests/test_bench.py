"""The report scripts run end to end at a tiny size and write their tables."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(script, *args):
  result = subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
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
         f"--results_dir={tmp_path}")
  table = (tmp_path / "grid.md").read_text()
  assert "| dnn 7 x 16 | model only | 1x4 |" in table and "| snn 8 x 16 | grid | 2x2 |" in table


def test_seed001_speedup(tmp_path):
  _bench("seed001_speedup.py", "--width=16", "--steps=8", "--batch_size=16",
         f"--results_dir={tmp_path}")
  table = (tmp_path / "seed001.md").read_text()
  for row in ("| data parallel (MirroredStrategy), P=2 |", "| layer-wise pipeline (pipedream), K=2 |",
              "| ASGD, 2 workers + 1 parameter server |"):
    assert row in table


def test_staleness(tmp_path):
  args = ["--epochs=1", "--batch_size=512", "--options=single,spectrain+sc", "--stages=2",
          "--seeds=0,1", "--tasks=teacher", f"--results_dir={tmp_path}"]
  out = _bench("staleness.py", *args)
  table = (tmp_path / "staleness.md").read_text()
  assert "| spectrain+sc |" in table and "| single |" in table and "[2]" in table
  assert (tmp_path / "staleness_teacher.png").stat().st_size > 1000
  runs = (tmp_path / "staleness_runs.jsonl").read_text().splitlines()
  assert len(runs) == 4   # 2 options x 2 seeds, one line each
  out = _bench("staleness.py", *args)   # resumes: every run is on file, none repeats
  assert "seed=" not in out and (tmp_path / "staleness_runs.jsonl").read_text().splitlines() == runs


def test_sync_schedules():
  out = _bench("sync_schedules.py", "--stages=2", "--micro_batches=4", "--batches=3",
               "--epochs=2", "--width=16", "--depth=3", "--batch_size=16")
  methods = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
  rows = {line.split()[0]: line.split() for line in out.splitlines()
          if line.split() and line.split()[0] in methods}
  assert set(rows) == set(methods)
  # kept micro-batches at stage 0, measured / verified: gpipe M, 1f1b min(K, M), zb min(K, M)
  assert (rows["gpipe"][1], rows["1f1b"][1], rows["zb"][1]) == ("4", "2", "2")
  assert rows["interleaved"].index("/") == 5   # 4 stages on 2 devices
  assert rows["gpipe"][-2] == "1.00"   # samples/s x gpipe


def test_data_parallel_pipeline():
  out = _bench("data_parallel_pipeline.py", "--batches=3", "--epochs=2", "--width=16",
               "--depth=2", "--batch_size=16", "--micro_batches=2")
  rows = [line for line in out.splitlines() if line.startswith(("R=", "MirroredStrategy"))]
  assert [r.split()[0] for r in rows[-3:]] == ["R=2", "R=1", "MirroredStrategy"]
  assert rows[-2].split()[-1] == "1.00"
