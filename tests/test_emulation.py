"""Emulated hosts: network namespaces, shaped links, memory caps, and stages across them.

The cluster (two TF servers on hosts of their own, and a client host) is made
once for the module; each scenario runs in a process of its own on the
client's host (tests/emulation_scenarios.py).
"""

import json
import os
import re
import subprocess
import sys
from unittest import mock

import pytest

from tests import helpers, zygote
from tfpipe.cluster import cgroups, emulation, links
from tfpipe.cluster import servers as cluster
import tfpipe

# No xdist group: nothing here asserts a timing, so these spread over the workers (each
# worker makes its own hosts; their names carry its PID).


needs_hosts = helpers.needs_hosts


@pytest.mark.parametrize("text,rate,delay,loss", [
    ("1gbit", 1e9, 0.0, 0.0), ("100mbit,2ms", 1e8, 2e-3, 0.0), ("10gbit,200us,1%", 1e10, 2e-4, 0.01),
    ("2.5 Gbit", 2.5e9, 0.0, 0.0), ("512kbit,,0.5%", 512e3, 0.0, 0.005)])
def test_links_are_read_as_tc_writes_them(text, rate, delay, loss):
  link = links.parse(text)
  assert (link.rate, link.delay, link.loss) == pytest.approx((rate, delay, loss))
  assert links.parse(str(link)) == link


@pytest.mark.parametrize("text,message", [
    ("", "RATE"), ("fast", "'fast' is not a rate"), ("1gbyte", "'1gbyte' is not a rate"),
    ("0mbit", "the rate must be > 0"), ("1gbit,2", "'2' is not a delay"),
    ("1gbit,2ms,150%", "'150%' is not a loss"), ("1gbit,1ms,1%,x", "at most a rate")])
def test_bad_links_are_refused_naming_the_value(text, message):
  with pytest.raises(ValueError, match=message):
    links.parse(text)


def test_without_root_emulated_hosts_are_refused_in_one_line():
  with mock.patch.object(os, "geteuid", return_value=1000):
    with pytest.raises(emulation.EmulationUnavailable) as raised:
      emulation.Network(1)
  assert "need root" in str(raised.value) and "uid 1000" in str(raised.value)
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize("spec,address,expected", [
    ({"worker": ["127.0.0.1:5"]}, "198.18.0.9:7000", "198.18.0.9:7000"),
    ({"worker": ["127.0.0.1:5"], "localhost": ["198.18.0.7:7001"]}, None, "198.18.0.7:7001")])
def test_the_client_joins_at_the_address_given_or_the_specs(spec, address, expected):
  assert cluster.client_address(spec, address) == expected


def test_the_client_joins_at_the_route_to_the_first_task_on_a_free_port():
  host, port = cluster.client_address({"worker": ["127.0.0.1:5"]}).split(":")
  assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_a_client_address_not_on_this_machine_is_refused():
  with pytest.raises(ValueError, match="'198.19.255.254' is not one of this machine's"):
    cluster.client_address({"worker": ["127.0.0.1:5"]}, "198.19.255.254")


@pytest.fixture(scope="module")
def hosts():
  with tfpipe.cluster.EmulatedCluster({"worker": 2}, link="1gbit") as emulated:
    yield emulated


