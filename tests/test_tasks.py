"""The task table (`tfpipe.plan.tasks`): each method's rule, read by every executor and the
reference, and nothing else deciding what a task computes."""

import ast
import pathlib

import pytest

from tfpipe.plan import policies, tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]

# method -> (what its forward reads, what it keeps, what its backward reads): docs/methods.md's
# weight rules table.
RULES = {
    "sequential": ("current", "tape", "kept"),
    "gpipe": ("current", "tape", "kept"),
    "1f1b": ("current", "tape", "kept"),
    "interleaved": ("current", "tape", "kept"),
    "zb": ("current", "tape", "kept"),
    "zbv": ("current", "tape", "kept"),
    "vanilla": ("current", "inputs", "current"),
    "pipedream": ("current", "tape", "kept"),
    "2bw": ("delayed", "tape", "kept"),
    "spectrain": ("predicted", "tape", "kept"),
    "ddg": ("current", "tape", "kept"),
    "feature_replay": ("current", "inputs", "current"),
    "timeprest": ("current", "inputs", "current"),
    "pipemare": ("current", "inputs", "corrected"),
    "i_timeprest": ("current", "weights", "blend"),
}


def test_every_method_has_a_rule_here():
  assert set(RULES) == set(policies.PIPELINE_METHODS)


@pytest.mark.parametrize("method", sorted(RULES))
def test_the_table_gives_each_method_its_weight_rule(method):
  policy = policies.policy_for(method)
  forward, backward = tasks.op(policy, "F"), tasks.op(policy, "B")
  split = method in ("zb", "zbv")   # zero-bubble: B gives the input gradient, W the weights'
  assert (forward.op, backward.op) == ("forward", "backward_input" if split else "backward")
  assert tasks.op(policy, "W") == tasks.StageOp("backward_weights", backward.reads)
  assert (forward.reads, forward.keeps, backward.reads) == RULES[method]
  assert tasks.keeps_weights(policy) == (RULES[method][1] != "inputs")
  last = tasks.ops(policy, last=True)
  # The last stage's operations are every stage's: its forward keeps inputs (and labels) and
  # reads nothing; its backward (the step) reads the forward's rule.
  assert (last["F"], last["B"].op, last["B"].reads) == (
      tasks.StageOp("forward", keeps="inputs"), "backward_input" if split else "backward",
      RULES[method][0])
  assert last["W"] == tasks.StageOp("backward_weights", RULES[method][0])
  assert [tasks.op(policy, kind).op for kind in "URS"] == ["update", "receive", "barrier"]


@pytest.mark.parametrize("options, rule", [
    ({"method": "spectrain", "spectrain_backward": "repredict"},
     ("predicted", "inputs", "predicted")),
    ({"method": "gpipe", "recompute": True}, ("current", "inputs", "current")),
    ({"method": "sequential", "recompute": True}, ("current", "inputs", "current")),
])
def test_options_change_the_rule_in_the_table(options, rule):
  policy = policies.policy_for(**options)
  assert (tasks.op(policy, "F").reads, tasks.op(policy, "F").keeps,
          tasks.op(policy, "B").reads) == rule


def test_an_unknown_kind_or_source_is_named():
  policy = policies.policy_for("vanilla")
  with pytest.raises(ValueError, match="'X'"):
    tasks.op(policy, "X")
  odd = policies.WeightPolicy("odd", "1f1b", "current", "elsewhere")
  with pytest.raises(ValueError, match="'elsewhere'"):
    tasks.op(odd, "B")


def _policy_reads(path):
  """`policy.forward`, `.backward` and `.recompute` reads in a module (what the table decides)."""
  tree = ast.parse(path.read_text())
  return [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
          if isinstance(node, ast.Attribute) and node.attr in ("forward", "backward", "recompute")
          and isinstance(node.value, ast.Attribute) and node.value.attr == "policy"]


@pytest.mark.parametrize("module", ["runtime/compiled.py", "runtime/threaded.py",
                                    "runtime/interpreter.py", "rules/reference.py",
                                    "stage/program.py"])
def test_executors_and_reference_decide_nothing_by_policy_name(module):
  assert _policy_reads(ROOT / "tfpipe" / module) == []


def test_the_policy_check_finds_a_policy_read(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text("def f(program):\n  return program.policy.backward == 'blend'\n")
  assert _policy_reads(probe) == ["probe.py:2"]
