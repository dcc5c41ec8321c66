"""Memory caps and CPU sets for the emulated hosts: Linux control groups, v1 or v2.

`Group(name, memory=BYTES, cpus="0-1")` makes a control group of that name
(every controller it needs, under the hierarchy the kernel mounts: the
`memory` and `cpuset` hierarchies of v1, or the unified one of v2), `add(pid)`
puts a process in it, `peak()` reads the most memory its processes held
(v1 `memory.max_usage_in_bytes`, v2 `memory.peak`), `remove()` deletes it.
A process over its cap is killed by the kernel, as on a host that runs out.
"""

import os
import time

__all__ = ["Group", "version", "names", "remove_named", "ROOT"]

ROOT = "/sys/fs/cgroup"


def version(root=ROOT):
  """1 (a hierarchy per controller: `memory/`, `cpuset/`), 2 (unified), or None."""
  if os.path.isdir(os.path.join(root, "memory")):
    return 1
  if os.path.exists(os.path.join(root, "cgroup.controllers")):
    return 2
  return None


def _dirs(name, memory, cpus, root):
  """The directories a group of `name` has (v1: one per controller it uses)."""
  if version(root) == 2:
    return [os.path.join(root, name)]
  kinds = ["memory"] if memory is not None or cpus is None else []
  kinds += ["cpuset"] if cpus is not None else []
  return [os.path.join(root, kind, name) for kind in kinds]


def _write(path, value):
  with open(path, "w") as f:
    f.write(str(value))


def _read(path):
  with open(path) as f:
    return f.read().strip()


class Group:
  """A control group `name` holding at most `memory` bytes (None: uncapped) on CPUs `cpus`
  (a cpuset list such as "0" or "0-1"; None: every CPU)."""

  def __init__(self, name, memory=None, cpus=None, root=ROOT):
    self.name, self.memory, self.cpus, self._root = name, memory, cpus, root
    self.version = version(root)
    if self.version is None:
      raise RuntimeError(f"no control groups mounted at {root}: memory caps and CPU sets need "
                         "the cgroup v1 memory/cpuset hierarchies or cgroup v2")
    self.dirs = _dirs(name, memory, cpus, root)
    try:
      for path in self.dirs:
        os.makedirs(path, exist_ok=True)
        self._configure(path)
    except OSError as e:
      self.remove()
      raise RuntimeError(f"could not make control group {name!r}: {e}") from None

  def _configure(self, path):
    if self.version == 2:
      parent = os.path.dirname(path)
      wanted = (["+memory"] if self.memory is not None else []) + (
          ["+cpuset"] if self.cpus is not None else [])
      for controller in wanted:
        _write(os.path.join(parent, "cgroup.subtree_control"), controller)
      if self.memory is not None:
        _write(os.path.join(path, "memory.max"), int(self.memory))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
          _write(os.path.join(path, "memory.swap.max"), 0)
      if self.cpus is not None:
        _write(os.path.join(path, "cpuset.cpus"), self.cpus)
      return
    if path.endswith(os.path.join("memory", self.name)) and self.memory is not None:
      _write(os.path.join(path, "memory.limit_in_bytes"), int(self.memory))
      swap = os.path.join(path, "memory.memsw.limit_in_bytes")
      if os.path.exists(swap):   # no swapping past the cap: the host runs out, as a GPU does
        _write(swap, int(self.memory))
    if path.endswith(os.path.join("cpuset", self.name)):
      _write(os.path.join(path, "cpuset.cpus"), self.cpus)
      _write(os.path.join(path, "cpuset.mems"),
             _read(os.path.join(os.path.dirname(path), "cpuset.mems")))

  def procs_files(self):
    """The files a process writes its pid to, to join the group."""
    return [os.path.join(path, "cgroup.procs") for path in self.dirs]

  def add(self, pid):
    for path in self.procs_files():
      _write(path, pid)

  def _number(self, names):
    """The value of the first of `names` (v1's file, v2's) the group has, or None."""
    for path in self.dirs:
      for name in names:
        if os.path.exists(os.path.join(path, name)):
          return int(_read(os.path.join(path, name)))
    return None

  def peak(self):
    """The most memory (bytes) the group's processes have held since it was made."""
    return self._number(("memory.max_usage_in_bytes", "memory.peak"))

  def usage(self):
    """The memory (bytes) the group's processes hold now (page cache included)."""
    return self._number(("memory.usage_in_bytes", "memory.current"))

  def remove(self, timeout=5.0):
    remove_named(self.name, self._root, timeout)


def names(prefix, root=ROOT):
  """The names of the control groups starting with `prefix`."""
  found = set()
  for parent in ([root] if version(root) == 2 else
                 [os.path.join(root, "memory"), os.path.join(root, "cpuset")]):
    if os.path.isdir(parent):
      found.update(n for n in os.listdir(parent) if n.startswith(prefix))
  return sorted(found)


def remove_named(name, root=ROOT, timeout=5.0):
  """Removes group `name` (its processes killed first: a group with processes cannot go)."""
  paths = ([os.path.join(root, name)] if version(root) == 2 else
           [os.path.join(root, kind, name) for kind in ("memory", "cpuset")])
  for path in paths:
    if not os.path.isdir(path):
      continue
    deadline = time.monotonic() + timeout
    while True:
      try:
        pids = [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
      except OSError:
        pids = []
      for pid in pids:
        try:
          os.kill(pid, 9)
        except ProcessLookupError:
          pass
      try:
        os.rmdir(path)
        break
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.05)
