"""The RPC-level probe and the watchdog, against stand-in servers on 127.0.0.1.

A stand-in "gRPC server" answers the HTTP/2 preface with a SETTINGS frame
as a TF server does; a "stopped" one accepts connections (the kernel does)
and never answers, as a SIGSTOPped or hung server does. Real servers:
tests/test_cluster.py.
"""

import socket
import threading
import time

import pytest

from tfpipe.cluster import liveness, servers as cluster

# Multi-process timings: never beside another multi-process test (setup.cfg).
pytestmark = pytest.mark.xdist_group("processes")


def test_this_files_tests_run_on_one_worker_beside_no_other_multi_process_test(request):
  # pytest-xdist's --dist loadgroup tags a grouped test's id with its group and hands each
  # group to one worker; where it cannot tag it (pytest 9 with pytest-xdist 3.8), the groups
  # are silently spread over the workers.
  if not hasattr(request.config, "workerinput"):
    pytest.skip("not run by a pytest-xdist worker")
  assert request.config.getvalue("loadgroup"), "setup.cfg's --dist loadgroup is not in force"
  assert request.node.nodeid.endswith("@processes"), (
      f"pytest-xdist did not group {request.node.nodeid}: see setup.py's test extra")


class StandIn:
  """A listening socket on 127.0.0.1 that answers like a gRPC server while `answering`, `lag`
  seconds after a connection comes."""

  def __init__(self, answering=True):
    self.answering, self.lag = answering, 0.0
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.sock.listen(16)
    self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
    self.held, self.closed = [], False
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    while not self.closed:
      try:
        conn, _ = self.sock.accept()
      except OSError:
        return
      if self.answering:
        time.sleep(self.lag)
        conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")   # an empty SETTINGS frame
        conn.close()
      else:
        self.held.append(conn)   # accepted, never answered

  def close(self):
    self.closed = True
    self.sock.close()
    for conn in self.held:
      conn.close()


@pytest.fixture
def servers():
  made = []
  yield lambda answering=True: made.append(StandIn(answering)) or made[-1]
  for server in made:
    server.close()


def _dead_address():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return f"127.0.0.1:{s.getsockname()[1]}"   # closed again: nothing listens


def test_probe_tells_answering_silent_and_absent_servers_apart(servers):
  assert liveness.probe(servers().address) == "ok"
  start = time.monotonic()
  assert liveness.probe(servers(answering=False).address, timeout=0.5) == "silent"
  assert time.monotonic() - start < 2    # bounded by its timeout
  assert liveness.probe(_dead_address()) == "refused"


def test_probe_all_probes_in_parallel(servers):
  silent = [servers(answering=False) for _ in range(4)]
  tasks = [("worker", i, s.address) for i, s in enumerate(silent)] + [
      ("ps", 0, servers().address)]
  start = time.monotonic()
  states = liveness.probe_all(tasks, timeout=1.0)
  assert time.monotonic() - start < 3.0   # not 4 x 1 s one after another
  assert states == {("worker", 0): "silent", ("worker", 1): "silent", ("worker", 2): "silent",
                    ("worker", 3): "silent", ("ps", 0): "ok"}


def test_connect_names_every_task_that_does_not_answer_within_its_timeout(servers):
  silent, absent = servers(answering=False), _dead_address()
  spec = {"worker": [servers().address, silent.address, absent]}
  start = time.monotonic()
  with pytest.raises(cluster.ClusterUnreachable) as info:
    cluster.connect(spec, timeout=1.0)
  assert time.monotonic() - start < 5
  message = str(info.value)
  assert f"/job:worker/task:1 ({silent.address}): it accepts connections but its process " \
         "does not answer (stopped or hung)" in message
  assert f"/job:worker/task:2 ({absent}): nothing listens there" in message
  assert "/job:worker/task:0" not in message
  assert cluster.connected_spec() != spec   # never connected


@pytest.mark.parametrize("spec, problem", [
    ({}, "maps job names to lists"), ({"worker": "127.0.0.1:1"}, "maps job names to lists"),
    ({"worker": ["localhost"]}, "'localhost': not host:port")])
def test_connect_refuses_a_malformed_spec(spec, problem):
  with pytest.raises(ValueError, match=problem):
    cluster.connect(spec)


def test_the_watchdog_names_a_task_that_stops_answering_within_seconds(servers):
  good, going = servers(), servers()
  seen = []
  tasks = [("worker", 0, good.address), ("worker", 1, going.address)]
  with liveness.Watchdog(tasks, seen.append, interval=0.2, timeout=0.5, misses=2) as dog:
    time.sleep(0.6)
    assert seen == []                  # both answer
    going.answering = False
    stopped = time.monotonic()
    while not seen and time.monotonic() - stopped < 10:
      time.sleep(0.05)
  assert seen == [[("worker", 1, going.address, "silent")]]
  assert time.monotonic() - stopped < 3   # interval + misses x timeout, with slack
  assert dog.lost == seen[0]


def _until(condition, seconds=10):
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)


def test_the_watchdog_names_a_task_that_answers_slowly_and_again_once_it_answers_as_usual(
    servers):
  quick, lagging = servers(), servers()
  slow, lost = [], []
  tasks = [("worker", 0, quick.address), ("worker", 1, lagging.address)]
  with liveness.Watchdog(tasks, lost.append, interval=0.1, timeout=2.0, misses=2,
                         on_slow=lambda *a: slow.append(a)):
    time.sleep(0.5)
    assert slow == []
    lagging.lag = liveness.SLOW_FLOOR + 0.15
    _until(lambda: slow)
    lagging.lag = 0.0
    _until(lambda: len(slow) > 1)
  assert [(job, task, address) for job, task, address, _, _ in slow] == [tasks[1]] * 2
  assert slow[0][3] >= liveness.SLOW_FLOOR + 0.15 and slow[1][3] is None
  assert 0 < slow[0][4] < liveness.SLOW_FLOOR   # the usual answer, the fastest seen
  assert lost == []


def test_a_stopped_watchdog_gives_no_verdict_on_a_task_that_ends_after_it(servers):
  # A data-parallel worker stops its watch after its last collective: a peer may then exit.
  going = servers()
  seen = []
  with liveness.Watchdog([("worker", 1, going.address)], seen.append, interval=0.2,
                         timeout=0.5, misses=2) as dog:
    time.sleep(0.5)
    dog.stop()
    going.close()                       # the peer exits: nothing listens there
    time.sleep(2.0)                     # past interval + misses x timeout
  assert seen == [] and dog.lost is None


def test_a_watchdog_without_tasks_starts_no_thread():
  with liveness.Watchdog([], lambda lost: None) as dog:
    assert dog._thread is None   # pylint: disable=protected-access


def test_asgd_refuses_a_cluster_whose_servers_do_not_answer(servers):
  import tfpipe
  from tests import helpers
  silent = servers(answering=False)
  with pytest.raises(cluster.ClusterUnreachable, match=r"/job:ps/task:0 \(127\.0\.0\.1:\d+\): "
                     r"nothing listens there"):
    tfpipe.create(helpers.mlp(), "asgd", spec={"worker": [silent.address],
                                               "ps": [_dead_address()]})

