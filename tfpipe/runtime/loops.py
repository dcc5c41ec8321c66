"""Loop windows: a schedule whose mini-batches finish one by one
(`tfpipe.plan.windows.flush_window`) runs each window of W mini-batches as one call that loops
over them, so its graph holds one mini-batch's tasks whatever W is."""

import contextlib
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

import tensorflow as tf

from tfpipe.plan import schedules, windows
from tfpipe.runtime import calls
from tfpipe.runtime.groups import Carry
from tfpipe.runtime.base import Before, OnResult

if TYPE_CHECKING:
  from tfpipe.runtime.compiled import CompiledRuntime

__all__ = ["LoopWindows"]


class LoopWindows:
  """The compiled executor's (`runtime`) loop windows: `function` (the traced loop)."""

  def __init__(self, runtime: "CompiledRuntime") -> None:
    self.runtime = runtime
    self.functions = calls.Relaxed(self._traced)   # per batch size; any sequence length

  def train(self, flush: windows.Window, number: int, batches: Iterator[Any], num_batches: int,
            M: int, on_result: OnResult, before: Before) -> int:
    """Runs a schedule whose mini-batches finish one by one (`windows.flush_window`): each
    window of W mini-batches is one call that loops over them (`tf.while_loop`, one
    iteration at a time), so its graph holds one mini-batch's tasks whatever W is."""
    updates = [0] * self.runtime.K
    for k, task, _, _ in flush.tasks:
      updates[k] += schedules.is_update(task)
    feed, done = calls.Feed(batches, labelled=True), 0
    for first in range(0, num_batches, self.runtime.window):
      last = min(first + self.runtime.window, num_batches) - 1
      items = [feed.get(b) for b in range(first, last + 1)]
      feed.drop_before(last + 1)
      results = []
      for group in calls.same_shapes(items):   # a smaller last batch: a loop of its own
        results += self._run(number, group, M)
      for k, count in enumerate(updates):
        if count:
          self.runtime.count_updates(k, count * len(items))
      stop = False
      for b, (loss, logs) in zip(range(first, last + 1), results):
        if before is not None:
          before(b)
        stop = bool(on_result(b, loss, logs)) or stop
        done += 1
      if stop:
        break
    return done

  def _run(self, number: int, items: List[Any], M: int) -> List[Tuple[Any, Dict[str, Any]]]:
    """One loop call over `items` (mini-batches of one shape): [(loss, logs)] per batch.
    They are stacked into W slots (the last repeated), so every call of one batch shape
    has one signature and traces once; the loop runs len(items) iterations."""
    count = len(items)
    items = items + [items[-1]] * (self.runtime.window - count)
    stack = lambda *values: tf.stack(values)
    xs = tf.nest.map_structure(stack, *[x for x, _, _ in items])
    y = tf.nest.map_structure(stack, *[y for _, y, _ in items])
    weights = (None if items[0][2] is None else
               tf.nest.map_structure(stack, *[w for _, _, w in items]))
    n = tf.constant(count, tf.int32)
    traced = self.functions.tracing_count()
    try:
      losses, logs = self.runtime.call(self.functions.get(xs, 1), number, n, xs, y, weights, M)
    except tf.errors.OpError as error:
      calls.raise_clearer(error)
    self.runtime.traces += self.functions.tracing_count() - traced
    losses = losses.numpy()
    logs = {name: values.numpy() for name, values in logs.items()}
    return [(losses[i], {name: values[i] for name, values in logs.items()})
            for i in range(count)]

  def _traced(self, number: int, n: tf.Tensor, xs: Any, y: Any, weights: Any,
              M: int) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """The loop of `_train_loops`: one iteration for each of the first `n` mini-batches, each
    the tasks of key `number`; returns (losses, {name: values}), one per mini-batch."""
    key, inline, _ = self.runtime.numbered[number]
    names = list(self.runtime.programs[-1].reports.results())
    empty: Carry = {"x": {}, "saved": {}, "g": {}}

    def body(i: tf.Tensor, losses: tf.TensorArray,
             logs: List[tf.TensorArray]) -> Tuple[tf.Tensor, tf.TensorArray, List[tf.TensorArray]]:
      at = lambda t: tf.gather(t, i)
      inputs = {0: tf.nest.map_structure(at, xs)}
      labels = {0: (tf.nest.map_structure(at, y),
                    None if weights is None else tf.nest.map_structure(at, weights))}
      with contextlib.ExitStack() as stack:   # each forward traced once, its M calls inlined
        for program in self.runtime.programs:
          stack.enter_context(program.residuals_inlined(inline))
        _, results = self.runtime.trace_tasks(key, inline, empty, inputs, labels, M)
      loss, batch_logs = results[0]
      return (i + 1, losses.write(i, tf.cast(loss, tf.float64)),
              [ta.write(i, tf.cast(batch_logs[name], tf.float64))
               for ta, name in zip(logs, names)])

    def arrays() -> tf.TensorArray:
      return tf.TensorArray(tf.float64, size=n)   # n <= W: what is stacked

    _, losses, logs = tf.while_loop(
        lambda i, *_: i < n, body, (tf.constant(0), arrays(), [arrays() for _ in names]),
        parallel_iterations=1)
    return losses.stack(), {name: ta.stack() for name, ta in zip(names, logs)}
