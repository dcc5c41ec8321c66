"""Logical CPU devices are created once, before TensorFlow initialises; graph ops record no
Python stack (`tests.tracing`).

Grappler is off in the tests' own process: its rewrites keep what a graph computes, and what
the tests here assert is what the rules compute (against their references and Keras, both
run the same way). It cost about a tenth of the suite's CPU (1037 s user with it, 943 s
without, `-n 2`, the same hour). What ships runs with it on: every program the tests start
(the trainer, the bench scripts, the README snippet, the cluster scenarios) keeps
TensorFlow's defaults, and a test that asserts Grappler's options takes the `grappler`
fixture.

Python's cyclic garbage collector: the tests leave graphs and models behind (about a million
objects per worker by the end), and every full collection walks all of them (18 s of a
390 s run of four test files, measured with `gc.callbacks`). So what the imports made is
frozen out of collection, and every FREEZE_EVERY tests a collection frees the cycles the
tests left and freezes what survives (7 s of GC in the same run). Objects still die by
reference counting when their last reference goes.
"""

import gc
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tfpipe  # noqa: E402
from tests import tracing  # noqa: E402

DEVICES = tfpipe.create_logical_cpus(4)
tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
tracing.skip_op_tracebacks()

FREEZE_EVERY = 20
_finished = [0]
gc.collect()
gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  _finished[0] += 1
  if _finished[0] % FREEZE_EVERY == 0:
    gc.collect()
    gc.freeze()


@pytest.fixture
def grappler():
  """Grappler on for one test, as outside the tests (see the module's docstring)."""
  tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False})
  try:
    yield
  finally:
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
