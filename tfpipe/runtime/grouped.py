"""Window groups run: every window of an epoch's plan as a branch of one traced function
(`tfpipe.runtime.groups` says how a carry fits every branch)."""

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import windows
from tfpipe.runtime import calls, groups

if TYPE_CHECKING:
  from tfpipe.runtime.compiled import CompiledRuntime

__all__ = ["GroupedWindows", "Group"]


class GroupedWindows:
  """The compiled executor's (`runtime`) window groups: `groups` (a plan's distinct window
  numbers -> its `Group`, or None: ungroupable) and `function` (the traced group)."""

  def __init__(self, runtime: "CompiledRuntime") -> None:
    self.runtime: "CompiledRuntime" = runtime
    self.groups: Dict[Tuple[int, ...], Optional[Group]] = {}   # distinct numbers -> group
    self.function = compat.own_function(self._traced, autograph=False)

  def group_of(self, plan: List[windows.Window], numbers: List[int]) -> Optional["Group"]:
    """The `Group` that runs `plan` (windows of stage calls, not profiled, every stage in this
    process), else None. A group's `switch_case` returns its carry on the caller's device: with
    stages on TF servers, every carried tensor would cross to this program and back (measured);
    a window's own function leaves its outputs on their task."""
    if (self.runtime.record or self.runtime.remote
        or any(self.runtime.numbered[n].inline for n in numbers)):
      return None
    distinct = tuple(dict.fromkeys(numbers))
    if distinct not in self.groups:

      def keys(k: int) -> List[int]:
        return sorted({t.batch - w.first for w in plan for j, t, _, _ in w.tasks
                       if j == k and t.kind == "F"})
      size = max(w.last + 1 - w.first for w in plan)
      # The first window's branch takes no carry, so a plan that runs it again later cannot
      # group; its inputs and labels give every call's shapes, so it must read both.
      group = Group(distinct, keys(0), keys(self.runtime.K - 1), size)
      first = {(k, t.kind) for k, t, _, _ in plan[0].tasks}
      self.groups[distinct] = (group if numbers[0] not in numbers[1:] and (0, "F") in first
                               and (self.runtime.K - 1, "F") in first else None)
    return self.groups[distinct]

  def run(self, group: "Group", window: windows.Window, number: int, carry: groups.Carry,
          feed: calls.Feed, M: int) -> Optional[Tuple[groups.Carry, List[Any]]]:
    """The window through the group's function: (carry, results) as the executor's own call
    gives them; None when the window's batches are shaped unlike the group's (a smaller
    batch: the function would trace again), or when tracing found the plan ungroupable
    (`groups.Ungroupable`, raised inside the trace, before any window ran: the group is
    then forgotten and the plan runs a window per function). The carry a branch takes is
    read when the function is called (`compat.call_time_value`): the carry handed on, or
    for the plan's first window the template's zeros."""
    inputs, labels = self.runtime.data(window, feed)
    if group.fillers is None:   # the first call: its batches' shapes are the group's
      group.fillers = [next(iter(data.values())) for data in (inputs, labels)]
    for data, keys, filler in zip((inputs, labels), (group.inputs, group.labels), group.fillers):
      if any(calls.shapes(item) != calls.shapes(filler) for item in data.values()):
        return None
      for key in keys:   # keys of the other windows: a batch of the same shapes, unused
        data.setdefault(key, filler)
    group.carry = carry if any(carry[part] for part in groups.PARTS) else None
    branch = tf.constant(group.numbers.index(number), tf.int32)
    traced = self.function.experimental_get_tracing_count()
    with compat.unoptimised_calls():
      try:
        out, results = self.function(branch, group.numbers, inputs, labels, M, group.size)
      except groups.Ungroupable:
        self.groups[group.numbers] = None
        return None
      except tf.errors.OpError as error:
        calls.raise_clearer(error)
    self.runtime.traces += self.function.experimental_get_tracing_count() - traced
    self.runtime.finished(window, feed)
    return out, results[:window.last + 1 - window.first]

  def _traced(self, branch: tf.Tensor, numbers: Tuple[int, ...], inputs: Dict[int, Any],
              labels: Dict[int, Any], M: int, size: int) -> Any:
    """The group's function: the windows of `numbers` as branches (`branch` chooses), in plan
    order. The first traces on no carry, and what it hands on is the template; the others
    take the carry as placeholders of the template's shapes, fed at each call with the
    group's carry; returns (the carry rebased and fitted to the template, `size` results)."""
    graph = tf.compat.v1.get_default_graph()
    group = self.groups[numbers]
    assert group is not None   # `group_of` made it
    like: List[Any] = [None]

    def branch_of(i: int, number: int) -> Callable[[], List[tf.Tensor]]:
      def run() -> List[tf.Tensor]:
        if i == 0:
          carry: groups.Carry = {part: {} for part in groups.PARTS}
        else:
          carry = groups.pack(group.template, compat.call_time_value(
              graph, group.carry_values, group.specs, key="tfpipe_carry"))
        key, inline, shift = self.runtime.numbered[number]
        out, results = self.runtime.trace_tasks(key, inline, carry, inputs, labels, M)
        rebased = groups.rebase(out, shift)
        if i == 0:
          group.set_template(rebased)
        else:
          assert group.template is not None   # the first branch traces first
          rebased = groups.fit(group.template, carry, rebased)
        like[0] = (rebased, groups.pad_results(results, size))
        return groups.flat(like[0])
      return run

    tensors = tf.switch_case(branch, [branch_of(i, n) for i, n in enumerate(numbers)])
    return groups.pack(like[0], tensors)


class Group:
  """A plan's distinct window numbers (the first window's first), the union of their windows'
  input and label keys, and the most mini-batches a window finishes; once traced, the carry's
  `template` (what the first window hands on) and `specs`, and `fillers`: the first window's
  first inputs and labels, which every call passes for the keys its window lacks; `carry`:
  the carry the next call's branch takes (None: the template's zeros)."""

  def __init__(self, numbers: Tuple[int, ...], inputs: List[int], labels: List[int],
               size: int) -> None:
    self.numbers, self.inputs, self.labels, self.size = numbers, inputs, labels, size
    self.template: Optional[groups.Carry] = None
    self.fillers: Optional[List[Any]] = None
    self.carry: Optional[groups.Carry] = None
    self._zeros: Optional[List[tf.Tensor]] = None
    self.specs: List[tf.TensorSpec] = []

  def set_template(self, carry: groups.Carry) -> None:
    self.template = carry
    self.specs = groups.specs(carry)
    self._zeros = None

  def carry_values(self) -> List[tf.Tensor]:
    """The carry's tensors for the call now being made (the template's order)."""
    if self.carry is not None:
      return groups.flat(self.carry)
    if self._zeros is None:
      self._zeros = [groups.zeros(s.shape, s.dtype) for s in self.specs]
    return self._zeros
