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
