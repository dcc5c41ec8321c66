"""Dataset iterators are deleted off the caller's thread, once the caller lets them go."""

import threading

import keras
import pytest
import tensorflow as tf

from tests import helpers
from tfpipe.runtime import iterators


class _Probe:
  """Records the thread that deletes it."""

  def __init__(self):
    self.deleted = threading.Event()
    self.where = []

  def __del__(self):
    self.where.append(threading.current_thread().name)
    self.deleted.set()


def test_release_deletes_on_its_own_thread_once_the_caller_lets_go(monkeypatch):
  monkeypatch.setattr(iterators, "WAIT", 60.0)   # a slow machine outwaits no caller here
  probe = _Probe()
  deleted, where = probe.deleted, probe.where
  probe = iterators.release(probe)
  assert probe is None
  assert deleted.wait(5.0) and where == [iterators.THREAD_NAME]
  # A reference the caller still holds keeps it alive; it goes on the releasing thread after.
  kept = _Probe()
  deleted, where = kept.deleted, kept.where
  iterators.release(kept)
  assert not deleted.wait(0.3)
  del kept
  assert deleted.wait(5.0) and where == [iterators.THREAD_NAME]
  assert iterators.release(None) is None


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
def test_fit_evaluate_and_predict_release_every_iterator_they_read(monkeypatch, runtime):
  released = []
  original = iterators.release

  def recording(iterator):
    if iterator is not None:
      released.append(type(iterator).__name__)
    return original(iterator)

  monkeypatch.setattr(iterators, "release", recording)
  x, y = helpers.as_arrays(helpers.batches(4))
  pipe, compile_ = helpers.pipeline(helpers.mlp(), runtime, num_stages=2, method="pipedream")
  compile_(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  pipe.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0)
  # One per epoch, one per validation.
  assert released == ["OwnedIterator"] * 4
  pipe.evaluate(x, y, batch_size=16, verbose=0)
  pipe.predict(x, batch_size=16, verbose=0)
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
  pipe.fit(dataset, epochs=1, verbose=0)   # the user's dataset too
  assert released == ["OwnedIterator"] * 7


def test_wait_returns_once_every_released_iterator_is_deleted(monkeypatch):
  monkeypatch.setattr(iterators, "WAIT", 60.0)
  kept = _Probe()
  deleted = kept.deleted
  iterators.release(kept)
  iterators.wait(timeout=0.2)   # bounded: the caller still holds it
  assert not deleted.is_set()
  del kept
  iterators.wait()
  assert deleted.is_set()


def test_the_program_exits_only_once_a_released_iterator_is_deleted():
  # A deletion still running when Python finalised would be cut off (in TensorFlow's C++, an
  # abort): the process waits for it, here a slow deletion released just before the end.
  from tests import zygote
  code = ("import time\n"
          "from tfpipe.runtime import iterators\n"
          "class Slow:\n"
          "  def __del__(self):\n"
          "    time.sleep(1.0)\n"
          "    print('deleted', flush=True)\n"
          "iterators.release(Slow())\n"
          "print('main ends', flush=True)\n")
  result = zygote.run(["-c", code])
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["main", "ends", "deleted"]
