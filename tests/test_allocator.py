"""A TF server's freed tensors go back to its host: the fixed malloc mmap threshold."""

import os
import subprocess
import sys

import pytest

from tfpipe.cluster import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Loads the allocator module alone (tfpipe's package imports TensorFlow), fixes the threshold
# as a server does (0: glibc's adaptive one), frees an 8 MiB array three times and prints
# the resident memory the process kept.
_PROBE = """
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("allocator", "tfpipe/cluster/allocator.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fixed = module.fix_mmap_threshold(int(sys.argv[1]))
def resident():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096
before = resident()
for _ in range(3):
  block = np.ones((8 << 20) // 8)
  del block
print(fixed, resident() - before)
"""


def _kept(threshold):
  done = subprocess.run([sys.executable, "-c", _PROBE, str(threshold)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60, check=True)
  fixed, kept = done.stdout.split()
  return fixed == "True", int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_fixed_threshold_returns_freed_blocks_that_the_adaptive_one_keeps():
  fixed, kept = _kept(allocator.MEMORY_FIRST)
  assert fixed and kept < 1 << 20
  adaptive, kept_adaptive = _kept(0)
  assert not adaptive and kept_adaptive >= 6 << 20   # the 8 MiB block, from the heap


@pytest.mark.parametrize("size", [-1, 64 << 20, 1.5, True, "1m"])
def test_a_threshold_out_of_glibcs_range_is_refused_by_value(size):
  with pytest.raises(ValueError, match=r"mmap threshold must be a number of bytes from 0"):
    allocator.fix_mmap_threshold(size)


def test_the_server_command_refuses_a_bad_threshold_in_one_line(capsys):
  from tfpipe.cluster import serving
  with pytest.raises(SystemExit):
    serving.serve(["--spec={}", "--job=worker", "--task=0", "--mmap_threshold=-5"])
  assert "mmap threshold must be a number of bytes" in capsys.readouterr().err


def test_a_cluster_refuses_a_bad_threshold_before_starting_servers():
  from tfpipe.cluster import local as local_cluster
  with pytest.raises(ValueError, match=r"`mmap_threshold` must be a number of bytes"):
    local_cluster.LocalCluster({"worker": 1}, mmap_threshold=-1)


@pytest.mark.parametrize("asked,expected", [
    (None, "bfc"), ("true", "bfc"), ("1", "bfc"), ("false", "malloc"), ("0", "malloc")])
def test_the_cpu_allocator_is_tensorflows_environment_choice_else_bfc(monkeypatch, asked,
                                                                      expected):
  monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
  if asked is not None:
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", asked)
  assert allocator.cpu_allocator() == expected
  assert allocator.cpu_allocator("malloc") == "malloc"   # asked by name: as asked


@pytest.mark.parametrize("name,limit,use_bfc,limit_mib", [
    ("bfc", 256 << 20, "true", "256"), ("bfc", None, "true", None), ("malloc", None, "false", "")])
def test_choosing_the_cpu_allocator_sets_what_tensorflow_reads(monkeypatch, name, limit,
                                                                use_bfc, limit_mib):
  monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "")
  monkeypatch.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", "")
  assert allocator.use_cpu_allocator(name, limit) == name
  assert os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == use_bfc
  host = str(allocator.host_memory() >> 20)   # TensorFlow's own default, 64 GiB, is not kept
  assert os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] == (host if limit_mib is None else limit_mib)


@pytest.mark.parametrize("name,limit,message", [
    ("tcmalloc", None, r"CPU allocator must be one of bfc, malloc. Received: 'tcmalloc'"),
    ("bfc", 1000, r"limit must be a number of bytes >= 1 MiB. Received: 1000"),
    ("bfc", 2.5e9, r"limit must be a number of bytes >= 1 MiB. Received: 2500000000.0")])
def test_a_bad_cpu_allocator_or_limit_is_refused_by_value(monkeypatch, name, limit, message):
  monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "false")
  with pytest.raises(ValueError, match=message):
    allocator.use_cpu_allocator(name, limit)
  assert os.environ["TF_CPU_ALLOCATOR_USE_BFC"] == "false"   # nothing changed


# Chooses BFC with a 64 MiB limit after TensorFlow is imported (a server's order), then reads
# the allocator's statistics (malloc keeps none) and asks for a tensor past the limit.
_BFC_PROBE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from tfpipe.cluster import allocator
allocator.use_cpu_allocator("bfc", limit=64 << 20)
small = tf.ones([1 << 20])
print(tf.config.experimental.get_memory_info("CPU:0")["current"] >= 4 << 20)
try:
  tf.ones([32 << 20])
except tf.errors.ResourceExhaustedError as e:
  print(str(e).splitlines()[0])
"""


def test_tensorflow_allocates_with_bfc_within_its_limit_when_chosen_after_its_import():
  from tests import zygote   # a fork of a process that imported TensorFlow and ran no op
  done = zygote.run(["-c", _BFC_PROBE], timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  stats, refused = done.stdout.strip().splitlines()
  assert stats == "True"
  assert "OOM when allocating tensor with shape[33554432]" in refused and "bfc" in refused


def test_a_cluster_refuses_a_bad_cpu_allocator_before_starting_servers():
  from tfpipe.cluster import local as local_cluster
  with pytest.raises(ValueError, match=r"CPU allocator must be one of bfc, malloc"):
    local_cluster.LocalCluster({"worker": 1}, cpu_allocator="jemalloc")
