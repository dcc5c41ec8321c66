"""README as a newcomer meets it: the Python snippet runs as written; setup uses extras."""

import os
import re

from tests import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
  with open(os.path.join(ROOT, "README.md")) as f:
    return f.read()


def test_the_from_python_snippet_runs_as_written(tmp_path):
  section = _readme().split("## From Python", 1)[1]
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert "..." not in snippet   # no placeholders
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  result = zygote.run(["-c", snippet], cwd=tmp_path, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "val_accuracy" in result.stdout and (tmp_path / "trained.keras").exists()


def test_setup_selects_tensorflow_with_extras():
  with open(os.path.join(ROOT, "setup.py")) as f:
    setup = f.read()
  assert "environ" not in setup
  extras = setup.split("extras_require", 1)[1]
  for extra, package in (("cpu", "tensorflow-cpu"), ("gpu", "tensorflow[and-cuda]"),
                         ("profile", "tensorboard-plugin-profile"), ("test", "pytest")):
    assert re.search(rf'"{extra}": \["{re.escape(package)}', extras), extra
  first_command = re.search(r"```\n(.*?)\n```", _readme(), re.S).group(1)
  assert 'pip install -e ".[cpu,test]"' in first_command
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    assert '".[cpu,test]"' in f.read()


def test_the_language_model_snippet_runs_as_written(tmp_path):
  section = _readme().split("## Language models", 1)[1]
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
  result = zygote.run(["-c", snippet + "\nprint('generated', pipe.summary())"], cwd=tmp_path,
                      env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "generated" in result.stdout and "transformer_layer_0" in result.stdout
