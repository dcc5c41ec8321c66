"""Delay and loss on emulated links without `netem`: packet programs and a delay line.

The network is made once for the module (two hosts and a client, 1 Gbit/s
links). Sockets are opened by threads that enter a host's namespace (setns
moves only the calling thread), so the test process stays where it is.
"""

import contextlib
import os
import socket
import struct
import subprocess
import threading
import time

import pytest

from tests import helpers
from tfpipe.cluster import bpf, delay_line, emulation, impairment, link_watch


needs_hosts = helpers.needs_hosts


@pytest.fixture(scope="module")
def network():
  with emulation.Network(2, link="1gbit") as made:
    yield made


def _in(netns, work):
  """work() run by a thread inside namespace `netns`; its result (or its exception)."""
  out = {}

  def run():
    try:
      emulation.enter(netns)
      out["value"] = work()
    except BaseException as e:  # noqa: BLE001 -- handed to the caller
      out["error"] = e
  thread = threading.Thread(target=run)
  thread.start()
  thread.join(120)
  if "error" in out:
    raise out["error"]
  return out["value"]


def _round_trips(network, count=5):
  """Round-trip times (seconds) of one byte over TCP from host 0 to host 1 and back."""
  h0, h1 = network.hosts
  server = _in(h1.netns, lambda: socket.create_server((h1.address, 0)))
  port = server.getsockname()[1]

  def echo():
    conn, _ = server.accept()
    with conn:
      while data := conn.recv(16):
        conn.sendall(data)
  threading.Thread(target=echo, daemon=True).start()

  def ping():
    times = []
    with socket.create_connection((h1.address, port), timeout=30) as conn:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      for _ in range(count):
        start = time.monotonic()
        conn.sendall(b"p")
        conn.recv(16)
        times.append(time.monotonic() - start)
    return times
  try:
    return _in(h0.netns, ping)
  finally:
    server.close()


def _datagrams_through(network, count=3000):
  """How many of `count` UDP datagrams sent from host 0 reach host 1 (sent paced, read as
  they come, so no socket buffer overflows)."""
  h0, h1 = network.hosts

  def receiver():
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((h1.address, 0))
    sock.settimeout(0.4)
    return sock
  sock = _in(h1.netns, receiver)
  got = [0]

  def read():
    try:
      while True:
        sock.recv(2048)
        got[0] += 1
    except (socket.timeout, OSError):
      pass
  reader = threading.Thread(target=read)
  reader.start()

  def send():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as out:
      for i in range(count):
        out.sendto(b"x" * 64, sock.getsockname())
        if i % 50 == 49:
          time.sleep(0.002)
  _in(h0.netns, send)
  reader.join(60)
  sock.close()
  return got[0]


def _stream(network, seconds):
  """Sends bytes over TCP from host 0 to host 1 for `seconds`."""
  h0, h1 = network.hosts
  server = _in(h1.netns, lambda: socket.create_server((h1.address, 0)))

  def drain():
    conn, _ = server.accept()
    with conn:
      while conn.recv(1 << 20):
        pass
  threading.Thread(target=drain, daemon=True).start()

  def send():
    end = time.monotonic() + seconds
    with socket.create_connection(server.getsockname(), timeout=30) as conn:
      while time.monotonic() < end:
        conn.sendall(b"z" * (1 << 18))
  try:
    _in(h0.netns, send)
  finally:
    server.close()


def _delay_lines(netns):
  """The processes of delay lines that hold an end in `netns`."""
  found = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    except OSError:
      continue
    if any(a.endswith(b"delay_line.py") for a in argv) and f'"{netns}"'.encode() in argv[-2]:
      found.append(int(entry))
  return found


def _filters(netns):
  return subprocess.run(["tc", "-n", netns, "filter", "show", "dev", "eth0", "egress"],
                        capture_output=True, text=True).stdout


@pytest.mark.parametrize("loss,detour,size", [
    (0.0, None, 2), (0.01, None, 7), (0.0, 7, 8), (0.25, 7, 13)])
def test_the_egress_program_checks_the_mark_only_with_a_detour_and_draws_only_with_a_loss(
    loss, detour, size):
  program = bpf.egress(loss, detour)
  codes = [struct.unpack_from("<BBhi", program, i) for i in range(0, len(program), 8)]
  assert len(codes) == size
  random, threshold = (0x85, 7), (0xa5, round(loss * 65536))
  assert any((code, imm) == random for code, _, _, imm in codes) == bool(loss)
  assert any((code, imm) == threshold for code, _, _, imm in codes) == bool(loss)
  assert any((code, imm) == (0x55, bpf.MARK) for code, _, _, imm in codes) == bool(detour)
  assert any((code, imm) == (0xb7, detour) for code, _, _, imm in codes) == bool(detour)


