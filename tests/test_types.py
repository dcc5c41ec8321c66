"""The planning package is fully typed: mypy --strict accepts it, and would refuse an untyped
function there."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mypy(root, target, cache):
  return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                         "--cache-dir", str(cache), target], cwd=root, capture_output=True,
                        text=True, timeout=300)


def test_the_planning_package_passes_mypy_strict(tmp_path):
  done = _mypy(ROOT, os.path.join("tfpipe", "plan"), tmp_path / "cache")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_mypy_strict_refuses_an_untyped_planning_function(tmp_path):
  package = tmp_path / "probe"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "plan.py").write_text("def lead(schedule):\n  return len(schedule)\n")
  done = _mypy(tmp_path, "probe", tmp_path / "cache")
  assert done.returncode != 0 and "plan.py:1" in done.stdout


def _mypy_runtime(root, target, cache, env=None):
  return subprocess.run([sys.executable, "-m", "mypy", "--check-untyped-defs",
                         "--follow-imports=silent", "--ignore-missing-imports",
                         "--cache-dir", str(cache), target], cwd=root, capture_output=True,
                        text=True, timeout=300, env=env)


def test_the_executors_use_only_what_the_stage_protocol_states(tmp_path):
  # The executors type the stages they run as `StageProtocol`: mypy checks every use.
  done = _mypy_runtime(ROOT, os.path.join("tfpipe", "runtime"), tmp_path / "cache")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _probe_module(tmp_path, body):
  package = tmp_path / "probe"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "executor.py").write_text(body)
  return dict(os.environ, MYPYPATH=ROOT)


def test_mypy_refuses_an_executor_reading_a_stage_member_the_protocol_does_not_state(tmp_path):
  env = _probe_module(tmp_path, "from tfpipe.runtime.protocol import StageProtocol\n\n\n"
                                "def run(program: StageProtocol):\n"
                                "  return program.task('forward')\n")
  done = _mypy_runtime(tmp_path, "probe", tmp_path / "cache", env)
  assert done.returncode != 0 and '"StageProtocol" has no attribute "task"' in done.stdout


def test_the_stage_program_implements_the_stage_protocol(tmp_path):
  # Statically (mypy: StageProgram is a StageProtocol) and on a compiled pipeline's stages.
  env = _probe_module(tmp_path, "from tfpipe.runtime.protocol import StageProtocol\n"
                                "from tfpipe.stage.program import StageProgram\n\n\n"
                                "def stated(program: StageProgram) -> StageProtocol:\n"
                                "  return program\n")
  done = _mypy_runtime(tmp_path, "probe", tmp_path / "cache", env)
  assert done.returncode == 0, done.stdout[-3000:]
  import keras
  import tfpipe
  from tfpipe.runtime.protocol import StageProtocol
  tfpipe.devices.ensure_logical_cpus(2)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
  pipe = tfpipe.Pipeline(model, num_stages=2, method="1f1b")
  pipe.compile("sgd", "mse")
  assert all(isinstance(p, StageProtocol) for p in pipe.programs)