def _scenario(emulated, name, *args):
  result = zygote.run(["-m", "tests.emulation_scenarios", name, emulated.client.netns,
                       json.dumps(emulated.spec), *args], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@needs_hosts
def test_stages_on_hosts_that_share_no_loopback_train_as_on_local_devices(hosts):
  before = hosts.counters()
  result = _scenario(hosts, "pipeline")
  after = hosts.counters()
  assert result["gap"] < 1e-6
  assert "/job:worker/replica:0/task:1" in result["stage1_device"]
  sent = {key: after[key][0] - before[key][0] for key in after}
  # Host 0 sent at least the cut's float32 activations, host 1 their gradients; the client
  # sent the inputs (8 floats a sample) to host 0 at least.
  activations = result["samples"] * result["width"] * 4
  assert sent[("worker", 0)] >= activations and sent[("worker", 1)] >= activations
  assert sent["client"] >= result["samples"] * 8 * 4


@needs_hosts
@pytest.mark.parametrize("executor", ["calls", "inlined"])
def test_kept_forwards_carried_between_windows_stay_on_their_host(hosts, executor):
  before = hosts.counters()
  result = _scenario(hosts, "carried", executor)
  after = hosts.counters()
  assert result["gap"] < 1e-6
  client = sum(after["client"]) - sum(before["client"])
  # SpecTrain carries stage 0's predicted weights into each next window. Kept on their host,
  # the client's link carries the model out and back once, the inputs and the functions
  # (measured: 5.3 MB with windows of calls, 4.4 inlined); through the client, twice stage
  # 0's weights more per window (36.6 and 14.4 MB).
  carried_through_client = 2 * result["stage0_bytes"] * result["windows"]
  assert client < 2 * result["model_bytes"] + carried_through_client / 2, (client, result)


@needs_hosts
def test_data_parallel_replicas_across_hosts_keep_their_own_weights_by_default_and_equal_keras():
  with tfpipe.cluster.EmulatedCluster({"worker": 6}, link="10gbit") as six:
    result = _scenario(six, "replicas", six.network.hub)
    recurrent = _scenario(six, "recurrent_replicas", six.network.hub)
  ring, central = result["default"], result["reduce_to_one_device"]
  assert ring["mirrored"] == [True, True] and central["mirrored"] == [False, False]
  assert ring["gap"] < 1e-5 and central["gap"] < 1e-5   # Keras at the global batch
  # Replica r's copy of stage k lives on replica r's own host (task 2r + k).
  for k, devices in enumerate(ring["mirror_devices"]):
    assert [d.split("/")[3] for d in devices] == [f"task:{2 * r + k}" for r in (1, 2)]
  # Each host's bytes were counted over its link, every step.
  assert ring["steps"] == central["steps"] == 8
  assert all(ring["sent"][f"h{t}"] > 0 for t in range(6))
  # With the ring no host sends more than its stage's ring bound, 2 (R-1)/R of the stage's
  # weights, besides its activations (a few kB a step here) and the protocol's overhead;
  # replica 0's host under the reduction sends the weights to the others, over that bound.
  bound_of = lambda run, k: 2 * 2 / 3 * run["stage_bytes"][k] * 1.15 + 100e3
  for t in range(6):
    assert ring["sent"][f"h{t}"] <= bound_of(ring, t % 2), (t, ring["sent"])
  assert central["sent"]["h0"] > bound_of(ring, 0)
  # A stage that runs a while loop (an LSTM over 24 steps) on the same hosts: equal to Keras,
  # and within twice that bound (its tasks are calls on the first replica's host, which also
  # hands the others their inputs: measured 247 kB a step against a bound of 253 kB). From
  # the called forward's residuals, a replica's loop ran its steps from the first replica's
  # host (27 MB a step); each replica's backward is now recomputed on its own host (a
  # zero-bubble backward's two halves each).
  for method, run in recurrent.items():
    assert run["stage_layers"][0][-1] == "recurrent" and run["gap"] < 1e-5, method
    for t in range(6):
      assert run["sent"][f"h{t}"] <= 2 * bound_of(run, t % 2), (method, t, run)


def _run_in(netns, *argv):
  return subprocess.run(["ip", "-n", netns, *argv], capture_output=True, text=True, check=True).stdout


@needs_hosts
def test_hosts_have_their_own_link_only_and_nothing_routes_out(hosts):
  for host in list(hosts.hosts.values()) + [hosts.client]:
    assert host.address.startswith("198.18.")
    routes = _run_in(host.netns, "-4", "route", "show").strip().splitlines()
    assert routes == [f"198.18.0.0/24 dev eth0 proto kernel scope link src {host.address}"]
  qdiscs = subprocess.run(["tc", "-n", hosts.network.hub, "qdisc", "show"], capture_output=True,
                          text=True, check=True).stdout
  assert qdiscs.count("rate 1Gbit") == 3   # each host's link, the client's included


@needs_hosts
def test_the_machines_own_interfaces_are_untouched_and_a_closed_network_leaves_nothing():
  own = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
  with emulation.Network(1, link="100mbit") as network:
    names = [network.hub, network.client.netns, network.hosts[0].netns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(name in listed for name in names)
  assert subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout == own
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert not any(name in listed for name in names)


@needs_hosts
def test_what_a_killed_run_left_is_removed_at_the_next_start():
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  run = f"tfpipe-{dead.pid}-0"
  subprocess.run(["ip", "netns", "add", f"{run}-hub"], check=True)
  cgroups.Group(f"{run}-h0", memory=1 << 30)
  with emulation.Network(1):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{run}-hub" not in listed
    assert f"{run}-h0" not in cgroups.names("tfpipe-")


@needs_hosts
def test_a_host_over_its_memory_cap_is_killed_and_its_peak_and_usage_are_read():
  allocate = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096])"
  with emulation.Network(1, memory=96 << 20) as network:
    host = network.hosts[0]
    small = network.popen(host, [sys.executable, "-c", allocate, "32"])
    assert small.wait(timeout=60) == 0
    assert host.group.peak() >= 32 << 20
    assert 0 <= host.group.usage() <= host.group.peak()
    big = network.popen(host, [sys.executable, "-c", allocate, "256"])
    assert big.wait(timeout=60) == -9   # the kernel's OOM killer, as on a host that ran out


