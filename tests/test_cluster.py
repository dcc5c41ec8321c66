"""Stages on several processes: TF servers on 127.0.0.1, a two-process pipeline, a lost task.

Each scenario runs in its own process (tests/cluster_scenarios.py): a
process stays connected to its cluster.
"""

import json
import os
import signal
import socket
import time

import keras
import numpy as np
import pytest

from tests import helpers, zygote
from tfpipe.cluster import local as local_cluster, servers as cluster
import tfpipe

# Multi-process timings: never beside another multi-process test (setup.cfg).
pytestmark = pytest.mark.xdist_group("processes")


def _scenario(*args):
  """A scenario in a process of its own (a fork of `tests.zygote`); its JSON result."""
  result = zygote.run(["-m", "tests.cluster_scenarios", *args], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_two_process_pipeline_equals_one_process():
  result = _scenario("equal")
  for method in ("sequential", "spectrain"):
    assert result[method]["gap"] < 1e-6, method
    # Windows of stage calls on the servers (kept forwards cross as residuals) alike.
    assert result[method]["calls_gap"] < 1e-5, method
    assert "/job:worker/replica:0/task:1" in result[method]["stage1_device"]


def test_stage_weights_move_to_the_client_at_epoch_ends_only_when_a_callback_may_read_them():
  result = _scenario("moved")
  read, blind = result["True"], result["False"]
  # A callback that may read the model sees each epoch's weights.
  assert read["epoch0_moved"] > 1e-3 and read["epoch1_to_end"] == 0
  # One that says it does not: the weights stay on the servers until `fit` ends.
  assert blind["epoch0_moved"] == 0 and blind["end_moved"] > 1e-3
  assert result["runs_gap"] == 0


def test_a_recurrent_stage_on_servers_carries_its_kept_forwards_there_and_equals_one_process():
  result = _scenario("recurrent")
  assert result["gap"] < 1e-6
  # Windows of stage calls (a while loop on a server), their carry parked on the servers, the
  # LSTM loop's lists (variants) among it.
  assert result["inlined"] and not any(result["inlined"])
  assert {"float32", "variant"} <= set(result["parked"])
  # Several window functions park a carry, but a carry lives only until the next window has
  # read it: after each mini-batch one function's variables at most hold one.
  assert result["slots"] > 1 and len(result["held"]) == 12
  assert max(result["held"]) == 1


def test_pipeline_replicas_on_server_processes_equal_keras():
  result = _scenario("replicas")
  assert result["gap"] < 1e-9
  # replica r's stage k on task 2r + k: each replica on two processes of its own
  assert [[d.split("/")[3] for d in devices] for devices in result["stage_devices"]] == [
      ["task:0", "task:2"], ["task:1", "task:3"]]


def test_devices_the_cluster_lacks_are_refused_before_training():
  result = _scenario("refuse")
  task, job, breakdown = result["messages"]
  assert "names task 2 of job 'worker', which has 2 tasks in the cluster spec" in task
  assert "names job 'ps', which the cluster spec does not have" in job
  # A compiled run on servers trains, records nothing, and its breakdown says why.
  assert result["records"] == 0
  assert result["window"] == tfpipe.Pipeline.AUTO_REMOTE_WINDOW   # remote calls: longer windows
  assert "stages on TF servers (/job:worker/replica:0/task:0" in breakdown
  assert "executor='threaded'" in breakdown


def test_a_dead_worker_stops_training_with_its_name_and_keeps_checkpoints(tmp_path):
  result = _scenario("dead", str(tmp_path))
  assert result["error"] and result["error"].startswith("lost /job:worker/task:1 (127.0.0.1:")
  assert result["seconds"] < 30                 # bounded: no hang
  assert result["latest"] == result["good"]     # the last good checkpoint is untouched
  assert result["unreachable"] == [["worker", 1]]


def test_a_hung_worker_is_named_within_seconds_and_training_stops():
  result = _scenario("hung")
  assert result["error"] and result["error"].startswith("lost /job:worker/task:1 (127.0.0.1:")
  assert "stopped answering (hung or stopped) and was killed" in result["error"]
  assert result["seconds"] < 10


def test_lost_workers_are_restarted_and_training_ends_as_if_uninterrupted(tmp_path):
  # Worker 1 killed (kill -9) at the end of epoch 0 before its checkpoint and in epoch 1,
  # frozen (SIGSTOP) in epoch 2; max_restarts=3; the data a reshuffling dataset.
  result = _scenario("restarts", str(tmp_path))
  assert result["faults_left"] == 0
  assert [line.split(";")[0] for line in result["restarts"]] == [
      f"restart {n} of 3: lost /job:worker/task:1" for n in (1, 2, 3)]
  assert all("/job:worker/task:1 started again" in line for line in result["restarts"])
  assert result["restarts"][0].endswith(
      "no checkpoint yet: starting again from the weights fit started from")
  assert all(line.endswith("resuming from the newest checkpoint")
             for line in result["restarts"][1:])
  assert result["epochs"] == [0, 1, 2]
  np.testing.assert_allclose(result["losses"], result["expected"], rtol=1e-6)
  assert result["relative_gap"] < 1e-6


def test_restarts_need_a_checkpoint_and_replayable_data_or_a_function_that_builds_it():
  from tfpipe.training import restarts
  with pytest.raises(ValueError, match="max_restarts=2 resumes from the newest checkpoint"):
    restarts.check(2, 60.0, [], np.zeros((4, 8)))
  saver = [tfpipe.checkpoint.BackupAndRestore("unused")]
  with pytest.raises(ValueError, match="which a generator cannot give twice"):
    restarts.check(1, 60.0, saver, (b for b in helpers.batches(2)))
  with pytest.raises(ValueError, match="`max_restarts` must be an integer >= 0. Received: -1"):
    restarts.check(-1, 60.0, saver, None)
  with pytest.raises(ValueError, match="`restart_timeout` must be a positive number"):
    restarts.check(1, 0, saver, None)
  restarts.check(0, 60.0, [], None)   # no restarts: nothing asked
  # A function that builds the data is called for each attempt: even a generator replays.
  restarts.check(1, 60.0, saver, lambda: (b for b in helpers.batches(2)))
  assert restarts.made(lambda: "built") == "built" and restarts.made("data") == "data"
  with pytest.raises(ValueError, match="so `y` must be None. Received: y of type ndarray"):
    restarts.check(0, 60.0, [], lambda: None, np.zeros(4))
  with pytest.raises(ValueError, match="it returned None, not data"):
    restarts.made(lambda: None)


def test_a_task_lost_again_while_the_stages_are_built_takes_one_more_restart(monkeypatch):
  from tfpipe.training import restarts
  lost = cluster.WorkerLost("lost", [("worker", 1, "host:1")])
  rebuilt, attempts = [], []

  def rebuild(pipe, which, timeout):
    rebuilt.append(which)
    done = "/job:worker/task:1 started again"
    if len(rebuilt) == 1:   # the link went down again while the stages were built
      return done, cluster.WorkerLost("lost again", [("worker", 1, "host:1")])
    return done, None

  def attempt():
    attempts.append(1)
    if len(attempts) == 1:
      raise lost
    history = keras.callbacks.History()
    history.epoch = []
    return history

  class Pipe:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

  monkeypatch.setattr(restarts, "_rebuild", rebuild)
  history = restarts.fit(Pipe(), attempt, max_restarts=3, timeout=5.0)
  assert len(attempts) == 2 and rebuilt[0] is lost
  assert history.restarts[0] == ("restart 1 of 3: lost /job:worker/task:1; lost "
                                 "/job:worker/task:1 again while the stages were built")
  assert history.restarts[1].startswith("restart 2 of 3: lost /job:worker/task:1; /job:worker/"
                                        "task:1 started again, stages built again in")
  with pytest.raises(cluster.WorkerLost, match="lost again"):   # no restart left for it
    rebuilt.clear()
    attempts.clear()
    restarts.fit(Pipe(), attempt, max_restarts=1, timeout=5.0)


def test_a_lost_task_this_process_did_not_start_is_waited_for_then_named():
  from tfpipe.cluster import recovery
  address = f"127.0.0.1:{local_cluster.free_port()}"   # nothing listens there
  lost = cluster.WorkerLost("lost", [("worker", 7, address)])
  start = time.monotonic()
  with pytest.raises(cluster.WorkerLost, match=r"/job:worker/task:7 \(127\.0\.0\.1:\d+\) did "
                     r"not answer again within 1 s .*this process did not start its server") as e:
    recovery.recover(lost, timeout=1.0)
  assert e.value.tasks == [("worker", 7, address)]
  assert time.monotonic() - start >= 1.0   # it waited out the timeout before naming the task


def _listening(port):
  """(table, local address) of the sockets listening on `port` (/proc/net/tcp, tcp6)."""
  found = []
  for table in ("tcp", "tcp6"):
    with open(f"/proc/net/{table}") as f:
      for line in f.read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
          found.append((table, fields[1].split(":")[0]))
  return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket tables")
def test_local_servers_listen_on_127_0_0_1_only_and_die_with_their_parent():
  # A parent process starts two servers, reports them, and is killed with SIGKILL.
  code = ("import json, os, time; from tfpipe import cluster; "
          "c = cluster.LocalCluster({'worker': 2}); "
          "print(json.dumps({'spec': c.spec, 'pids': [p.pid for p in c.processes.values()]}), "
          "flush=True); time.sleep(300)")
  parent = zygote.start(["-c", code])
  try:
    started = json.loads(parent.stdout.readline())
    ports = [int(a.rpartition(":")[2]) for a in started["spec"]["worker"]]
    loopback = {("tcp", "0100007F"), ("tcp6", "0000000000000000FFFF00000100007F")}
    for port in ports:
      assert _listening(port) and set(_listening(port)) <= loopback, _listening(port)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    alive = started["pids"]
    while alive and time.monotonic() < deadline:
      alive = [pid for pid in alive if _alive(pid)]
      time.sleep(0.1)
    assert alive == []                                  # no orphans
    assert all(_listening(port) == [] for port in ports)
  finally:   # the test's own process group: nothing outlives it
    if parent.poll() is None:
      os.killpg(parent.pid, signal.SIGKILL)
      parent.wait()


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_a_server_whose_port_is_taken_says_which_address():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    address = f"127.0.0.1:{taken.getsockname()[1]}"
    result = zygote.run(
        ["-m", "tfpipe.cluster", f"--spec={json.dumps({'worker': [address]})}",
         "--job=worker", "--task=0"], timeout=120)
  assert result.returncode == 1
  assert f"could not listen at {address} (/job:worker/task:0)" in result.stderr


def test_a_local_server_that_is_not_ready_in_time_is_named_with_its_deadline():
  # Its launcher imports TensorFlow for longer than that: the deadline passes first.
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=r"the server of /job:worker/task:0 at 127\.0\.0\.1:\d+ "
                                         r"did not start \(not ready after 0\.5 s\)"):
    local_cluster.LocalCluster({"worker": 2}, timeout=0.5)
  assert time.monotonic() - start < 10   # the deadline, then stopping what had started
  assert local_cluster.RUNNING == []


