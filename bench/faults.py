"""Faults on emulated hosts: each one injected into a training run, named, and ridden out.

Runs the trainer as a user starts it (`python -m trainers.main`, a process of
its own) on emulated hosts (`--cluster=emulated:1,2,LINK`: each TF server in a
network namespace of its own, root only) with `--max_restarts` and
`--checkpoint_dir`, waits for an epoch to end, and injects one fault into the
host of stage 1 (h1): its server killed (kill -9), frozen (SIGSTOP), its
link down for some seconds (`ip link set down` on the bridge's end, through
pyroute2), or 1% of the packets on its link dropped or 100 ms added to each
way for `--impair_seconds` (`tfpipe.cluster.impairment`: packet programs and a
delay line, no `netem` needed). It reads from the trainer's stderr when the fault was named (the
watchdog's or the error's line) and how the run ended: ridden out (no restart),
recovered by a restart, or ended with an error. Every run is compared with the
same run without a fault: for a synchronous method its last epoch's loss must be
the same. `--soak_minutes` instead trains one long run with a random fault
every `--soak_every` seconds and checks that its final weights equal the
uninterrupted run's (each run writes them, `--save_weights`), and that no
process, namespace or temporary file is left behind.

  python bench/faults.py [--faults=kill,stop,down5,down60,loss1,delay100 --link=1gbit]
  python bench/faults.py --soak_minutes=30
"""

import contextlib
import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import results_io  # noqa: E402

FAULTS = ("kill", "stop", "down5", "down60", "loss1", "delay100")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_list("faults", list(FAULTS), f"of {', '.join(FAULTS)}")
flags.DEFINE_string("link", "1gbit", "the links' shape")
flags.DEFINE_string("method", "1f1b", "a pipeline method")
flags.DEFINE_integer("epochs", 4, "epochs per run")
flags.DEFINE_integer("steps", 30, "mini-batches per epoch")
flags.DEFINE_integer("max_restarts", 3, "the trainer's --max_restarts")
flags.DEFINE_float("soak_minutes", 0.0, "minutes of one long run with random faults (0: off)")
flags.DEFINE_float("soak_every", 120.0, "seconds between the soak's faults (on average)")
flags.DEFINE_float("impair_seconds", 60.0, "how long loss1 and delay100 last")
flags.DEFINE_string("results_dir", results_io.RESULTS, "where the table goes")
FLAGS = flags.FLAGS

# A restart inside the training process, or one of the whole process by the trainer's agent.
RESTART = r"^tfpipe: (?:process )?restart .*$"
# A line that names a fault: a lost task, a restart, an error, a slow task, retransmissions.
NAMED = (r"^(?:tfpipe: (?:lost|restart|process restart)|error|.*lost /job:|.*answers slowly"
         r"|.*connections retransmit).*$")


