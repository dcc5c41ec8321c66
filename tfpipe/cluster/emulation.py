"""Hosts on one machine: Linux network namespaces joined by shaped links.

`Network(hosts=N, link="1gbit")` makes, for its run (`tfpipe-PID-SEQ`):
  ...-hub      a namespace holding only a bridge, `br0`;
  ...-hN       host N: a namespace whose `eth0` (198.18.0.N+1/24) is one end
               of a veth pair; the other end (`hN`) is a port of the bridge;
  ...-client   the client, the program that drives a run (198.18.0.254).
Each link's rate is capped in both directions by a token bucket (tc `tbf`)
on both of its ends, its delay and loss (each way) added by packet programs
and a delay line (`tfpipe.cluster.impairment`, which needs no `netem`); each
host may have a memory cap and a CPU set (a control group,
`tfpipe.cluster.cgroups`). The namespaces have their loopback and their one
link, no default route: nothing reaches past the emulation, whose addresses
(198.18.0.0/15, reserved for network benchmarks) exist only on its own links.
The machine's own interfaces and routes are never touched.

Built on pyroute2 (netlink), as root. `close()` (or leaving the `with`
block) removes everything; a run that was killed leaves namespaces and
groups whose PID is gone, and the next `Network` removes them first; one that
leaves at once (`tfpipe.cluster.exits`) removes its own first.
`counters()` reads the bytes each host sent and received, from its link.
"""

import contextlib
import ctypes
import dataclasses
import itertools
import os
import re
import signal
import subprocess

from tfpipe.cluster import bpf, cgroups, exits, impairment, links, liveness

__all__ = ["Network", "Host", "EmulationUnavailable", "enter", "remove_leftovers", "hub_counters",
           "link_ends", "SUBNET", "PREFIX"]

PREFIX = "tfpipe-"
SUBNET = "198.18.0"           # /24 inside 198.18.0.0/15; every run's namespaces are its own
CLIENT = 254
_NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_SEQUENCE = itertools.count()
_NAME = re.compile(r"^tfpipe-(\d+)-(\d+)-")


class EmulationUnavailable(RuntimeError):
  """This machine or process cannot make emulated hosts (not root, no pyroute2, no netns)."""


@dataclasses.dataclass
class Host:
  """An emulated host: its namespace, address, link and control group (or None)."""
  name: str                  # "h0", ..., "client"
  netns: str
  address: str
  port: str                  # its link's end on the bridge (in the hub namespace)
  group: object = None       # a cgroups.Group, or None

  def procs_files(self):
    return self.group.procs_files() if self.group is not None else []


def _pyroute2():
  try:
    import pyroute2
    from pyroute2 import netns
  except ImportError:
    raise EmulationUnavailable("emulated hosts need pyroute2 (pip install pyroute2)") from None
  return pyroute2, netns


def check_available():
  """Refuses, in one line, where namespaces cannot be made here."""
  if not os.path.exists("/proc/self/ns/net"):
    raise EmulationUnavailable("emulated hosts need Linux network namespaces, which this "
                               "system does not have")
  if os.geteuid() != 0:
    raise EmulationUnavailable("emulated hosts need root (network namespaces, traffic control, "
                               f"control groups): this process runs as uid {os.geteuid()}")
  _pyroute2()


def enter(netns):
  """Moves the calling thread (and every thread it starts from now on) into namespace
  `netns`; call it before TensorFlow starts its threads, so that its sockets are there."""
  libc = ctypes.CDLL(None, use_errno=True)
  fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY)
  try:
    if libc.setns(fd, _CLONE_NEWNET) != 0:
      error = ctypes.get_errno()
      raise OSError(error, f"cannot enter network namespace {netns!r}: {os.strerror(error)}")
  finally:
    os.close(fd)


def remove_leftovers():
  """Removes the namespaces and control groups of runs whose process is gone (a killed run);
  returns their names."""
  _, netns = _pyroute2()
  removed = []
  for name in sorted(netns.listnetns()):
    match = _NAME.match(name)
    if match and not liveness.process_alive(int(match.group(1))):
      netns.remove(name)
      removed.append(name)
  for name in cgroups.names(PREFIX):
    match = _NAME.match(name)
    if match and not liveness.process_alive(int(match.group(1))):
      cgroups.remove_named(name)
      removed.append(name)
  return removed


