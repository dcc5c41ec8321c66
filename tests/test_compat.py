"""Private Keras and TensorFlow internals: all in `tfpipe.compat`, all present."""

import ast
import pathlib

from tfpipe import compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
_PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.tsl")


def test_installed_keras_and_tensorflow_have_every_internal_tfpipe_reads():
  assert compat.missing() == []


def _private_imports(path):
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    found += [n for n in names if n.startswith(_PRIVATE_MODULES)]
  return found


def test_only_the_compat_module_imports_private_keras_or_tensorflow_modules():
  files = sorted((ROOT / "tfpipe").rglob("*.py")) + sorted((ROOT / "trainers").rglob("*.py"))
  offenders = {str(p.relative_to(ROOT)): _private_imports(p) for p in files
               if p.name != "compat.py"}
  assert {p: names for p, names in offenders.items() if names} == {}
  assert _private_imports(ROOT / "tfpipe" / "compat.py")   # the check sees such imports
