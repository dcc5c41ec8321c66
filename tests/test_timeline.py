"""The compiled executor's timeline: profiler events become the threaded executor's records."""

import keras
import pytest

from tests import helpers
from tfpipe.rules import optimizers
from tfpipe.runtime import timeline
import tfpipe


def _op(name, start, end, **args):
  return timeline.Event(name, start, end, dict(args))


def test_ops_become_task_runs_transfers_and_gradients_of_kept_tapes():
  # One call of three tasks: stage 0's F (task 0), stage 1's FB (task 1) and stage 0's B (task
  # 2), which takes its gradient through F's kept tape (its ops are named after F's).
  entries = [(0, "F", 5, None, 3, 1), (1, "FB", 5, None, 4, 0), (0, "B", 5, None, 3, 1)]
  calls = {0: (0.0, 1.0)}
  gap = 10 * timeline.MERGE_GAP
  events = [
      _op("ReadVariableOp", 0.0, 0.001, long_name="tfpipe_task0/dense/ReadVariableOp:R"),
      _op("MatMul", 0.001 + gap, 0.1, long_name="tfpipe_task0/dense/MatMul:MatMul"),
      _op("_Send", 0.1, 0.11, long_name="tfpipe_task0/dense/Selu/_1:_Send",
          to="tfpipe_task1/logits/MatMul"),
      _op("MatMul", 0.12, 0.3, long_name="tfpipe_task1/logits/MatMul:MatMul"),
      _op("_Send", 0.3, 0.31, long_name="gradient_tape/tfpipe_task1/logits/MatMul:_Send",
          to="gradient_tape/tfpipe_task0/dense/SeluGrad"),
      _op("SeluGrad", 0.32, 0.5, long_name="gradient_tape/tfpipe_task0/dense/SeluGrad:S"),
      _op("MatMul", 2.0, 2.1, long_name="tfpipe_task0/dense/MatMul:MatMul"),   # another call
      _op("Const", 0.2, 0.21, long_name="Identity_3:Identity")]               # no task's
  records = timeline.task_records(events, calls, {0: (entries, {0: 2})}, epoch=7)
  got = sorted((r.stage, r.kind, r.batch, r.version, r.s, r.start, r.end, r.epoch)
               for r in records)
  assert got == sorted([
      (0, "F", 5, 3, 1, 0.0, 0.001, 7), (0, "F", 5, 3, 1, 0.001 + gap, 0.11, 7),
      (0, "XF", 5, None, None, 0.1, 0.11, 7), (1, "FB", 5, 4, 0, 0.12, 0.31, 7),
      (1, "XB", 5, None, None, 0.3, 0.31, 7), (0, "B", 5, 3, 1, 0.32, 0.5, 7)])


def test_values_carried_in_from_the_window_before_are_their_senders_transfers():
  # A call whose stage-1 step (task 0) takes stage 0's output carried from the call before,
  # and whose stage-0 backward (task 1) takes the gradients carried likewise; the labels move
  # too, but they are no stage's transfer.
  entries = [(1, "FB", 4, None, 2, 0), (0, "B", 3, None, 2, 1)]
  events = [
      _op("_Send", 0.01, 0.02, long_name="carry/_5:_Send", to="tfpipe_task0/dense/MatMul",
          **{"from": "carry"}),
      _op("_Send", 0.02, 0.03, long_name="carry_1/_1:_Send", to="tfpipe_task0/Cast",
          **{"from": "carry_1"}),
      _op("_Send", 0.04, 0.05, long_name="carry_2/_7:_Send",
          to="gradient_tape/tfpipe_task1/dense/ReluGrad", **{"from": "carry_2"}),
      _op("_Send", 0.0, 0.01, long_name="labels/_3:_Send", to="tfpipe_task0/loss/Cast",
          **{"from": "labels"})]
  records = timeline.task_records(events, {0: (0.0, 1.0)}, {0: (entries, {})}, epoch=2)
  assert sorted((r.stage, r.kind, r.batch, r.start, r.end) for r in records) == [
      (0, "XF", 4, 0.01, 0.03), (1, "XB", 3, 0.04, 0.05)]


def _fit(method, executor, n=7, epochs=2, **options):
  x, y = helpers.as_arrays(helpers.batches(n))
  pipe = tfpipe.Pipeline(helpers.mlp(), num_stages=3, method=method, executor=executor,
                         record=True, **options)
  optimizer = (optimizers.SpecTrain(0.05, 0.9) if method == "spectrain" else
               keras.optimizers.SGD(0.05, 0.9))
  pipe.compile(optimizer, "sparse_categorical_crossentropy", steps_per_execution=3)
  pipe.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
  return pipe


@pytest.mark.parametrize("method,options", [("spectrain", {}), ("vanilla", {}),
                                            ("gpipe", {"micro_batches": 2})])
def test_compiled_records_the_tasks_and_versions_the_threaded_executor_records(method, options):
  tasks, moves = {}, {}
  for executor in ("threaded", "compiled"):
    pipe = _fit(method, executor, **options)
    tasks[executor] = sorted({(r.epoch, r.stage, r.kind, r.batch, r.micro or 0, r.version, r.s)
                              for r in pipe.records if r.kind in ("F", "B", "FB", "U")})
    moves[executor] = {(r.epoch, r.stage, r.kind, r.batch, r.micro) for r in pipe.records
                       if r.kind in ("XF", "XB")}
    for shares in pipe.breakdown().shares:
      assert sum(shares.values()) == pytest.approx(1.0)
      assert shares["compute"] > 0
  assert tasks["compiled"] == tasks["threaded"]
  assert len(tasks["compiled"]) > 2 * 7 * 4
  # Every forward crossing a cut and every gradient coming back: epochs, batches, links, ways.
  assert len(moves["threaded"]) == 2 * 7 * 2 * 2 * pipe.micro_batches
  # The compiled run records every one too: inside a window, and a tensor carried to the next
  # window as it moves at that call's start.
  assert moves["compiled"] == moves["threaded"]
