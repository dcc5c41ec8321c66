"""Window groups: every window of an epoch's plan as a branch of one traced function.

TensorFlow instantiates and optimises a called function again for every
function that calls it (`bench/window_bound.py`), so each distinct window
(warm-up, steady state, drain) paid again for every stage function it calls.
A group traces the plan's distinct windows as the branches of one
`tf.switch_case`: one calling function, so each stage function is optimised
once, and the call runs only the chosen branch.

Branches must take and return one structure. The first window (the warm-up)
traces first, on no carry: the carry it hands on is the `template`, the steady
state's. Every other branch takes the template's tensors, fed when the
function is called (`tfpipe.compat.call_time_value`), not as arguments, so the
function's signature is fixed before the template is known and one trace
holds every window; the warm-up's call is fed zeros it never reads (whatever
it reads it made first). A branch returns the carry rebased to the next window
(`fit`): a key of the template it does not hand on is zeros (no later window
reads it: a window reads only what the schedule made before it), a carried
value it only passed through and the template lacks is dropped, and anything
else outside the template makes the plan ungroupable (`Ungroupable`: the
executor then runs it a window per function). Results are padded to the
group's largest window.
"""

from typing import Any, Dict, List, Sequence, Tuple

import tensorflow as tf

__all__ = ["Ungroupable", "PARTS", "rebase", "specs", "fit", "pad_results", "flat",
           "pack", "zeros", "Carry"]

PARTS = ("x", "saved", "g")   # the carry's parts (`tfpipe.runtime.compiled`)
# What a window hands the next: per part, by unit (stage, batch, micro-batch), its values.
Carry = Dict[str, Dict[Tuple[Any, ...], Any]]


class Ungroupable(Exception):
  """A window's carry does not fit the group's template: run the plan a window per function."""


def rebase(carry: Carry, shift: int) -> Carry:
  """`carry` with its units' batches counted from the next window's first batch."""
  return {part: {(key[0], key[1] - shift) + key[2:]: value for key, value in items.items()}
          for part, items in carry.items()}


def specs(carry: Carry) -> List[tf.TensorSpec]:
  """The `tf.TensorSpec`s of the carry's tensors (`flat` order); every shape known."""
  found = []
  for t in _leaves(carry):
    if not t.shape.is_fully_defined():
      raise Ungroupable(f"a carried tensor of unknown shape {t.shape}")
    found.append(tf.TensorSpec(t.shape, t.dtype))
  return found


def _leaves(value: Any) -> List[tf.Tensor]:
  return [t for t in tf.nest.flatten(value) if t is not None]


def fit(template: Carry, carry: Carry, out: Carry) -> Carry:
  """The rebased carry `out` of a branch traced on `carry` (the template's placeholders), in
  the template's structure (see the module's docstring)."""
  passed = {id(t) for part in PARTS for t in _leaves(carry[part])}
  fitted: Carry = {}
  for part in PARTS:
    items = out.get(part, {})
    for key, value in items.items():
      if key not in template[part] and not all(id(t) in passed for t in _leaves(value)):
        raise Ungroupable(f"carried {part} {key} is not in the first window's carry")
    fitted[part] = {}
    for key, like in template[part].items():
      value = items.get(key)
      if value is None:   # the template's tensors belong to the first branch: only their specs
        value = tf.nest.map_structure(
            lambda t: zeros(t.shape, t.dtype) if isinstance(t, tf.Tensor) else t, like)
      try:
        tf.nest.assert_same_structure(like, value)
      except (ValueError, TypeError) as error:
        raise Ungroupable(f"carried {part} {key}: {error}") from None
      for a, b in zip(_leaves(like), _leaves(value)):
        if a.dtype != b.dtype or not a.shape.is_compatible_with(b.shape):
          raise Ungroupable(f"carried {part} {key}: {b.dtype} {b.shape}, not {a.dtype} {a.shape}")
      fitted[part][key] = value
  return fitted


def zeros(shape: Any, dtype: tf.DType) -> tf.Tensor:
  """A value of `shape` and `dtype` no window reads: zeros, or for a variant (a forward's
  residuals packed into one tensor, `tfpipe.stage.program.StageProgram.carried`) an empty
  optional."""
  if dtype == tf.variant:
    return tf.raw_ops.OptionalNone()
  return tf.zeros(shape, dtype)


def pad_results(results: Sequence[Any], size: int) -> List[Any]:
  """A window's per-batch results padded with zeros to `size` (the group's largest window)."""
  zeros = tf.nest.map_structure(tf.zeros_like, results[0])
  return list(results) + [zeros] * (size - len(results))


def flat(value: Any) -> List[tf.Tensor]:
  """The tensors of `value` (None left out): what a branch returns."""
  return _leaves(value)


def pack(like: Any, tensors: Sequence[tf.Tensor]) -> Any:
  """`tensors` (from `flat`) in the structure of `like`, its None where it has them."""
  flowing = iter(tensors)
  return tf.nest.map_structure(lambda t: None if t is None else next(flowing), like)