class Run:
  """A trainer process whose stdout and stderr lines are kept with the time they came."""

  def __init__(self, argv):
    self.started, self.seconds = time.monotonic(), None
    self.lines, self.process = [], subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self._readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                     for stream, name in ((self.process.stdout, "out"),
                                          (self.process.stderr, "err"))]
    for reader in self._readers:
      reader.start()

  def _read(self, stream, name):
    for line in stream:
      self.lines.append((time.monotonic(), name, line.rstrip("\n")))

  def wait_for(self, pattern, timeout):
    """The time of the first line matching `pattern`, or None after `timeout` s or the end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      for when, _, line in list(self.lines):
        if re.search(pattern, line):
          return when
      if self.process.poll() is not None and all(not r.is_alive() for r in self._readers):
        return None
      time.sleep(0.1)
    return None

  def finish(self, timeout):
    try:
      self.process.wait(timeout)
    except subprocess.TimeoutExpired:
      self.process.terminate()   # the trainer cleans up (its agent tells the training process)
      try:
        self.process.wait(30)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    for reader in self._readers:
      reader.join(5)
    self.seconds = time.monotonic() - self.started
    return self.process.returncode

  def text(self, name=None):
    return "\n".join(line for _, n, line in self.lines if name in (None, n))


def _argv(checkpoints, epochs, weights=None):
  return [sys.executable, "-m", "trainers.main", "--flagfile=configs/quickstart.cfg",
          f"--method={FLAGS.method}", f"--cluster=emulated:1,2,{FLAGS.link}",
          f"--epochs={epochs}", f"--steps={FLAGS.steps}", "--logdir=", "--verbose=2",
          f"--max_restarts={FLAGS.max_restarts}", f"--checkpoint_dir={checkpoints}",
          "--throughput_window="] + ([f"--save_weights={weights}"] if weights else [])


def _trainers(pid):
  """`pid` and its children: with --max_restarts the trainer is an agent, and its child (a
  new one after each process restart) trains."""
  found = [pid]
  for path in glob.glob(f"/proc/{pid}/task/*/children"):
    with contextlib.suppress(OSError):
      with open(path) as f:
        found += [int(child) for child in f.read().split()]
  return found


def _netns_of(pid, host):
  """The name of emulated host `host` ("h1", "hub") of the trainer with `pid`, or None."""
  for candidate in _trainers(pid):
    found = glob.glob(f"/var/run/netns/tfpipe-{candidate}-*-{host}")
    if found:
      return os.path.basename(found[0])
  return None


def _pids_in(netns):
  """PIDs of the processes in network namespace `netns`."""
  inode = os.stat(f"/var/run/netns/{netns}").st_ino
  pids = []
  for path in glob.glob("/proc/[0-9]*/ns/net"):
    try:
      if os.stat(path).st_ino == inode:
        pids.append(int(path.split("/")[2]))
    except OSError:
      continue
  return pids


def _link(hub, port, up):
  from pyroute2 import IPRoute
  with IPRoute(netns=hub) as ipr:
    ipr.link("set", index=ipr.link_lookup(ifname=port)[0], state="up" if up else "down")


def inject(fault, pid):
  """Injects `fault` into host h1 of the trainer `pid`; returns when it is in place (a link
  brought down comes back up on its own, in a thread)."""
  if fault in ("kill", "stop"):
    servers = _pids_in(_netns_of(pid, "h1"))
    if not servers:   # killed earlier and not started again yet: nothing to hit
      raise OSError("no server runs on h1")
    for server in servers:
      os.kill(server, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    return
  hub = _netns_of(pid, "hub")
  if fault in ("loss1", "delay100"):
    from tfpipe.cluster import emulation, impairment
    shape = dict(loss=0.01) if fault == "loss1" else dict(delay=0.1)
    impaired = impairment.Impairment(emulation.link_ends(_netns_of(pid, "h1"), hub, "h1",
                                                         **shape))
    seconds, lift = FLAGS.impair_seconds, impaired.remove
  else:
    _link(hub, "h1", up=False)
    seconds, lift = int(fault[len("down"):]), lambda: _link(hub, "h1", up=True)

  def lifted():
    time.sleep(seconds)
    try:
      lift()
    except Exception:  # noqa: BLE001 -- the run (and its namespaces) may have ended
      pass
  threading.Thread(target=lifted, daemon=True).start()


@contextlib.contextmanager
def _scratch():
  """A checkpoint directory, removed afterwards."""
  path = tempfile.mkdtemp(prefix="tfpipe-faults-")
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


def _losses(text):
  return [float(m) for m in re.findall(r"^epoch \d+/\d+:.*? loss=([\d.]+)", text, re.M)]


def one(fault, reference, weights):
  """Injects `fault` after the first epoch; its row. `reference`: the uninterrupted Run,
  `weights`: the folder where it wrote its final weights."""
  checkpoints = tempfile.mkdtemp(prefix="tfpipe-faults-")
  try:
    written = os.path.join(weights, f"{fault}.weights.h5")
    run = Run(_argv(checkpoints, FLAGS.epochs, written))
    if run.wait_for(r"^epoch 1/", 600) is None:
      run.finish(5)
      return [fault, "", "the run ended before its first epoch: " + run.text("err")[-200:],
              "", "", "", ""]
    start = time.monotonic()
    inject(fault, run.process.pid)
    named = run.wait_for(NAMED, 120)
    code = run.finish(900)
    restarts = re.findall(RESTART, run.text("err"), re.M)
    losses, expected = _losses(run.text("out")), _losses(reference.text("out"))
    if code != 0:
      outcome = f"ended with an error (exit {code}): " + run.text("err").splitlines()[-1][:160]
    elif restarts:
      outcome = f"recovered by {len(restarts)} restart(s)"
    else:
      outcome = "ridden out"
    same = ("yes" if losses and losses[-1] == expected[-1] else
            f"no: {losses[-1:]} vs {expected[-1:]}") if code == 0 else ""
    final = compare_weights(written, os.path.join(weights, "uninterrupted.weights.h5"))
    return [fault, f"{named - start:.1f} s" if named else "not named", outcome,
            str(len(restarts)), f"{run.seconds - reference.seconds:+.0f}", same,
            final if code == 0 else ""]
  finally:
    shutil.rmtree(checkpoints, ignore_errors=True)


def leftovers(before):
  """What a finished run left: processes of the trainer's servers, namespaces, temporary
  files (new since `before`)."""
  left = []
  names = glob.glob("/var/run/netns/tfpipe-*")
  if names:
    left.append(f"namespaces {', '.join(os.path.basename(n) for n in names)}")
  servers = subprocess.run(["pgrep", "-f", "-a", "tfpipe.cluster"], capture_output=True,
                           text=True).stdout.strip()
  if servers:
    left.append(f"processes {servers}")
  now = set(glob.glob(os.path.join(tempfile.gettempdir(), "tfpipe-*")))
  if now - before:
    left.append(f"files {', '.join(sorted(now - before))}")
  return left


def _arrays(path):
  """{name: array} of a Keras .weights.h5 file ({} where there is none)."""
  import h5py
  import numpy as np
  found = {}
  if not os.path.exists(path):
    return found
  with h5py.File(path, "r") as f:
    f.visititems(lambda name, item: found.__setitem__(name, np.asarray(item))
                 if isinstance(item, h5py.Dataset) else None)
  return found


def compare_weights(path, reference):
  """How the weights in `path` compare with `reference`'s (both Keras .weights.h5 files): a
  line."""
  import numpy as np
  got, expected = _arrays(path), _arrays(reference)
  if not got or sorted(got) != sorted(expected):
    return (f"DIFFERENT: {len(got)} arrays written against {len(expected)}"
            if expected else "no uninterrupted weights to compare")
  differ = [name for name in expected if not np.array_equal(got[name], expected[name])]
  largest = max(float(np.max(np.abs(got[n] - expected[n]), initial=0.0)) for n in expected)
  count = sum(a.size for a in expected.values())
  return (f"equal, bit for bit ({len(expected)} arrays, {count} values)" if not differ else
          f"DIFFERENT in {len(differ)} of {len(expected)} arrays (largest difference "
          f"{largest:.3g})")


def soak(reference_epochs, weights):
  """One run of about --soak_minutes with a random fault every ~--soak_every s."""
  checkpoints = tempfile.mkdtemp(prefix="tfpipe-soak-")
  rng = random.Random(0)
  run = Run(_argv(checkpoints, reference_epochs, weights))
  start, injected = time.monotonic(), []
  run.wait_for(r"^epoch 1/", 600)
  while run.process.poll() is None:
    time.sleep(rng.uniform(0.5, 1.5) * FLAGS.soak_every)
    if run.process.poll() is not None:
      break
    fault = rng.choice(FAULTS)
    try:
      inject(fault, run.process.pid)
      injected.append((round(time.monotonic() - start), fault))
      print(f"soak: {fault} at {injected[-1][0]} s", flush=True)
    except (OSError, IndexError, TypeError, ValueError) as e:   # ended meanwhile, or impaired
      print(f"soak: {fault} not injected ({e})", flush=True)
  code = run.finish(600)
  shutil.rmtree(checkpoints, ignore_errors=True)
  return code, injected, run, time.monotonic() - start


def main(argv):
  del argv
  if FLAGS.soak_minutes:
    # Epochs for about --soak_minutes: timed from one uninterrupted epoch.
    with _scratch() as checkpoints:
      probe = Run(_argv(checkpoints, 2))
      t1, t2 = probe.wait_for(r"^epoch 1/", 600), probe.wait_for(r"^epoch 2/", 600)
      probe.finish(60)
    epochs = max(2, int(FLAGS.soak_minutes * 60 / max(t2 - t1, 1e-3)))
    print(f"soak: {epochs} epochs of {t2 - t1:.1f} s", flush=True)
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "tfpipe-*")))
    with _scratch() as checkpoints, _scratch() as weights:
      # The uninterrupted run beside the soak (each emulated cluster has its own namespaces).
      expected_weights = os.path.join(weights, "uninterrupted.weights.h5")
      reference = Run(_argv(checkpoints, epochs, expected_weights))
      code, injected, run, seconds = soak(epochs, os.path.join(weights, "soak.weights.h5"))
      reference.finish(7200)
      same = compare_weights(os.path.join(weights, "soak.weights.h5"), expected_weights)
    left = leftovers(before)
    expected, losses = _losses(reference.text("out")), _losses(run.text("out"))
    restarts = [m.group(0) for m in re.finditer(RESTART, run.text("err"), re.M)]
    lines = [f"`python bench/faults.py --soak_minutes={FLAGS.soak_minutes:g} "
             f"--soak_every={FLAGS.soak_every:g} --link={FLAGS.link} --method={FLAGS.method} "
             f"--max_restarts={FLAGS.max_restarts}`",
             "", f"- {epochs} epochs asked, {len(losses)} reported in {seconds / 60:.1f} min, "
             f"exit code {code}",
             f"- faults injected: {', '.join(f'{f} at {t} s' for t, f in injected) or 'none'}",
             f"- restarts: {len(restarts)}", *[f"  - {r}" for r in restarts],
             f"- last epoch's loss {losses[-1:]} against the uninterrupted run's "
             f"{expected[-1:]}: "
             f"{'equal' if losses and losses[-1:] == expected[-1:] else 'DIFFERENT'}",
             f"- final weights against the uninterrupted run's: {same}",
             f"- lines naming a fault in the uninterrupted run: "
             f"{len(re.findall(NAMED, reference.text('err'), re.M))}",
             f"- left behind: {'; '.join(left) or 'nothing'}"]
    if code != 0:
      tail = [line for line in run.text("err").splitlines() if line.strip()][-6:]
      lines += ["- the run's last lines on stderr:", "", "```", *tail, "```"]
    results_io.report(FLAGS.results_dir, "soak.md", "# Soak: training with random faults",
                      "\n".join(lines))
    return
  with _scratch() as checkpoints, _scratch() as weights:
    reference = Run(_argv(checkpoints, FLAGS.epochs,
                          os.path.join(weights, "uninterrupted.weights.h5")))
    reference.finish(900)
    rows = [one(fault, reference, weights) for fault in FLAGS.faults]
  for row in rows:
    print(row, flush=True)
  title = ("# Faults on emulated hosts\n\n"
           f"`python bench/faults.py --faults={','.join(FLAGS.faults)} --link={FLAGS.link} "
           f"--method={FLAGS.method} --epochs={FLAGS.epochs} --steps={FLAGS.steps}` (the "
           "quickstart config on 2 emulated hosts, `--max_restarts="
           f"{FLAGS.max_restarts}`; each fault injected into stage 1's host once its first "
           "epoch has ended; named: seconds from the fault to the trainer's first line naming "
           "it; seconds lost: the run's time less the same run's without a fault; the last "
           "columns compare its last epoch's loss and its final weights with that run's)")
  table = results_io.markdown_table(
      ["fault", "named after", "outcome", "restarts", "seconds lost",
       "last loss as uninterrupted", "final weights as uninterrupted"], rows)
  false = re.findall(NAMED, reference.text("err"), re.M)
  table += (f"\n\nThe uninterrupted run ({reference.seconds:.0f} s) named "
            + (f"{len(false)} faults that were not there:" if false else
               "no fault (no line naming one)")
            + "".join(f"\n- `{line}`" for line in false[:5]))
  results_io.report(FLAGS.results_dir, "faults.md", title, table)


if __name__ == "__main__":
  app.run(main)
