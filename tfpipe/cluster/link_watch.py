"""Names an emulated host whose connections lose packets: TCP's retransmissions, per host.

A lossy link leaves every task answering (the liveness probe sees nothing);
what shows it is TCP sending segments again. On shaped links without loss
TCP retransmits next to nothing (the token bucket's queue paces it), so a
share of segments sent again over the last seconds names the host.

`LinkWatch(hosts, on_lossy)` reads, every `interval` seconds from a daemon
thread, each host's TCP counters (segments sent, segments retransmitted:
`/proc/net/snmp` as seen from inside its network namespace, which the watch's
own thread enters for the read) and calls `on_lossy(name, share)` once when over the
last `window` readings at least `least` segments were sent and more than
`share` of them were retransmissions; `on_lossy(name, None)` once the share
has fallen under half that again. A context manager, as `liveness.Watchdog`.
"""

import collections
import threading

from tfpipe.cluster import emulation

__all__ = ["LinkWatch", "tcp_counters"]


def _read_snmp():
  with open("/proc/thread-self/net/snmp") as f:
    rows = [line.split()[1:] for line in f if line.startswith("Tcp:")]
  values = dict(zip(rows[0], rows[1]))
  return int(values["OutSegs"]), int(values["RetransSegs"])


def tcp_counters(netns):
  """(TCP segments sent, segments retransmitted) since namespace `netns` was made, read by a
  thread that enters it (the caller stays where it is)."""
  out = {}

  def guarded():
    try:
      emulation.enter(netns)
      out["counters"] = _read_snmp()
    except OSError as e:
      out["error"] = e
  thread = threading.Thread(target=guarded, name="tfpipe-tcp-counters")
  thread.start()
  thread.join()
  if "error" in out:
    raise out["error"]
  return out["counters"]


class LinkWatch:
  """Watches `hosts` ({name: network namespace}); see the module docstring."""

  def __init__(self, hosts, on_lossy, interval=1.0, window=3, share=0.002, least=500):
    self.hosts, self.on_lossy = dict(hosts), on_lossy
    self.interval, self.window, self.share, self.least = interval, window, share, least
    self.named = {}          # {name: the share it was named with}
    self._stop = threading.Event()
    self._thread = None

  def __enter__(self):
    if self.hosts:
      self._thread = threading.Thread(target=self._run, name="tfpipe-link-watch", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread is not None:
      self._thread.join()

  def _run(self):
    seen = {name: collections.deque(maxlen=self.window + 1) for name in self.hosts}
    while not self._stop.wait(self.interval):
      for name, netns in self.hosts.items():
        try:
          emulation.enter(netns)   # this thread only, its own
          seen[name].append(_read_snmp())
        except OSError:      # the namespace is gone: the run is ending
          continue
        (sent0, again0), (sent1, again1) = seen[name][0], seen[name][-1]
        sent = sent1 - sent0
        if sent < self.least:
          continue
        share = (again1 - again0) / sent
        if share > self.share and name not in self.named:
          self.named[name] = share
          self.on_lossy(name, share)
        elif share < self.share / 2 and name in self.named:
          del self.named[name]
          self.on_lossy(name, None)
