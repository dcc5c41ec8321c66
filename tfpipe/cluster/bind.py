"""TF servers that listen only on the address their cluster spec names.

TensorFlow's gRPC server listens on every interface ("0.0.0.0:PORT", IPv4
and IPv6), whatever address the spec gives, and it authenticates nobody:
any process that reaches the port can run operations as the server's user.
`server_env(host)` is the environment that makes a server process listen on
`host` only: a small bind() shim (`bind_host.c`, built once with the
system's C compiler into the user's cache) preloaded into the server
(Linux). Where it cannot be built, `server_env` says why and the server
listens on every interface: run it on a private network (README,
"Clusters").
"""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile

__all__ = ["server_env", "shim_path", "bind_address"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bind_host.c")


def bind_address(host):
  """The IPv4 address `host` (a name or address) resolves to, or None."""
  try:
    return socket.gethostbyname(host)
  except OSError:
    return None


def shim_path():
  """The built shim (built now if needed): (path, None), or (None, why it cannot be built)."""
  if not sys.platform.startswith("linux"):
    return None, f"the bind shim is for Linux (this is {sys.platform})"
  compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
  with open(_SOURCE, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()[:12]
  cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                       "tfpipe")
  path = os.path.join(cache, f"bind_host-{digest}.so")
  if os.path.exists(path):
    return path, None
  if compiler is None:
    return None, "no C compiler (cc) to build the bind shim"
  os.makedirs(cache, exist_ok=True)
  fd, partial = tempfile.mkstemp(suffix=".so", dir=cache)
  os.close(fd)
  result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", partial, _SOURCE, "-ldl"],
                          capture_output=True, text=True)
  if result.returncode != 0:
    os.unlink(partial)
    return None, f"building the bind shim failed: {result.stderr.strip()[-300:]}"
  os.replace(partial, path)   # atomic: a concurrent build gives the same file
  return path, None


def server_env(host, environ=None):
  """(environment for a server process that should listen on `host` only, a warning or None).

  Wildcard hosts ("0.0.0.0", "", "::") keep every interface, by request."""
  env = dict(os.environ if environ is None else environ)
  if host in ("", "0.0.0.0", "::", "[::]"):
    return env, None
  address = bind_address(host)
  if address is None:
    return env, f"{host!r} does not resolve to an IPv4 address"
  path, why = shim_path()
  if path is None:
    return env, why
  preload = env.get("LD_PRELOAD", "")
  env["LD_PRELOAD"] = f"{path} {preload}".strip() if path not in preload else preload
  env["TFPIPE_BIND_HOST"] = address
  return env, None
