"""How a TF server allocates its tensors: TensorFlow's BFC allocator, or malloc with a fixed
mmap threshold.

TensorFlow's servers that tfpipe starts use its BFC allocator on the CPU (`CPU_ALLOCATOR`,
`use_cpu_allocator`), as TensorFlow does on GPUs: a best-fit allocator that coalesces freed
blocks and keeps them for the next step's tensors, so a server's peak follows its tensors'
peak; an allocation that would take its tensors past `limit` bytes fails with TensorFlow's
out-of-memory error naming the op (a server on a capped host takes the cap as its limit).
Lower peaks than malloc at about the same speed, measured side by side with
`bench/memory_predicted.py --allocators=bfc,malloc`.

With "malloc" (TensorFlow's own default on the CPU) tensors come from the C library's
malloc: glibc serves a large block with mmap and unmaps it when freed, but it raises that
threshold to the size of each mapped block freed (up to 32 MiB), so after the first step a
weight-sized tensor comes from a heap arena and its pages stay with the process when freed:
a server's peak then holds every step's temporaries side by side. A fixed threshold
(mallopt M_MMAP_THRESHOLD) keeps blocks of at least that size mapped and returned: a lower
peak, but every such block is mapped and zero-filled afresh, which costs speed. Servers on
malloc keep glibc's adaptive threshold unless asked (`MMAP_THRESHOLD`, 0); `MEMORY_FIRST` is
the fixed one to ask for where memory binds.
"""

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "MEMORY_FIRST", "LIMIT", "CPU_ALLOCATORS", "CPU_ALLOCATOR",
           "fix_mmap_threshold", "cpu_allocator", "use_cpu_allocator", "host_memory"]

MMAP_THRESHOLD = 0          # tfpipe's servers: glibc's adaptive threshold
MEMORY_FIRST = 4 << 20      # bytes: blocks of 4 MiB and more mapped, and returned when freed
_M_MMAP_THRESHOLD = -3     # mallopt's parameter number (glibc malloc.h)
LIMIT = 32 << 20    # glibc refuses thresholds above HEAP_MAX/2 on 64-bit hosts
CPU_ALLOCATORS = ("bfc", "malloc")
CPU_ALLOCATOR = "bfc"       # tfpipe's servers
_USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"        # read by TensorFlow at its first CPU tensor
_BFC_LIMIT = "TF_CPU_BFC_MEM_LIMIT_IN_MB"    # its default, 64 GiB, would bind on larger hosts


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


def cpu_allocator(name=None):
  """`name` checked, or where None the allocator TensorFlow's environment asks for
  (`TF_CPU_ALLOCATOR_USE_BFC` true: "bfc", false: "malloc"), else tfpipe's `CPU_ALLOCATOR`."""
  if name is None:
    asked = os.environ.get(_USE_BFC, "").strip().lower()
    return ("bfc" if asked in ("1", "true") else "malloc" if asked in ("0", "false")
            else CPU_ALLOCATOR)
  if name not in CPU_ALLOCATORS:
    raise ValueError(f"the CPU allocator must be one of {', '.join(CPU_ALLOCATORS)}. "
                     f"Received: {name!r}")
  return name


def host_memory():
  """This host's physical memory in bytes."""
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def use_cpu_allocator(name=None, limit=None):
  """Makes this process's TensorFlow allocate CPU tensors with `name` (`cpu_allocator`); call
  before its first tensor (importing TensorFlow allocates none). With "bfc", at most `limit`
  bytes (None: the host's memory). Returns the allocator's name."""
  name = cpu_allocator(name)
  if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                            or limit < 1 << 20):
    raise ValueError(f"the CPU allocator's limit must be a number of bytes >= 1 MiB. "
                     f"Received: {limit!r}")
  os.environ[_USE_BFC] = "true" if name == "bfc" else "false"
  if name == "bfc":
    os.environ[_BFC_LIMIT] = str((host_memory() if limit is None else limit) >> 20)
  return name
