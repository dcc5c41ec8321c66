"""The tests trace graphs without recording each op's Python stack.

TensorFlow records the Python stack of every graph op it creates, for the "defined at" lines
of a runtime error (`ops._create_c_op(..., extract_traceback=True)`). Tracing is most of the
suite's time, and pytest's deep stacks make each record costly: without them a file of
weight-rule tests ran 10% faster here (58.6 s against 53.0 s, and 69.1 s against 62.8 s, in
runs side by side). The library leaves the records on: a user's error keeps its op's origin.
Set TFPIPE_TEST_OP_TRACEBACKS=1 to keep them in the tests too, when one fails in a graph.
"""

import functools
import inspect
import os


def skip_op_tracebacks():
  """Graph ops created from now on in this process record no Python stack; returns whether
  this TensorFlow lets them (False leaves it as it was)."""
  if os.environ.get("TFPIPE_TEST_OP_TRACEBACKS") == "1":
    return False
  from tensorflow.python.framework import ops
  create = ops._create_c_op   # pylint: disable=protected-access
  if isinstance(create, functools.partial):
    return True
  if "extract_traceback" not in inspect.signature(create).parameters:
    return False
  ops._create_c_op = functools.partial(create, extract_traceback=False)   # pylint: disable=protected-access
  return True
