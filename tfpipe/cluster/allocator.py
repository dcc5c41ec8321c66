"""How a TF server's freed memory goes back to its host: a fixed malloc mmap threshold.

TensorFlow's CPU allocator takes tensors from the C library's malloc. glibc serves a large
block with mmap and unmaps it when freed, but it raises that threshold to the size of each
mapped block freed (up to 32 MiB), so after the first step a weight-sized tensor comes from a
heap arena and its pages stay with the process when freed: a server's peak then holds every
step's temporaries side by side. A fixed threshold (mallopt M_MMAP_THRESHOLD) keeps blocks of
at least that size mapped and returned: a lower peak, but every such block is mapped and
zero-filled afresh, which costs speed. tfpipe's servers keep glibc's adaptive threshold unless
asked (`MMAP_THRESHOLD`, 0); `MEMORY_FIRST` is the fixed one to ask for where memory binds.
Both measured side by side with `bench/memory_predicted.py`
(`bench/results/memory_predicted.md`).
"""

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD", "MEMORY_FIRST", "LIMIT", "fix_mmap_threshold"]

MMAP_THRESHOLD = 0          # tfpipe's servers: glibc's adaptive threshold
MEMORY_FIRST = 4 << 20      # bytes: blocks of 4 MiB and more mapped, and returned when freed
_M_MMAP_THRESHOLD = -3     # mallopt's parameter number (glibc malloc.h)
LIMIT = 32 << 20    # glibc refuses thresholds above HEAP_MAX/2 on 64-bit hosts


def fix_mmap_threshold(size=MEMORY_FIRST):
  """Fixes this process's malloc mmap threshold at `size` bytes (0: leave glibc's adaptive
  one). Returns whether it took effect (False where the C library is not glibc)."""
  if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= LIMIT:
    raise ValueError(f"the mmap threshold must be a number of bytes from 0 (the C library's "
                     f"own) to {LIMIT}. Received: {size!r}")
  if size == 0:
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    mallopt = libc.mallopt
  except (OSError, AttributeError):   # not glibc (musl, macOS): its allocator decides
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  return mallopt(_M_MMAP_THRESHOLD, size) == 1