def test_tf_config_is_read_and_checked():
  spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
  assert cluster.from_tf_config({"TF_CONFIG": json.dumps({"cluster": spec})}) == spec
  with pytest.raises(ValueError, match="TF_CONFIG is not set"):
    cluster.from_tf_config({})
  with pytest.raises(ValueError, match="must be JSON with a \"cluster\" entry"):
    cluster.from_tf_config({"TF_CONFIG": "{}"})
  with pytest.raises(ValueError, match="jobs must map job names to task counts"):
    local_cluster.LocalCluster({"worker": 0})


def test_multi_worker_mirrored_data_parallelism_across_two_processes():
  addresses = ",".join(f"127.0.0.1:{local_cluster.free_port()}" for _ in range(2))
  workers = [zygote.start(["-m", "tests.cluster_scenarios", "mwms", addresses, str(i)])
             for i in range(2)]
  ends = [worker.communicate(timeout=300) for worker in workers]
  # Worker 0 ends its training only after worker 1 has exited (`cluster_scenarios.mwms`).
  assert [worker.returncode for worker in workers] == [0, 0], "\n".join(
      f"worker {i}: {err[-2000:]}" for i, (_, err) in enumerate(ends))
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in ends]
  assert [r["workers"] for r in results] == [2, 2]
  assert results[0]["loss"] == results[1]["loss"]            # one synchronous training
  assert results[0]["checksum"] == results[1]["checksum"]
  assert results[0]["gap_to_single"] < 1e-5                    # = one device, global batch
  # Per-token losses with dict inputs: Keras's mean over every token, the same update.
  assert results[0]["lm_loss"] == pytest.approx(results[0]["lm_keras_loss"], rel=1e-5)
  assert results[0]["lm_gap_to_single"] < 1e-5


def test_liveness_settings_are_checked_and_kept():
  before = dict(cluster.LIVENESS)
  try:
    cluster.set_liveness(interval=0.5, timeout=1.0, misses=4)
    assert cluster.LIVENESS == {"interval": 0.5, "timeout": 1.0, "misses": 4}
    for bad, name in (({"misses": 0}, "misses=0"), ({"timeout": -1}, "-1"),
                      ({"interval": True}, "True")):
      with pytest.raises(ValueError, match=name):
        cluster.set_liveness(**bad)
  finally:
    cluster.set_liveness(**before)
