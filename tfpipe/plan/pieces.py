"""A mini-batch cut into micro-batches: the one splitter every executor and the reference use.

M: micro-batches per mini-batch. Sizes follow `tfpipe.plan.schedules.micro_sizes` (the first
n % M micro-batches get one sample more); each piece carries its share of the mini-batch, the
weight of its loss in the mini-batch's.
"""

import itertools
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from tfpipe.plan import schedules

__all__ = ["split"]

Cut = Callable[[Any, List[int]], Sequence[Any]]


def _slices(value: Any, sizes: List[int]) -> List[Any]:
  bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
  return [value[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def split(batch: Any, M: int, cut: Optional[Cut] = None) -> List[Tuple[Any, float]]:
  """`batch` (arrays or tensors, in lists and tuples, None kept None) cut along the batch axis
  into its M micro-batches: [(the piece, its share)], the structure of `batch` kept. `cut(value,
  sizes)` cuts one array (default: slices; the executors pass `tf.split`, one op per tensor)."""
  leaves: List[Any] = []

  def collect(value: Any) -> None:
    if isinstance(value, (list, tuple)):
      for v in value:
        collect(v)
    elif value is not None:
      leaves.append(value)

  collect(batch)
  if M == 1:
    return [(batch, 1.0)]
  n = int(leaves[0].shape[0])
  sizes = schedules.micro_sizes(n, M)
  cuts = [list((cut or _slices)(leaf, sizes)) for leaf in leaves]

  def rebuild(value: Any, i: int, leaf: Iterator[int]) -> Any:
    if isinstance(value, (list, tuple)):
      return type(value)(rebuild(v, i, leaf) for v in value)
    return None if value is None else cuts[next(leaf)][i]

  return [(rebuild(batch, i, itertools.count()), size / n) for i, size in enumerate(sizes)]
