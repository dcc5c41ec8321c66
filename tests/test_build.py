"""BUILD stays honest: every module and test is listed, every listed file exists."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build():
  with open(os.path.join(ROOT, "BUILD")) as f:
    return f.read()


def _listed():
  return set(re.findall(r'"([\w/]+\.py)"', _build()))


def test_every_listed_file_exists():
  missing = sorted(p for p in _listed() if not os.path.exists(os.path.join(ROOT, p)))
  assert missing == []


def test_every_module_and_test_is_listed():
  files = set()
  for pattern in ("tfpipe/**/*.py", "trainers/*.py", "bench/*.py", "tests/*.py"):
    files |= {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)}
  assert sorted(files - _listed()) == []


def test_one_py_test_per_test_file():
  tests = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))}
  declared = set(re.findall(r'py_test\(name = "\w+", srcs = \["([\w/]+\.py)"\]', _build()))
  assert declared == tests


def test_one_py_library_per_library_module():
  modules = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tfpipe", "*.py"))}
  declared = set(re.findall(r'py_library\(name = "\w+", srcs = \["(tfpipe/[\w]+\.py)"\]', _build()))
  assert declared == modules
