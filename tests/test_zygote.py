"""The zygote's children behave as `python ARGS` would: argv, directory, environment, output,
exit code, a fresh TensorFlow, and a timeout that kills them."""

import subprocess
import time

import pytest

from tests import zygote


def test_a_child_gets_its_argv_directory_and_environment_and_returns_its_exit_code(tmp_path):
  code = ("import os, sys; print(os.getcwd(), os.environ['TFPIPE_PROBE'], sys.argv[1:]); "
          "print('to stderr', file=sys.stderr); sys.exit(3)")
  result = zygote.run(["-c", code, "a", "--b=1"], cwd=tmp_path,
                      env={"TFPIPE_PROBE": "here", "PATH": "/usr/bin"})
  assert result.returncode == 3
  assert result.stdout.split() == [str(tmp_path), "here", "['a',", "'--b=1']"]
  assert result.stderr == "to stderr\n"


def test_an_uncaught_error_exits_1_with_its_traceback_and_a_module_runs_as_main(tmp_path):
  result = zygote.run(["-c", "raise ValueError('bad value 7')"], cwd=tmp_path)
  assert result.returncode == 1
  assert "Traceback" in result.stderr and "ValueError: bad value 7" in result.stderr
  result = zygote.run(["-m", "tfpipe.cluster", "--help"])
  assert result.returncode == 0 and "Runs one TensorFlow server of a cluster." in result.stdout


def test_each_child_starts_tensorflow_afresh():
  # The zygote imported TensorFlow but ran nothing: each child still splits the CPU its way.
  code = "import tfpipe; print(len(tfpipe.create_logical_cpus({})))"
  assert [zygote.run(["-c", code.format(n)]).stdout.strip() for n in (3, 5)] == ["3", "5"]


def test_a_child_past_its_timeout_is_killed():
  start = time.monotonic()
  with pytest.raises(subprocess.TimeoutExpired):
    zygote.run(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=1)
  assert time.monotonic() - start < 30
  assert zygote.run(["-c", "print('next')"]).stdout == "next\n"   # the zygote serves on


def test_a_child_exits_once_its_threads_that_are_not_daemons_end():
  code = ("import threading, time\n"
          "threading.Thread(target=lambda: (time.sleep(0.5), print('thread', flush=True)))"
          ".start()\n"
          "print('main', flush=True)\n")
  assert zygote.run(["-c", code]).stdout.split() == ["main", "thread"]


_TALKS_THEN_WAITS = ("import sys, time\n"
                     "print('ready', flush=True)\n"
                     "try:\n"
                     "  time.sleep(60)\n"
                     "except KeyboardInterrupt:\n"
                     "  print('after', flush=True)\n"
                     "  print('interrupted', file=sys.stderr, flush=True)\n"
                     "  sys.exit(130)\n")


def test_a_started_child_is_read_while_it_runs_and_sigint_interrupts_it():
  import signal
  child = zygote.start(["-c", _TALKS_THEN_WAITS])
  assert child.stdout.readline() == "ready\n"   # before it ends
  assert child.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    child.communicate(timeout=0.3)              # still running: as Popen, it keeps running
  child.send_signal(signal.SIGINT)              # KeyboardInterrupt, as from a terminal
  out, err = child.communicate(timeout=30)
  assert (child.returncode, out, err) == (130, "after\n", "interrupted\n")


def test_a_started_child_killed_by_a_signal_reports_it_as_popen_does():
  import os
  import signal
  children = [zygote.start(["-c", _TALKS_THEN_WAITS]) for _ in range(2)]   # side by side
  assert [c.stdout.readline() for c in children] == ["ready\n", "ready\n"]
  os.killpg(children[0].pid, signal.SIGKILL)    # its own process group
  children[1].kill()
  assert [c.wait(timeout=30) for c in children] == [-signal.SIGKILL, -signal.SIGKILL]
