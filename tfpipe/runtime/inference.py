"""Inference windows: the compiled executor's forward-only pass (evaluate and predict), a
window of mini-batches per call, every stage's forward on the current weights."""

from typing import TYPE_CHECKING, Any, Iterator, List, Optional

from tfpipe import compat
from tfpipe.runtime import calls
from tfpipe.runtime.base import Before, OnResult

if TYPE_CHECKING:
  from tfpipe.runtime.compiled import CompiledRuntime

__all__ = ["InferenceWindows"]


class InferenceWindows:
  """The compiled executor's (`runtime`) inference windows: `functions` (one per batch
  size; any sequence length)."""

  def __init__(self, runtime: "CompiledRuntime") -> None:
    self.runtime = runtime
    self.functions = calls.Relaxed(self._traced)

  def run(self, batches: Iterator[Any], num_batches: int, on_result: OnResult,
          with_labels: bool, before: Before = None) -> None:
    """Forward-only pass with current weights, a window at a time.

    With labels, the last stage updates the loss and metrics and `on_result`
    gets (b, running logs); without, it gets (b, outputs). `before(b)` runs
    for each batch of a window before its results are handed on.
    """
    window = self.runtime.window
    feed = calls.Feed(batches, labelled=with_labels)
    for first in range(0, num_batches, window):
      count = min(window, num_batches - first)
      items = [feed.get(b) for b in range(first, first + count)]
      feed.drop_before(first + count)
      inputs = [xs for xs, _, _ in items]
      results = self.functions.get(inputs, 0)(
          inputs, [(y, w) for _, y, w in items] if with_labels else None)
      for i, result in enumerate(results):
        if before is not None:
          before(first + i)
        on_result(first + i, result)

  def _traced(self, inputs: List[Any], labels: Optional[List[Any]]) -> List[Any]:
    runtime, results = self.runtime, []
    # Each stage's calls alike: their shapes inferred once; marked as a training window's.
    with compat.calls_inferred_once(), runtime.marked():
      for i, xs in enumerate(inputs):
        for k, program in enumerate(runtime.programs):
          if k == runtime.K - 1 and labels is not None:
            results.append(program.forward(xs, labels=labels[i], training=False))
          else:
            xs = program.forward(xs, training=False)
        if labels is None:
          results.append(xs)
    return results
