"""--cluster=emulated:R,K,LINK: a run on hosts emulated on this machine.

R x K hosts (R replicas of a K-stage pipeline; for asgd R workers and K
parameter servers), each a network namespace with one TF server, joined by
links of shape LINK ("RATE[,DELAY[,LOSS%]]", e.g. 100mbit), and this program
on a client host of its own (`tfpipe.cluster.EmulatedCluster`; root only).
The summary adds the bytes each host sent and received per step, and the busiest
link's share of a step.
"""

import contextlib

__all__ = ["parse", "cluster", "run_workers", "counting", "PREFIX", "HUB_VARIABLE", "RATE_VARIABLE"]

PREFIX = "emulated:"
HUB_VARIABLE = "TFPIPE_EMULATED_HUB"   # worker 0 of run_workers: the links' namespace
RATE_VARIABLE = "TFPIPE_EMULATED_RATE"   # and their rate, bits/s


def counting(tools):
  """In worker 0 of `run_workers`: `tools.traffic` counts the bytes on every worker's link."""
  import json
  import os
  from tfpipe.cluster import emulation
  from tfpipe.instruments import traffic
  hub = os.environ.get(HUB_VARIABLE)
  if hub:
    rate = float(os.environ.get(RATE_VARIABLE) or 0) or None
    tools.traffic = traffic.LinkTraffic(lambda: {
        ("worker", int(name[1:])): value for name, value in emulation.hub_counters(hub).items()
        if name != "client"}, rate=rate)
    tools.hosts = {("worker", i): address for i, address in
                   enumerate(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])}


def parse(text):
  """(R, K, link) of "emulated:R,K,LINK"."""
  from tfpipe.cluster import links
  parts = text[len(PREFIX):].split(",")
  usage = ("--cluster=emulated:R,K,LINK: R replicas of K stages (asgd: R workers, K parameter "
           "servers) on hosts joined by links LINK (\"RATE[,DELAY[,LOSS%]]\"), e.g. "
           f"emulated:1,2,100mbit. Received: {text!r}")
  if len(parts) < 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts[:2]):
    raise ValueError(usage)
  link = ",".join(parts[2:])
  try:
    links.parse(link)
  except ValueError as e:
    raise ValueError(f"{e}. {usage}") from None
  return int(parts[0]), int(parts[1]), link


@contextlib.contextmanager
def cluster(config, tools):
  """Starts the emulated hosts and their servers and moves this program onto the client host;
  yields the stages' devices (for asgd: the cluster spec). `tools.traffic` then counts the
  bytes on the links."""
  import tfpipe
  from tfpipe.cluster import links
  from tfpipe.instruments import traffic
  replicas, stages, link = parse(config.cluster)
  kind = tfpipe.methods.kind(config.method)
  if kind.parameter_servers:
    jobs = {"worker": replicas, "ps": stages}
  else:
    if config.layout == "auto":
      pass   # the layout is chosen on these R x K hosts
    elif replicas != config.data_parallel:
      raise ValueError(f"--cluster={config.cluster} places {replicas} replica(s), but "
                       f"--data_parallel={config.data_parallel}")
    elif not config.devices and stages != config.num_stages:
      raise ValueError(f"--cluster={config.cluster} places {stages} stage(s) per replica, but "
                       f"--num_stages={config.num_stages}")
    jobs = {"worker": replicas * stages}
  with tfpipe.cluster.EmulatedCluster(jobs, link=link) as emulated:
    emulated.enter_client()   # before TensorFlow's remote threads: its sockets are there
    tools.traffic = traffic.LinkTraffic(emulated.counters, rate=links.parse(link).rate)
    tools.hosts = {(job, task): address for job, addresses in emulated.spec.items()
                   for task, address in enumerate(addresses)}
    if config.verbose:
      print(f"started {sum(jobs.values())} emulated hosts joined by {link} links: "
            f"{', '.join(a for addresses in emulated.spec.values() for a in addresses)}; "
            f"this program at {emulated.client.address}", flush=True)
    with emulated.watch_links():
      if kind.parameter_servers:
        yield emulated.spec
      else:
        yield config.devices or tfpipe.cluster.connect(emulated.spec)


def run_workers(config, flag_values):
  """--method=dataparallel --cluster=emulated:R,1,LINK: R MultiWorkerMirroredStrategy workers,
  each this trainer with --cluster=tf_config on a host of its own; worker 0's output is this
  program's, the bytes on every worker's link per step included (`counting`). Returns worker
  0's exit code (the first non-zero one if another failed)."""
  import json
  import os
  import subprocess
  import sys
  import tempfile
  from tfpipe.cluster import emulation, links
  from trainers.instruments import TRACE_DONE_VARIABLE
  replicas, stages, link = parse(config.cluster)
  if stages != 1:
    raise ValueError(f"--method={config.method} --cluster=emulated:R,1,LINK runs R workers of "
                     f"the whole model. Received: {config.cluster!r}")
  lines = [line for line in flag_values.flags_into_string().splitlines()
           if not line.startswith(("--cluster=", "--flagfile="))]
  with emulation.Network(replicas, link=link) as network, \
       tempfile.NamedTemporaryFile("w", suffix=".cfg") as flagfile, \
       tempfile.TemporaryDirectory(prefix="tfpipe_workers_") as shared:
    flagfile.write("\n".join(lines + ["--cluster=tf_config"]) + "\n")
    flagfile.flush()
    addresses = [f"{host.address}:2222" for host in network.hosts]
    if config.verbose:
      print(f"started {replicas} emulated hosts joined by {link} links, a "
            f"MultiWorkerMirroredStrategy worker each: {', '.join(addresses)}", flush=True)
    workers, errors = [], []
    for index, host in enumerate(network.hosts):
      env = dict(os.environ, TF_CONFIG=json.dumps(
          {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}))
      # --transfer_share: worker 0 says here when its trace of every host has ended.
      env[TRACE_DONE_VARIABLE] = os.path.join(shared, "trace_done")
      if index == 0:   # it counts the bytes on the links (`counting`)
        env[HUB_VARIABLE], env[RATE_VARIABLE] = network.hub, str(links.parse(link).rate)
      errors.append(tempfile.TemporaryFile("w+"))
      workers.append(network.popen(host, [sys.executable, "-m", "trainers.main",
                                          f"--flagfile={flagfile.name}"], env=env,
                                   stdout=None if index == 0 else subprocess.DEVNULL,
                                   stderr=None if index == 0 else errors[-1]))
    codes = [w.wait() for w in workers]
    for index, code in enumerate(codes[1:], 1):
      if code:
        errors[index].seek(0)
        print(f"worker {index} exited with code {code}: {errors[index].read()[-2000:]}",
              file=sys.stderr)
    return codes[0] or next((c for c in codes if c), 0)