@needs_hosts
def test_a_capped_hosts_server_refuses_a_tensor_past_its_cap_by_name_and_serves_on():
  # Its BFC allocator takes the host's cap as its limit: TensorFlow's out-of-memory error
  # naming the op and the allocator, where the host would kill the server.
  with tfpipe.cluster.EmulatedCluster({"worker": 1}, link="1gbit", memory=384 << 20) as capped:
    assert capped.servers.cpu_allocator == "bfc"
    result = _scenario(capped, "allocate", "512")
    assert capped.processes[("worker", 0)].poll() is None
  kind, message = result["big"]
  assert kind == "ResourceExhaustedError", result
  assert "OOM when allocating tensor with shape[134217728]" in message
  assert "bfc" in message
  assert result["small"] == [None, 262144.0], result


def _trainer(*args):
  env = dict(os.environ, TFDS_DATA_DIR=os.path.join(zygote.ROOT, "tests", "no_such_data_dir"))
  return zygote.run(["-m", "trainers.main", "--snn_width=16", "--snn_depth=3",
                     "--batch_size=16", "--steps=3", "--logdir=", *args], env=env)


@needs_hosts
@pytest.mark.parametrize("method,cluster,started", [
    ("1f1b", "emulated:1,2,1gbit,200us,0.1%",   # with delay and loss
     "started 2 emulated hosts joined by 1gbit,200us,0.1% links"),
    ("dataparallel", "emulated:2,1,1gbit", "a MultiWorkerMirroredStrategy worker each"),
    ("asgd", "emulated:1,1,1gbit", "started 2 emulated hosts joined by 1gbit links")])
def test_the_trainer_runs_on_emulated_hosts_and_gives_each_hosts_bytes_per_step_and_time(
    method, cluster, started):
  result = _trainer(f"--method={method}", f"--cluster={cluster}", "--transfer_share")
  assert result.returncode == 0, result.stderr[-3000:]
  assert started in result.stdout
  line = next(l for l in result.stdout.splitlines() if l.startswith("bytes on the links"))
  sent = [float(m) for m in re.findall(r"(?:worker|ps)/\d ([\d.e+-]+)/", line)]
  assert len(sent) == 2 and all(s > 0 for s in sent)
  if method == "asgd":
    # Its steps report as their results arrive, after their traffic: the epoch is counted from
    # its start. A step reads the weights from the parameter server once and sends it their
    # gradients (the update runs there): each way at least the weights' bytes, and under 3x
    # (the update on the worker sent 3.7x). Counted between step ends, a step held control
    # bytes only (0.1-0.2 KB).
    assert "over 3 steps of the last epoch, counted from its start" in line, line
    weights = 4 * (64 * 16 + 16 + 2 * (16 * 16 + 16) + 16 * 10 + 10)   # digits, 3 x 16 units
    assert weights <= 1e6 * sent[0] <= 3 * weights, (weights, line)   # the parameter server
    assert weights <= 1e6 * sent[1], (weights, line)                  # the worker
  # The busiest link's bytes at 1 Gbit/s as a share of a step.
  busy = re.search(r"the busiest link busy ([\d.e+-]+)% of a step \(its bytes at 1000 Mbit/s",
                   line)
  assert busy and 0 < float(busy.group(1)) <= 100, line
  if method == "1f1b":
    assert re.search(r"^1\s+/job:worker/replica:0/task:1/device:CPU:0\s", result.stdout, re.M)
  # --transfer_share: every host's server traced over one more epoch.
  traced = next(l for l in result.stdout.splitlines() if l.startswith("time on each host"))
  shares = re.findall(r"(worker|ps)/\d computing ([\d.e+-]+)%, waiting on transfers "
                      r"([\d.e+-]+)%, idle ([\d.e+-]+)%", traced)
  assert len(shares) == 2, traced
  for _, *parts in shares:
    assert 98 <= sum(float(p) for p in parts) <= 102, traced   # each rounded to 2 digits
  assert any(float(computing) > 0 for _, computing, _, _ in shares), traced
  if method in ("dataparallel", "asgd"):
    # Each step all-reduces (data parallelism) or reads the weights and sends the gradients
    # (asgd's worker): a transfer pending on each, or on the worker, is found in the trace.
    waits = [float(w) for job, _, w, _ in shares if job == "worker"]
    assert waits and all(w > 0 for w in waits), traced


