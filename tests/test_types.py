"""The planning package, the stage and the executors are fully typed: mypy --strict accepts
them and would refuse an untyped function there; the executors use only what the stage
protocol states."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow and Keras ship no types: what they return is Any to mypy, which `--strict` still
# checks every function of ours against (each argument and result annotated).
_UNTYPED_LIBRARIES = ["--ignore-missing-imports"]


def _mypy(root, target, cache, extra=(), env=None):
  return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                         *extra, "--cache-dir", str(cache), target], cwd=root,
                        capture_output=True, text=True, timeout=300, env=env)


def test_the_planning_package_passes_mypy_strict(tmp_path):
  done = _mypy(ROOT, os.path.join("tfpipe", "plan"), tmp_path / "cache")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize("package", ["stage", "runtime"])
def test_the_stage_and_runtime_packages_pass_mypy_strict(tmp_path, package):
  # The executors type the stages they run as `StageProtocol`: mypy checks every use.
  done = _mypy(ROOT, os.path.join("tfpipe", package), tmp_path / "cache", _UNTYPED_LIBRARIES)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _probe(tmp_path, name, body, extra=_UNTYPED_LIBRARIES):
  """mypy --strict (with `extra`) on a package `probe` holding module `name` (`body`), which
  may import tfpipe."""
  package = tmp_path / "probe"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / name).write_text(body)
  return _mypy(tmp_path, "probe", tmp_path / "cache", extra, dict(os.environ, MYPYPATH=ROOT))


def test_mypy_strict_refuses_an_untyped_planning_function(tmp_path):
  done = _probe(tmp_path, "plan.py", "def lead(schedule):\n  return len(schedule)\n", ())
  assert done.returncode != 0 and "plan.py:1" in done.stdout


def test_mypy_strict_refuses_an_untyped_function_on_tensors(tmp_path):
  # As the stage and runtime packages are checked: TensorFlow untyped, ours still annotated.
  done = _probe(tmp_path, "stage.py", "import tensorflow as tf\n\n\n"
                                      "def doubled(x):\n  return tf.add(x, x)\n")
  assert done.returncode != 0 and "stage.py:4" in done.stdout, done.stdout


def test_mypy_refuses_an_executor_reading_a_stage_member_the_protocol_does_not_state(tmp_path):
  done = _probe(tmp_path, "executor.py", "from typing import Any\n\n"
                                         "from tfpipe.runtime.protocol import StageProtocol\n\n\n"
                                         "def run(program: StageProtocol) -> Any:\n"
                                         "  return program.task('forward')\n")
  assert done.returncode != 0 and '"StageProtocol" has no attribute "task"' in done.stdout


def test_the_stage_program_implements_the_stage_protocol(tmp_path):
  # Statically (mypy: StageProgram is a StageProtocol) and on a compiled pipeline's stages.
  done = _probe(tmp_path, "executor.py", "from tfpipe.runtime.protocol import StageProtocol\n"
                                         "from tfpipe.stage.program import StageProgram\n\n\n"
                                         "def stated(program: StageProgram) -> StageProtocol:\n"
                                         "  return program\n")
  assert done.returncode == 0, done.stdout[-3000:]
  import keras
  import tfpipe
  from tfpipe.runtime.protocol import StageProtocol
  tfpipe.devices.ensure_logical_cpus(2)
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
  pipe = tfpipe.Pipeline(model, num_stages=2, method="1f1b")
  pipe.compile("sgd", "mse")
  assert all(isinstance(p, StageProtocol) for p in pipe.programs)
