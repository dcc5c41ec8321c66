"""Leaving a process at once without leaving anything behind (`tfpipe.cluster.exits`), and
the agent that starts a training process again when it had to leave (`tfpipe.cluster.agent`)."""

import os
import signal
import subprocess
import sys

import pytest

from tests import zygote
from tfpipe.cluster import agent, local as local_cluster



def _exit_scenario(tmp_path, body):
  """Runs `body` after registering a cleanup that writes a file; (exit code, stderr, whether
  the cleanup ran)."""
  marker = tmp_path / "cleaned"
  code = ("import time\nfrom tfpipe.cluster import exits\n"
          f"def clean():\n  open({str(marker)!r}, 'w').write('yes')\n"
          "exits.register(clean)\n" + body)
  done = zygote.run(["-c", code], timeout=60)
  return done.returncode, done.stderr, marker.exists()


def test_a_deadline_that_passes_runs_the_cleanups_and_exits_with_its_message(tmp_path):
  code, stderr, cleaned = _exit_scenario(
      tmp_path, "with exits.deadline(0.3, 3, 'tfpipe: too slow'):\n  time.sleep(60)\n")
  assert (code, cleaned) == (3, True)
  assert stderr.strip().endswith("tfpipe: too slow")


def test_a_deadline_met_changes_nothing_and_an_unregistered_cleanup_does_not_run(tmp_path):
  code, _, cleaned = _exit_scenario(
      tmp_path, "with exits.deadline(30, 3, 'too slow'):\n  pass\n"
      "exits.unregister(clean)\nexits.exit_now(5, 'done')\n")
  assert (code, cleaned) == (5, False)


def test_the_temporary_files_of_a_killed_run_are_removed(tmp_path, monkeypatch):
  import tempfile
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()
  (tmp_path / f"tfpipe-server-{gone}-abc").write_text("")
  traced = tmp_path / f"tfpipe-hosts-{gone}-xyz"   # a trace's folder, with what it wrote
  (traced / "plugins").mkdir(parents=True)
  (traced / "plugins" / "trace.pb").write_text("")
  (tmp_path / f"tfpipe-server-{os.getpid()}-def").write_text("")   # this run's: kept
  (tmp_path / f"tfpipe-hosts-{os.getpid()}-uvw").mkdir()
  assert local_cluster.remove_leftover_files() == [
      str(tmp_path / f"tfpipe-hosts-{gone}-xyz"), str(tmp_path / f"tfpipe-server-{gone}-abc")]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      f"tfpipe-hosts-{os.getpid()}-uvw", f"tfpipe-server-{os.getpid()}-def"]


def _program(tmp_path, codes):
  """A program that exits with the next of `codes` at each run (its runs counted in a file),
  saying `tfpipe: restart 1 of N` on stderr where its code is "inner" (a restart inside it,
  then status 3)."""
  count = tmp_path / "runs"
  return [sys.executable, "-c",
          "import os, sys\n"
          f"path, codes = {str(count)!r}, {codes!r}\n"
          "runs = int(open(path).read()) if os.path.exists(path) else 0\n"
          "open(path, 'w').write(str(runs + 1))\n"
          "print('left', os.environ['TFPIPE_MAX_RESTARTS'], file=sys.stderr)\n"
          "code = codes[runs]\n"
          "if code == -9:\n  os.kill(os.getpid(), 9)\n"
          "if code == 'inner':\n"
          "  print('tfpipe: restart 1 of 9: lost /job:worker/task:1', file=sys.stderr)\n"
          "  code = 3\n"
          "sys.exit(code)\n"], count


def test_the_agent_starts_a_program_that_left_with_status_3_again_until_it_succeeds(
    tmp_path, capfd):
  argv, count = _program(tmp_path, [3, "inner", 0])
  assert agent.supervise(argv, max_restarts=4) == 0
  assert count.read_text() == "3"
  err = capfd.readouterr().err
  # Each run is told the restarts left: those of the agent and those inside count.
  assert [line for line in err.splitlines() if line.startswith("left")] == [
      "left 4", "left 3", "left 1"]
  assert "tfpipe: process restart 1 (1 of 4 restarts): the program exited with status 3" in err
  assert "tfpipe: process restart 2 (3 of 4 restarts)" in err


@pytest.mark.parametrize("codes, limit, runs, code", [
    ([3, 3, 3], 2, 3, 3),        # out of restarts: the program's status
    (["inner", 3], 1, 1, 3),     # its restart inside used the one allowed
    ([4, 0], 5, 1, 4),           # another status ends it: not a lost task
    ([3, 0], 0, 1, 3),           # no restarts asked
    ([-9, 0], 2, 1, 137),        # killed (os.kill(os.getpid(), 9)): as a shell says it
])
def test_the_agent_stops_at_max_restarts_or_another_status(tmp_path, codes, limit, runs, code):
  argv, count = _program(tmp_path, codes)
  assert agent.supervise(argv, max_restarts=limit) == code
  assert count.read_text() == str(runs)


def test_the_agent_refuses_a_bad_max_restarts():
  with pytest.raises(ValueError, match="`max_restarts` must be an integer >= 0. Received: -1"):
    agent.supervise([sys.executable, "-c", "pass"], -1)


def test_sigterm_exits_after_the_cleanups_and_a_forks_sigterm_leaves_this_process_alone(
    tmp_path):
  # The trainer's handlers; a fork that does not exec (as pyroute2 makes one to enter a
  # namespace) is ended with SIGTERM: this process goes on, then its own SIGTERM ends it.
  marker = tmp_path / "cleaned"
  code = ("import os, signal, time\nfrom trainers import interrupts\nfrom tfpipe.cluster import exits\n"
          f"exits.register(lambda: open({str(marker)!r}, 'w').write(str(os.getpid())))\n"
          "interrupts.exit_on_interrupt(130)\n"
          "pid = os.fork()\n"
          "if pid == 0:\n  time.sleep(60)\n  os._exit(0)\n"
          "os.kill(pid, signal.SIGTERM)\n_, status = os.waitpid(pid, 0)\ntime.sleep(0.5)\n"
          "print('alive', os.getpid(), os.WTERMSIG(status), flush=True)\n"
          "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
  done = zygote.run(["-c", code], timeout=120)
  words = done.stdout.split()
  assert words[0] == "alive" and words[2] == str(int(signal.SIGTERM)), done.stdout + done.stderr
  assert done.returncode == 128 + signal.SIGTERM
  assert "terminated (SIGTERM)" in done.stderr
  assert marker.read_text() == words[1]   # cleaned up by this process, not by its fork