@needs_hosts
def test_the_trainer_chooses_the_layout_on_emulated_hosts_and_trains_it():
  result = _trainer("--method=1f1b", "--layout=auto", "--cluster=emulated:1,2,1gbit",
                    "--partition=uniform")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "layouts over 2 hosts, links" in result.stdout
  chosen = re.search(r"^--layout=auto chose (.+): \d+ samples/s predicted$", result.stdout, re.M)
  assert chosen and chosen.group(1) in ("1f1b K=2 M=4", "data parallel R=2")
  assert "bytes on the links" in result.stdout


@pytest.mark.parametrize("args,message", [
    (("--method=1f1b", "--cluster=emulated:1,x,1gbit"), "--cluster=emulated:R,K,LINK"),
    (("--method=1f1b", "--cluster=emulated:1,2,fast"), "'fast' is not a rate"),
    (("--method=1f1b", "--cluster=emulated:2,2,1gbit"), "places 2 replica(s), but --data_parallel=1"),
    (("--method=1f1b", "--cluster=emulated:1,3,1gbit"), "places 3 stage(s) per replica, but --num_stages=2"),
    (("--method=dataparallel", "--cluster=emulated:2,2,1gbit"), "runs R workers of the whole model"),
    (("--method=spectrain", "--layout=auto", "--cluster=emulated:1,2,1gbit"),
     "lays out a synchronous schedule"),
    (("--method=1f1b", "--layout=auto"), "chooses among the hosts of a --cluster; none was given"),
    (("--method=1f1b", "--transfer_share"), "--transfer_share traces the TF servers of emulated"),
    (("--method=1f1b", "--layout=auto", "--cluster=local:2", "--micro_batches=2",
      "--partition=params"), "leave --micro_batches=2, --partition=params unset")])
def test_the_trainers_emulated_cluster_flag_is_checked_before_any_host_starts(args, message):
  result = _trainer(*args)
  assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr


@needs_hosts
def test_the_trainer_joins_a_tf_config_cluster_on_other_hosts_at_the_address_given(hosts):
  """--cluster=tf_config from the client's host, --client_address: it joins there, where the
  servers reach it (without the flag: the route's address, as `connect` above)."""
  address = hosts.client.address
  env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": hosts.spec}),
             TFDS_DATA_DIR=os.path.join(zygote.ROOT, "tests", "no_such_data_dir"))
  argv = [sys.executable, "-m", "trainers.main", "--method=1f1b", "--cluster=tf_config",
          "--snn_width=16", "--snn_depth=3", "--batch_size=16", "--steps=3", "--logdir=",
          f"--client_address={address}"]
  trainer = hosts.popen(argv, cwd=zygote.ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
  out, err = trainer.communicate(timeout=300)
  assert trainer.returncode == 0, err[-3000:]
  assert re.search(r"^1\s+/job:worker/replica:0/task:1/device:CPU:0\s", out, re.M)
  # The flag is what it joins at: an address that is not the client's is refused by name.
  bad = hosts.popen(argv[:-1] + ["--client_address=198.19.255.254"], cwd=zygote.ROOT, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  _, err = bad.communicate(timeout=300)
  assert bad.returncode == 2 and "'198.19.255.254' is not one of this machine's" in err, err
