"""Delay and loss on emulated links' ends, where the kernel has no `netem`, and as faults.

`Impairment([End(netns, ifname, delay, loss, loss_in), ...])` impairs each
end (an interface in a network namespace):
  - loss: a packet program (`tfpipe.cluster.bpf.egress`) drops each packet
    that leaves with probability `loss`, and each that arrives with
    probability `loss_in`. A drop on the way out of a host's own interface is
    no loss to that host's TCP (the kernel tells it at once, and it sends
    the segment again as if nothing were lost), so an emulated link drops
    on the bridge's end, both ways (`emulation.Network.impaired_ends`);
  - delay: the program sends the packet into a delay line
    (`tfpipe.cluster.delay_line`, a process of its own that holds a tap
    device in the end's namespace), which writes it back `delay` seconds
    later; `bpf.returning` sends it out of the end, through the link's token
    bucket.
`remove()` takes it all away and the end carries packets as before, so a
fault can be injected into a running link and lifted (`bench/faults.py`).
An end already impaired is refused. Root only, as the emulation is.
"""

import contextlib
import dataclasses
import json
import subprocess
import sys

from tfpipe.cluster import bpf, delay_line

__all__ = ["End", "Impairment"]

_TAP_PREFIX = "dl-"


@dataclasses.dataclass(frozen=True)
class End:
  """One end of a link: interface `ifname` in namespace `netns`, what leaves it delayed by
  `delay` seconds and dropped with probability `loss`, what arrives dropped with probability
  `loss_in`."""
  netns: str
  ifname: str
  delay: float = 0.0
  loss: float = 0.0
  loss_in: float = 0.0


class Impairment:
  """Delay and loss on `ends` (a list of End) until `remove()`; a context manager too."""

  def __init__(self, ends):
    from pyroute2 import IPRoute
    self._ipr = IPRoute
    self.ends = [end for end in ends if end.delay or end.loss or end.loss_in]
    for end in self.ends:
      if end.delay < 0 or not (0 <= end.loss < 1 and 0 <= end.loss_in < 1):
        raise ValueError(f"{end}: the delay must be >= 0 seconds and the losses fractions in "
                         f"[0, 1)")
    self._line, self._attached = None, []
    try:
      detours = self._start_line([end for end in self.ends if end.delay])
      for end in self.ends:
        self._attach(end, detours.get(end))
    except BaseException:
      self.remove()
      raise

  def _start_line(self, delayed):
    """The delay line for `delayed` ends; {end: its tap's interface index}."""
    if not delayed:
      return {}
    entries = [(end.netns, (_TAP_PREFIX + end.ifname)[:15], end.delay) for end in delayed]
    self._line = subprocess.Popen(
        [sys.executable, "-I", delay_line.__file__, json.dumps(entries)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = self._line.stdout.readline()
    if not line:
      error = self._line.stderr.read().strip().splitlines()
      raise bpf.BpfUnavailable(f"the delay line did not start: {error[-1] if error else '?'}")
    return dict(zip(delayed, json.loads(line)))

  def _attach(self, end, detour):
    with self._ipr(netns=end.netns) as ipr:
      found = ipr.link_lookup(ifname=end.ifname)
      if not found:
        raise ValueError(f"no interface {end.ifname!r} in namespace {end.netns!r}")
      port = found[0]
      if any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(port)):
        raise ValueError(f"{end.ifname} in {end.netns} is impaired already")
      self._attached.append(end)
      if end.loss or detour is not None:
        bpf.attach(ipr, port, bpf.egress(end.loss, detour), "tfpipe_egress")
      if end.loss_in:
        bpf.attach(ipr, port, bpf.egress(end.loss_in, None), "tfpipe_ingress", "ingress")
      if detour is not None:
        bpf.attach(ipr, detour, bpf.returning(port), "tfpipe_return", "ingress")

  @property
  def pid(self):
    """The delay line's process id, or None where nothing is delayed."""
    return None if self._line is None else self._line.pid

  def remove(self):
    """Takes the programs off the ends and ends the delay line."""
    for end in self._attached:
      with contextlib.suppress(Exception), self._ipr(netns=end.netns) as ipr:
        bpf.detach(ipr, ipr.link_lookup(ifname=end.ifname)[0])
    self._attached = []
    if self._line is not None:
      with contextlib.suppress(OSError):
        self._line.stdin.close()
      try:
        self._line.wait(5)
      except subprocess.TimeoutExpired:
        self._line.kill()
        self._line.wait()
      for stream in (self._line.stdout, self._line.stderr):
        stream.close()
      self._line = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.remove()
