"""The tree shows the architecture: planning code is pure Python."""

import ast
import os
import pathlib
import re
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
      "for name in", "sys.modules['keras.probe'] = sys.modules['tfpipe.stage.program'] = package\n"
      "for name in")
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=60, check=True)
  assert done.stdout.strip() == "['keras.probe', 'tfpipe.stage.program']"


def _layer_order():
  """The packages (and top-level modules) in layer order, as the docs' architecture page's
  table lists them (the one place the order is written): each imports only those before it."""
  rows = re.findall(r"^\| [^|]+ \| `([a-z_]+)(?:/|\.py)` \|", (ROOT / "docs" / "architecture.md")
                    .read_text(), re.M)
  assert rows, "docs/architecture.md has no layer table"
  return rows


LAYERS = _layer_order()
# Names a module may take from another object although they start with "_": namedtuple
# methods and os._exit (public APIs spelled with an underscore).
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_exit"}
# Imported inside functions on purpose: matplotlib at module level would cost every
# `import tfpipe` its import time and pick a plotting backend for the user's process.
# pyroute2 is installed on Linux only (emulated hosts, `tfpipe.cluster.emulation`).
LAZY = {"matplotlib", "pyroute2"}   # pyroute2: Linux only (emulated hosts)


def _compat(path):
  """Whether `path` is in the compatibility package (private internals are read there)."""
  return path.startswith("tfpipe/compat/")


def _modules():
  for path in sorted((ROOT / "tfpipe").rglob("*.py")):
    yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))


def _layer(path_or_module):
  parts = path_or_module.replace("/", ".").removesuffix(".py").split(".")
  return parts[1] if len(parts) > 1 else None


def _tfpipe_imports(tree):
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tfpipe":
      if node.module == "tfpipe":
        yield from (alias.name for alias in node.names)
      else:
        yield node.module.split(".")[1]
    elif isinstance(node, ast.Import):
      yield from (a.name.split(".")[1] for a in node.names
                  if a.name.startswith("tfpipe.") or a.name == "tfpipe")


def test_every_package_imports_only_the_layers_before_it():
  wrong = []
  for path, tree in _modules():
    layer = _layer(path)
    if layer in (None, "__init__"):
      continue   # the package's face imports everything
    assert layer in LAYERS, f"{path}: a folder the layer order does not name"
    for used in _tfpipe_imports(tree):
      if used != layer and (used not in LAYERS or LAYERS.index(used) > LAYERS.index(layer)):
        wrong.append(f"{path} imports tfpipe.{used}")
  assert wrong == []


def test_no_module_imports_inside_a_function():
  inside = []
  for path, tree in _modules():
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          if isinstance(node, (ast.Import, ast.ImportFrom)) and not _compat(path):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if not all(n.split(".")[0] in LAZY for n in names):
              inside.append(f"{path}:{node.lineno} {', '.join(names)}")
  assert inside == []


def _private_uses(tree):
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
        and not node.attr.startswith("__") and node.attr not in PUBLIC_UNDERSCORED
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
      yield node.lineno, node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1):
      owner, name = node.args[0], node.args[1]
      own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
      if isinstance(name, ast.BinOp) or (
          isinstance(name, ast.Constant) and str(name.value).startswith("_")
          and not str(name.value).startswith("__") and not own):
        yield node.lineno, ast.unparse(name)   # a private name, or a name made up at run time


def test_private_attributes_of_other_objects_are_read_in_the_compatibility_module_only():
  found = [f"{path}:{line} {name}" for path, tree in _modules() if not _compat(path)
           for line, name in _private_uses(tree)]
  assert found == []


def test_the_private_attribute_check_sees_reads_writes_and_names_built_at_run_time():
  tree = ast.parse("model._functional\npipe._fit = 1\nself._ok\ngetattr(self, '_' + name)\n"
                   "getattr(strategy, '_workers')\nrow._replace(a=1)\ngetattr(self, '_own')\n"
                   "getattr(it, '__next__')\n")
  assert sorted(name for _, name in _private_uses(tree)) == [
      "'_' + name", "'_workers'", "_fit", "_functional"]


def test_the_public_modules_keep_their_import_paths():
  code = ("from tfpipe.optimizers import SpecTrain\nfrom tfpipe.checkpoint import BackupAndRestore\n"
          "import tfpipe.asgd, tfpipe.multi_worker, tfpipe.tensor_parallel, tfpipe.cluster\n"
          "import tfpipe\n"
          "assert SpecTrain is tfpipe.rules.optimizers.SpecTrain\n"
          "assert tfpipe.asgd is tfpipe.baselines.asgd and tfpipe.cluster.connect\n"
          "print('ok')")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  assert done.stdout.strip() == "ok", done.stderr[-2000:]


def _executor_type_tests(tree):
  """Where a module tests what kind of executor it holds: `isinstance` with an executor class,
  `hasattr`/`getattr` on a runtime, an executor's name compared."""
  runtimes = ("Runtime", "CompiledRuntime", "Executor")
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      args = [ast.unparse(a) for a in node.args[1:2]]
      if node.func.id == "isinstance" and any(a.split(".")[-1] in runtimes for a in args):
        yield node.lineno, ast.unparse(node)
      if node.func.id in ("hasattr", "getattr") and "runtime" in ast.unparse(node.args[0]):
        yield node.lineno, ast.unparse(node)
    if isinstance(node, ast.Compare) and "executor" in ast.unparse(node.left) and any(
        isinstance(c, ast.Constant) and c.value in ("compiled", "threaded")
        for c in node.comparators):
      yield node.lineno, ast.unparse(node)


def test_no_caller_tests_an_executors_type_it_reads_what_the_executor_declares():
  # `tfpipe.runtime.base.Executor` declares what callers use (windowed, profiles, window,
  # inlines, crossing, traced_copies); building the executor a name asks for is the one place
  # a name is read (training/assemble.py).
  found = [f"{path}:{line} {text}" for path, tree in _modules()
           if "runtime" not in pathlib.Path(path).parts and not str(path).endswith("assemble.py")
           for line, text in _executor_type_tests(tree)]
  assert found == []
  sample = ast.parse("isinstance(pipe.runtime, runtime.CompiledRuntime)\n"
                     "hasattr(pipe.runtime, 'inlines')\npipe.executor == 'compiled'\n")
  assert len(list(_executor_type_tests(sample))) == 3   # the check sees each form
