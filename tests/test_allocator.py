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
