"""Packet programs for the emulated links: random loss, and a detour through a delay line.

The kernel's `netem` is what usually adds delay and loss to a link, and many
kernels are built without it. These are traffic-control classifiers instead
(eBPF, `BPF_PROG_TYPE_SCHED_CLS`, direct action) on a `clsact` queueing
discipline, which kernels with BPF have (CONFIG_NET_CLS_BPF and
CONFIG_NET_SCH_INGRESS):
  `egress(loss, detour)`  on a link's end, for what leaves it: drops a packet
                          with probability `loss` (the kernel's random
                          numbers), and sends the rest to the delay line's
                          device `detour` (an interface index; None: no
                          delay), but for a packet coming back from it
                          (marked), which leaves as it is;
  `returning(port)`       on the delay line's device, for what the line writes
                          back: marks it and sends it out of `port`.
The `clsact` hooks run before the root queueing discipline, so every packet,
a returning one too, still passes the link's token bucket (its rate).
`load` hands a program to the kernel (the `bpf` system call); `attach`
hangs it on a device through pyroute2.
"""

import ctypes
import os
import platform
import struct

__all__ = ["egress", "returning", "load", "attach", "detach", "BpfUnavailable", "MARK"]

MARK = 0x7f1e0001               # a returning packet's skb->mark
_SYSCALL = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
_PROG_LOAD = 5
_SCHED_CLS = 3
_HOOK = {"egress": "ffff:fff3", "ingress": "ffff:fff2"}
# Instruction codes (linux/bpf.h) and the kernel's helpers used here.
_CALL, _EXIT, _MOV_K, _RSH_K, _JLT_K, _JNE_K, _LDX_W, _ST_W = (
    0x85, 0x95, 0xb7, 0x77, 0xa5, 0x55, 0x61, 0x62)
_GET_PRANDOM_U32, _REDIRECT = 7, 23
_OK, _SHOT = 0, 2               # TC_ACT_OK, TC_ACT_SHOT
_MARK_OFFSET = 8                # offsetof(struct __sk_buff, mark)


class BpfUnavailable(RuntimeError):
  """The kernel refused a packet program (no BPF, or not root)."""


def _insn(code, dst=0, src=0, off=0, imm=0):
  return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def egress(loss, detour):
  """The program for a link's end: loss in [0, 1) (a fraction, to 1/65536), detour the delay
  line's interface index or None."""
  if not 0.0 <= loss < 1.0:
    raise ValueError(f"loss must be a fraction in [0, 1). Received: {loss!r}")
  code = []
  if detour is not None:   # coming back from the delay line: leave
    code += [_insn(_LDX_W, dst=2, src=1, off=_MARK_OFFSET),
             _insn(_JNE_K, dst=2, off=2, imm=MARK),
             _insn(_MOV_K, dst=0, imm=_OK), _insn(_EXIT)]
  threshold = round(loss * 65536)
  if threshold:            # a random 16-bit number under the threshold: dropped
    code += [_insn(_CALL, imm=_GET_PRANDOM_U32), _insn(_RSH_K, dst=0, imm=16),
             _insn(_JLT_K, dst=0, off=2 if detour is None else 4, imm=threshold)]
  if detour is None:
    code += [_insn(_MOV_K, dst=0, imm=_OK), _insn(_EXIT)]
  else:
    code += [_insn(_MOV_K, dst=1, imm=detour), _insn(_MOV_K, dst=2, imm=0),
             _insn(_CALL, imm=_REDIRECT), _insn(_EXIT)]
  if threshold:
    code += [_insn(_MOV_K, dst=0, imm=_SHOT), _insn(_EXIT)]
  return b"".join(code)


def returning(port):
  """The program for the delay line's device: what it writes back is marked and leaves through
  interface `port`."""
  return b"".join([_insn(_ST_W, dst=1, off=_MARK_OFFSET, imm=MARK),
                   _insn(_MOV_K, dst=1, imm=port), _insn(_MOV_K, dst=2, imm=0),
                   _insn(_CALL, imm=_REDIRECT), _insn(_EXIT)])


def load(program, name):
  """Loads `program` (bytes of instructions) as a traffic-control classifier; its file
  descriptor (close it once attached)."""
  number = _SYSCALL.get(platform.machine())
  if number is None:
    raise BpfUnavailable(f"packet programs are not set up for this machine "
                         f"({platform.machine()})")
  libc = ctypes.CDLL(None, use_errno=True)
  code = ctypes.create_string_buffer(program, len(program))
  license_ = ctypes.create_string_buffer(b"GPL")
  log = ctypes.create_string_buffer(1 << 16)
  attr = ctypes.create_string_buffer(128)
  struct.pack_into("<IIQQIIQ", attr, 0, _SCHED_CLS, len(program) // 8,
                   ctypes.addressof(code), ctypes.addressof(license_), 1, len(log),
                   ctypes.addressof(log))
  attr[48:48 + len(name[:15])] = name[:15].encode()
  fd = libc.syscall(number, _PROG_LOAD, attr, len(attr))
  if fd < 0:
    error = ctypes.get_errno()
    raise BpfUnavailable(f"the kernel refused packet program {name!r}: {os.strerror(error)}"
                         + (f" ({log.value.decode(errors='replace').strip()})"
                            if log.value else ""))
  return fd


def attach(ipr, index, program, name, direction="egress"):
  """Hangs `program` on interface `index` (through `ipr`, a pyroute2 IPRoute in its namespace)
  at its `clsact` hook `direction`, making the `clsact` discipline where there is none."""
  if not any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(index)):
    ipr.tc("add", "clsact", index)
  fd = load(program, name)
  try:
    ipr.tc("add-filter", "bpf", index, ":1", fd=fd, name=name, parent=_HOOK[direction],
           classid=1, direct_action=True)
  finally:
    os.close(fd)


def detach(ipr, index):
  """Removes every program from interface `index` (its `clsact` discipline)."""
  if any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(index)):
    ipr.tc("del", "clsact", index)
