"""A compiled window's carry kept on the TF servers that made it.

A function's outputs made on a TF server travel to the calling program and back to the
server when a later call reads them (measured on emulated hosts: a 64 MB output crossed the
client's link both ways; reading it as the next call's input crossed nothing more). A
window's carry (`tfpipe.runtime.compiled`) holds the kept forwards of asynchronous methods,
weights included: SpecTrain and PipeDream sent their stage 0's weights to the client and
back every window. So each carried tensor made on a TF server is written, inside the window,
into a variable on its own device (one per window function and carried position, of any
shape), and the next window reads the variable: the carry handed between calls holds those
variables instead of tensors. Tensors made in this process are carried as they are.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfpipe import compat

__all__ = ["Parked"]


def _remote(device: str) -> bool:
  """Whether `device` (a graph tensor's device string) names a task of a TF server."""
  return bool(device) and tf.DeviceSpec.from_string(device).job not in (None, "localhost")


def _static(shape: tf.TensorShape) -> Optional[Tuple[Optional[int], ...]]:
  """A hashable form of a static shape (None: unknown rank)."""
  return None if shape.rank is None else tuple(shape.as_list())


class Parked:
  """The variables that hold carried tensors between window calls, by (`slot`, position):
  `slot` names the traced window function (its batch shape key and window number), position
  the tensor's place in the flattened carry. `shapes` records the static shape each variable
  was last traced to hold, which the reading window's trace takes as a Python argument (a
  carry of other shapes traces again, as a tensor carry would)."""

  def __init__(self) -> None:
    self.variables: Dict[Tuple[Any, int], tf.Variable] = {}   # (slot, position)
    self.written: Dict[Any, List[Tuple[int, tf.Variable]]] = {}   # slot: (position, variable)
    self.shapes: Dict[Any, Any] = {}   # a variable's ref: the static shape it holds

  def park(self, slot: Optional[Tuple[Any, ...]], carry: Any, reads: List[tf.Tensor]) -> Any:
    """In a window's trace: `carry` with each tensor made on a TF server written to its
    variable and replaced by None (what the function returns). Each write follows `reads`
    (what `read` returned): a window of the steady state reads the variables it then
    writes, through another handle than the one it writes (an argument, not a capture), so
    TensorFlow's automatic ordering does not see that they are the same (measured: results
    then differed run to run). A write replaces the buffer a read still in use holds.
    `slot` None: every stage is in this process, and `carry` is returned as it is."""
    if slot is None:
      return carry
    leaves = tf.nest.flatten(carry)
    written = []
    for i, value in enumerate(leaves):
      if isinstance(value, tf.Tensor) and _remote(value.device):
        variable = self._variable((slot, i), value)
        with tf.control_dependencies(reads):
          variable.assign(value)
        self.shapes[variable.ref()] = _static(value.shape)
        written.append((i, variable))
        leaves[i] = None
    self.written[slot] = written
    return tf.nest.pack_sequence_as(carry, leaves)

  def _variable(self, key: Tuple[Any, int], value: tf.Tensor) -> tf.Variable:
    if key not in self.variables:
      self.variables[key] = compat.untracked_variable(value.dtype, value.device)
    return self.variables[key]

  def unpark(self, slot: Optional[Tuple[Any, ...]], carry: Any) -> Any:
    """After a call of window function `slot`: its returned `carry` with the variables it
    wrote in their places (`slot` None: `carry` as it is)."""
    if slot is None:
      return carry
    leaves = tf.nest.flatten(carry)
    for i, variable in self.written.get(slot, ()):
      leaves[i] = variable
    return tf.nest.pack_sequence_as(carry, leaves)

  def shapes_of(self, carry: Any) -> Tuple[Any, ...]:
    """The Python argument that goes with `carry` into a window call: the static shapes of its
    variables, in order."""
    return tuple(self.shapes[leaf.ref()] for leaf in tf.nest.flatten(carry)
                 if isinstance(leaf, tf.Variable))

  def read(self, carry: Any, shapes: Sequence[Any]) -> Tuple[Any, List[Any]]:
    """In a window's trace: (`carry` with each variable read on its device, at the static
    shape `shapes` gives it (`shapes_of`), the ops that follow the reads). Each variable is
    emptied once read: the read holds the buffer for as long as the window uses it, and the
    variable no longer does, so a carried tensor lives until the window that reads it is
    done with it. Each window function has variables of its own (its `slot`): kept, each
    slot's held its last carry, weights included, until the epoch's end (`release`)."""
    static = iter(shapes)
    leaves, reads = [], []
    for leaf in tf.nest.flatten(carry):
      if isinstance(leaf, tf.Variable):
        with tf.device(leaf.device):
          value = leaf.read_value()
          with tf.control_dependencies([value]):
            reads.append(leaf.assign(compat.empty_value(leaf.dtype), read_value=False))
        shape = next(static)
        value.set_shape(None if shape is None else tf.TensorShape(list(shape)))
        leaf = value
      leaves.append(leaf)
    return tf.nest.pack_sequence_as(carry, leaves), reads

  def release(self) -> None:
    """Frees what the variables hold (an epoch's end: nothing is carried past it)."""
    for variable in self.variables.values():
      with tf.device(variable.device):
        variable.assign(compat.empty_value(variable.dtype))
