"""A delay line: what leaves an emulated link's end, held for a fixed time and written back.

The kernel's `netem` done in user space, for kernels without it. Run as a
script of its own, importing nothing but the standard library (so it starts
in a fraction of a second, without TensorFlow):

  python -I delay_line.py '[["NETNS", "TAP", DELAY_SECONDS], ...]'

For each entry it makes a tap device named TAP in network namespace NETNS
(entering it for the moment the device is made; the process itself stays
where it was started), with segmentation offload on (virtio-net headers: a
TCP stream comes in segments of up to 64 KiB, not packets), brings it up,
and prints the taps' interface indices as one JSON line. From then on every
frame read from a tap is written back to it DELAY_SECONDS later, in order (a
frame that finds `HELD` bytes held on its tap is dropped, as a full queue
drops it: 2 s at 1 Gbit/s).
The caller's packet programs (`tfpipe.cluster.bpf`) send a link end's
packets into the tap and the written-back ones out of the end. It ends when
its standard input closes, so also when the process that started it dies;
its taps go with it.
"""

import collections
import ctypes
import fcntl
import json
import os
import select
import socket
import struct
import sys
import time

_TUNSETIFF, _TUNSETOFFLOAD = 0x400454ca, 0x400454d0
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x2, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6, _TUN_F_TSO_ECN = 0x1, 0x2, 0x4, 0x8
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CLONE_NEWNET = 0x40000000
_FRAME = 1 << 17          # larger than any frame a tap hands out (64 KiB and headers)
HELD = 256 << 20          # bytes a tap's line holds at most; more is dropped, as a full queue


def _setns(fd):
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.setns(fd, _CLONE_NEWNET) != 0:
    error = ctypes.get_errno()
    raise OSError(error, f"cannot enter a network namespace: {os.strerror(error)}")


def _tap(name):
  """A tap device `name` in the current network namespace, up; (its file, its index)."""
  fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
  fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(),
                                          _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR))
  fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6 | _TUN_F_TSO_ECN)
  ipv6 = f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6"
  if os.path.exists(ipv6):   # the device itself says nothing (no router solicitations)
    with open(ipv6, "w") as f:
      f.write("1")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    request = struct.pack("16sH", name.encode(), 0)
    flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
    fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", name.encode(), flags | _IFF_UP))
  return fd, socket.if_nametoindex(name)


def make(entries):
  """The taps of `entries` [(netns, name, delay)]: [(file, index, delay)]."""
  home = os.open("/proc/self/ns/net", os.O_RDONLY)
  taps = []
  try:
    for netns, name, delay in entries:
      space = os.open(os.path.join("/var/run/netns", netns), os.O_RDONLY)
      try:
        _setns(space)
        fd, index = _tap(name)
      finally:
        os.close(space)
        _setns(home)
      taps.append((fd, index, float(delay)))
  finally:
    os.close(home)
  return taps


def serve(taps, control):
  """Writes every frame read from a tap back to it its delay later, until `control` (a file
  descriptor) reaches its end."""
  held = {fd: collections.deque() for fd, _, _ in taps}
  delays = {fd: delay for fd, _, delay in taps}
  sizes = dict.fromkeys(held, 0)
  live = set(held)
  while True:
    due = min((queue[0][0] for queue in held.values() if queue), default=None)
    wait = None if due is None else max(0.0, due - time.monotonic())
    ready, _, _ = select.select([control, *live], [], [], wait)   # microseconds, not ms
    for fd in ready:
      if fd == control:
        if not os.read(control, 4096):
          return
        continue
      now = time.monotonic()
      while True:
        try:
          frame = os.read(fd, _FRAME)
        except BlockingIOError:
          break
        except OSError:      # the device went with its namespace
          live.discard(fd)
          held[fd].clear()
          sizes[fd] = 0
          break
        if sizes[fd] + len(frame) <= HELD:
          held[fd].append((now + delays[fd], frame))
          sizes[fd] += len(frame)
    now = time.monotonic()
    for fd, queue in held.items():
      while queue and queue[0][0] <= now:
        frame = queue.popleft()[1]
        sizes[fd] -= len(frame)
        try:
          os.write(fd, frame)
        except OSError:      # dropped, as a full link would
          pass


def main(argv):
  taps = make(json.loads(argv[1]))
  sys.stdout.write(json.dumps([index for _, index, _ in taps]) + "\n")
  sys.stdout.flush()
  serve(taps, sys.stdin.fileno())


if __name__ == "__main__":
  main(sys.argv)
