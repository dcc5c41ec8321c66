"""A cluster of TF servers on emulated hosts: one server per host, links shaped.

  with tfpipe.cluster.EmulatedCluster({"worker": 4}, link="100mbit") as cluster:
    cluster.enter_client()     # this program on the client host, before TensorFlow's threads
    devices = tfpipe.cluster.connect(cluster.spec)
    ...
    cluster.counters()         # bytes each host sent and received over its link
    with cluster.watch_links():   # names a host whose connections lose packets
      ...

Each task of `jobs` gets a host of its own (`tfpipe.cluster.emulation.Network`:
a network namespace, a link of shape `link`, a memory cap and a CPU set), its
server started there as `LocalCluster` starts them (one launcher, a fork per
task), at the host's address, port 2222. The program that drives the run is
the client, a host of its own too (`enter_client`, or `popen` for a program
started there). Leaving the `with` block stops the servers and removes every
namespace, link and control group.
"""

import sys

from tfpipe.cluster import allocator, emulation, link_watch, local

__all__ = ["EmulatedCluster"]


class EmulatedCluster:
  """TF servers for `jobs` ({job: task count}) on hosts of their own joined by links of shape
  `link` ("RATE[,DELAY[,LOSS%]]"); `memory` (bytes) and `cpus` (cpuset strings, one per task
  in `jobs` order, or one for all) cap each host (and its server's BFC allocator);
  `mmap_threshold`, `cpu_allocator`: the servers' (`local.LocalCluster`). `spec` is the
  cluster spec, `hosts` maps (job, task) to its `emulation.Host`, `network` is the
  `emulation.Network`."""

  def __init__(self, jobs, link="10gbit", client_link=None, memory=None, cpus=None,
               timeout=60.0, mmap_threshold=allocator.MMAP_THRESHOLD, cpu_allocator=None):
    if not isinstance(jobs, dict) or not jobs or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in jobs.values()):
      raise ValueError(f"jobs must map job names to task counts >= 1. Received: {jobs!r}")
    self.network = emulation.Network(sum(jobs.values()), link=link, client_link=client_link,
                                      memory=memory, cpus=cpus)
    try:
      hosts = iter(self.network.hosts)
      self.hosts = {(job, task): next(hosts) for job, n in jobs.items() for task in range(n)}
      self.servers = local.LocalCluster(jobs, timeout=timeout, places=self.hosts,
                                          mmap_threshold=mmap_threshold,
                                          cpu_allocator=cpu_allocator)
    except BaseException:
      self.network.close()
      raise
    self.spec = self.servers.spec
    self.processes = self.servers.processes

  @property
  def client(self):
    return self.network.client

  def enter_client(self):
    """Moves this program onto the client host (see `emulation.enter`)."""
    emulation.enter(self.network.client.netns)

  def popen(self, argv, host=None, **kwargs):
    """A program on `host` ((job, task), or None: the client), as `subprocess.Popen`."""
    return self.network.popen(self.network.client if host is None else self.hosts[host], argv,
                              **kwargs)

  def counters(self):
    """{(job, task) or "client": (bytes sent, bytes received)} over each host's link."""
    raw = self.network.counters()
    out = {key: raw[host.name] for key, host in self.hosts.items()}
    out["client"] = raw["client"]
    return out

  def watch_links(self, on_lossy=None, **options):
    """A `link_watch.LinkWatch` over the hosts (a context manager): by default it names, on
    stderr, a host whose TCP connections retransmit (a lossy link), and again once they
    stop."""
    names = {f"/job:{job}/task:{task} (emulated host {host.name})": host.netns
             for (job, task), host in self.hosts.items()}
    return link_watch.LinkWatch(names, on_lossy or _say_lossy, **options)

  def kill(self, job, task):
    self.servers.kill(job, task)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    try:
      self.servers.stop()
    finally:
      self.network.close()


def _say_lossy(name, share):
  if share is None:
    print(f"tfpipe: {name}: its connections no longer retransmit", file=sys.stderr, flush=True)
  else:
    print(f"tfpipe: {name}: its connections retransmit {share:.1%} of their TCP segments (a "
          "lossy link); training goes on", file=sys.stderr, flush=True)