@pytest.mark.parametrize("held", [1 << 20, 250])
def test_the_delay_line_writes_each_frame_back_after_its_delay_in_order_and_drops_past_its_hold(
    monkeypatch, held):
  monkeypatch.setattr(delay_line, "HELD", held)
  line, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)   # a tap's two sides
  line.setblocking(False)
  control, stop = os.pipe()
  server = threading.Thread(target=delay_line.serve, args=([(line.fileno(), 7, 0.2)], control))
  server.start()
  start = time.monotonic()
  for i in range(3):
    far.send(bytes([i]) * 100)
  far.settimeout(10)
  got = [far.recv(1000)]
  took = time.monotonic() - start
  far.settimeout(0.5)
  with contextlib.suppress(socket.timeout):
    while True:
      got.append(far.recv(1000))
  os.close(stop)
  server.join(10)
  assert not server.is_alive()   # ends when its control closes
  assert took >= 0.2
  # 250 bytes held at most: the third frame of 100 found 200 held and was dropped.
  assert got == [bytes([i]) * 100 for i in range(3 if held > 300 else 2)]
  for fd in (line, far):
    fd.close()
  os.close(control)


@pytest.mark.parametrize("loss", [-0.1, 1.0, 2])
def test_a_loss_outside_zero_to_one_is_refused(loss):
  with pytest.raises(ValueError, match=r"loss must be a fraction in \[0, 1\)"):
    bpf.egress(loss, None)


@needs_hosts
def test_a_delay_lengthens_each_round_trip_by_twice_itself_and_leaves_with_its_removal(network):
  h1 = network.hosts[1]
  before = min(_round_trips(network))
  ends = network.impaired_ends(h1, delay=0.05)
  with impairment.Impairment(ends) as impaired:
    line = impaired.pid
    assert line is not None and _delay_lines(h1.netns) == [line]
    assert "tfpipe_egress" in _filters(h1.netns)
    delayed = _round_trips(network)
  after = min(_round_trips(network))
  # Out through the bridge's end of h1's link and back through h1's own end: 50 ms each.
  assert min(delayed) >= 0.1
  assert before < 0.05 and after < 0.05
  assert "tfpipe_egress" not in _filters(h1.netns)
  assert _delay_lines(h1.netns) == []


@needs_hosts
def test_a_loss_drops_that_share_of_packets(network):
  h1 = network.hosts[1]
  ends = network.impaired_ends(h1, loss=0.3)
  with impairment.Impairment(ends):
    got = _datagrams_through(network)
  assert 0.6 * 3000 < got < 0.8 * 3000   # 12 standard deviations either side of 70%
  assert _datagrams_through(network, 500) == 500


@needs_hosts
def test_an_end_impaired_twice_or_missing_is_refused_and_the_first_impairment_stays(network):
  end = impairment.End(network.hosts[0].netns, "eth0", loss=0.1)
  with impairment.Impairment([end]):
    with pytest.raises(ValueError, match="impaired already"):
      impairment.Impairment([end])
    assert "tfpipe_egress" in _filters(end.netns)
  with pytest.raises(ValueError, match="no interface 'eth9'"):
    impairment.Impairment([impairment.End(end.netns, "eth9", delay=0.01)])
  assert "tfpipe_egress" not in _filters(end.netns)


@needs_hosts
def test_a_network_with_delay_and_loss_impairs_every_end_and_leaves_nothing():
  with emulation.Network(1, link="1gbit,1ms,1%") as made:
    spaces = [made.hub, made.client.netns, made.hosts[0].netns]
    assert "tfpipe_egress" in _filters(made.hosts[0].netns)
    hub = subprocess.run(["tc", "-n", made.hub, "filter", "show", "dev", "h0", "egress"],
                         capture_output=True, text=True).stdout
    assert "tfpipe_egress" in hub
    assert len(_delay_lines(made.hosts[0].netns)) == 1   # one line holds every delayed end
  assert _delay_lines(made.hosts[0].netns) == []
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  assert not any(space in listed for space in spaces)


@needs_hosts
def test_the_link_watch_names_the_host_whose_connections_retransmit_and_when_they_stop(network):
  h0, h1 = network.hosts
  seen = []
  hosts = {"h0": h0.netns, "h1": h1.netns}
  with link_watch.LinkWatch(hosts, lambda *a: seen.append(a), interval=0.2, window=3):
    _stream(network, 0.8)
    assert seen == []                      # a shaped link without loss: nothing named
    with impairment.Impairment(network.impaired_ends(h0, loss=0.05)):
      _stream(network, 1.5)
    # h0 sends, and sends again what its link dropped; h1 sends acknowledgements only.
    assert [name for name, _ in seen] == ["h0"] and seen[0][1] > 0.002, seen
    _stream(network, 1.5)
  assert seen[1:] == [("h0", None)], seen
  sent, again = link_watch.tcp_counters(h0.netns)
  assert sent > again > 0