class Network:
  """`hosts` emulated hosts and a client joined by links of shape `link` ("RATE[,DELAY[,LOSS%]]",
  `tfpipe.cluster.links`); `client_link` shapes the client's own (default: `link`). `memory`
  caps each host (bytes, None: no cap), `cpus` gives each host a CPU set (a list, one cpuset
  string per host, or one for all). A context manager: leaving it removes everything."""

  def __init__(self, hosts, link="10gbit", client_link=None, memory=None, cpus=None):
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts < CLIENT - 1:
      raise ValueError(f"`hosts` must be an integer from 1 to {CLIENT - 2}. Received: {hosts!r}")
    self.link = links.parse(link)
    self.client_link = self.link if client_link is None else links.parse(client_link)
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int)
                               or memory <= 0):
      raise ValueError(f"`memory` must be a number of bytes > 0, or None. Received: {memory!r}")
    if cpus is not None and not isinstance(cpus, (str, list, tuple)):
      raise ValueError(f"`cpus` must be a cpuset string (\"0-1\"), one per host, or None. "
                       f"Received: {cpus!r}")
    if isinstance(cpus, (list, tuple)) and len(cpus) != hosts:
      raise ValueError(f"`cpus` gives {len(cpus)} CPU sets for {hosts} hosts")
    check_available()
    remove_leftovers()
    self.run = f"{PREFIX}{os.getpid()}-{next(_SEQUENCE)}"
    self.hub = f"{self.run}-hub"
    self.hosts, self.client, self._made = [], None, []
    self._impairment = None
    exits.register(self.close)   # also when the process must leave at once
    try:
      self._build(hosts, memory, cpus)
      self._impair()
    except BaseException:
      self.close()
      raise

  def _ipr(self, netns):
    from pyroute2 import IPRoute
    return IPRoute(netns=netns)

  def _build(self, count, memory, cpus):
    _, netns = _pyroute2()
    netns.create(self.hub)
    self._made.append(self.hub)
    with self._ipr(self.hub) as hub:
      hub.link("add", ifname="br0", kind="bridge")
      bridge = hub.link_lookup(ifname="br0")[0]
      hub.link("set", index=bridge, state="up")
      for i in list(range(count)) + [None]:
        name = "client" if i is None else f"h{i}"
        space = f"{self.run}-{name}"
        netns.create(space)
        self._made.append(space)
        address = f"{SUBNET}.{CLIENT if i is None else i + 1}"
        hub.link("add", ifname=name, kind="veth", peer={"ifname": "eth0", "net_ns_fd": space})
        port = hub.link_lookup(ifname=name)[0]
        hub.link("set", index=port, master=bridge, state="up")
        link = self.client_link if i is None else self.link
        _shape(hub, port, link)
        with self._ipr(space) as ipr:
          ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
          eth = ipr.link_lookup(ifname="eth0")[0]
          ipr.addr("add", index=eth, address=address, prefixlen=24)
          ipr.link("set", index=eth, state="up")
          _shape(ipr, eth, link)
        group = None
        if i is not None and (memory is not None or cpus is not None):
          group = cgroups.Group(space, memory=memory,
                                cpus=cpus[i] if isinstance(cpus, (list, tuple)) else cpus)
        host = Host(name, space, address, name, group)
        if i is None:
          self.client = host
        else:
          self.hosts.append(host)

  def impaired_ends(self, host, delay=0.0, loss=0.0):
    """`link_ends` of `host` (a Host)."""
    return link_ends(host.netns, self.hub, host.port, delay, loss)

  def _impair(self):
    """The links' delay and loss."""
    ends = []
    for host in self.hosts + [self.client]:
      link = self.client_link if host is self.client else self.link
      ends += self.impaired_ends(host, link.delay, link.loss)
    try:
      made = impairment.Impairment(ends)   # takes the ends with delay or loss only
    except bpf.BpfUnavailable as e:
      raise EmulationUnavailable(f"link {self.link}: this kernel cannot add delay or loss "
                                 f"({e}); give a rate alone") from None
    self._impairment = made if made.ends else None

  def counters(self):
    """{host name: (bytes it sent, bytes it received)} over its link since it was made, the
    client's included; read from the bridge's end of each link."""
    return hub_counters(self.hub)

  def popen(self, host, argv, **kwargs):
    """`subprocess.Popen(argv, **kwargs)` running on `host` (a Host): in its namespace and
    control group."""
    files = host.procs_files()

    def place():
      enter(host.netns)
      for path in files:
        with open(path, "w") as f:
          f.write(str(os.getpid()))

    return subprocess.Popen(argv, preexec_fn=place, **kwargs)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    """Removes every namespace (their links go with them) and control group; kills what runs
    in a host's control group first."""
    _, netns = _pyroute2()
    if self._impairment is not None:
      self._impairment.remove()
      self._impairment = None
    for host in self.hosts:
      if host.group is not None:
        with contextlib.suppress(OSError):
          host.group.remove()
    for space in reversed(self._made):
      _kill_inside(space)
      with contextlib.suppress(OSError, FileNotFoundError):
        netns.remove(space)
    self._made = []
    exits.unregister(self.close)


def link_ends(netns, hub, port, delay=0.0, loss=0.0):
  """The link of the host in namespace `netns` (its bridge port `port` in namespace `hub`)
  with `delay` seconds added each way and a share `loss` of its packets dropped each way, as
  `impairment.End`s: the host's `eth0` delays what it sends; the bridge's port delays what it
  sends to the host and drops both ways (where the host's TCP sees a drop as a network's).
  From any process of this machine."""
  return [impairment.End(netns, "eth0", delay=delay),
          impairment.End(hub, port, delay=delay, loss=loss, loss_in=loss)]


def hub_counters(hub):
  """{host name: (bytes sent, bytes received)} of every link into the bridge of namespace `hub`
  (a `Network`'s), from any process of this machine."""
  from pyroute2 import IPRoute
  out = {}
  with IPRoute(netns=hub) as ipr:
    for link in ipr.get_links():
      name = link.get_attr("IFLA_IFNAME")
      if link.get_attr("IFLA_MASTER") is not None:   # a port of the bridge: a host's link
        stats = link.get_attr("IFLA_STATS64")
        out[name] = (int(stats["rx_bytes"]), int(stats["tx_bytes"]))
  return out


def _kill_inside(space):
  """Kills the processes whose network namespace is `space` (a host's server, a client)."""
  try:
    target = os.stat(os.path.join(_NETNS_DIR, space)).st_ino
  except OSError:
    return
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == os.getpid():
      continue
    try:
      if os.stat(f"/proc/{entry}/ns/net").st_ino == target:
        os.kill(int(entry), signal.SIGKILL)
    except (OSError, ProcessLookupError):
      pass


def _shape(ipr, index, link):
  """The rate of one end of a link (what leaves through it): a token bucket (tc `tbf`)."""
  rate = link.rate / 8                         # bytes/s
  burst = int(max(rate * 2e-3, 128 * 1024))    # 2 ms at the rate, at least two GSO packets
  ipr.tc("add", "tbf", index, handle="1:", rate=f"{int(link.rate)}bit", burst=burst,
         latency="50ms")
