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
