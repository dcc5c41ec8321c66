"""The tree shows the architecture: planning code is pure Python."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLAN = sorted(p.stem for p in (ROOT / "tfpipe" / "plan").glob("*.py") if p.stem != "__init__")

# Imports every planning module without `tfpipe/__init__.py` (which loads TensorFlow for the
# rest of the library) and prints what else got imported.
_PROBE = """
import importlib, sys, types
package = types.ModuleType("tfpipe")
package.__path__ = [{root!r}]
sys.modules["tfpipe"] = package
for name in {names!r}:
  importlib.import_module("tfpipe.plan." + name)
print(sorted(n for n in sys.modules if n.split(".")[0] in ("tensorflow", "keras", "tf_keras")
             or (n.startswith("tfpipe.") and not n.startswith("tfpipe.plan"))))
"""


def test_the_planning_package_imports_no_tensorflow_keras_or_other_tfpipe_module():
  assert {"schedules", "verify", "policies", "windows", "simulator"} <= set(PLAN)
  probe = _PROBE.format(root=str(ROOT / "tfpipe"), names=PLAN)
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=60, check=True)
  assert done.stdout.strip() == "[]"


def test_the_probe_reports_a_keras_or_library_module_loaded_beside_the_plan():
  probe = _PROBE.format(root=str(ROOT / "tfpipe"), names=["names"]).replace(
      "for name in", "sys.modules['keras.probe'] = sys.modules['tfpipe.stage'] = package\n"
      "for name in")
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=60, check=True)
  assert done.stdout.strip() == "['keras.probe', 'tfpipe.stage']"
