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
  # The compiled run sees those inside a window (a tensor carried to the next window moves as
  # that call's input): most of them, on every link both ways.
  assert moves["compiled"] <= moves["threaded"]
  assert len(moves["compiled"]) > len(moves["threaded"]) / 2
  assert {(k, kind) for _, k, kind, _, _ in moves["compiled"]} == {
      (0, "XF"), (1, "XF"), (1, "XB"), (2, "XB")}
