"""Small models and batches shared by the tests, and the mark of tests that need emulated
hosts."""

import copy
import hashlib
import json

import keras
import numpy as np
import pytest

from tfpipe.cluster import emulation


def mlp(width=16, depth=4, inputs=8, classes=3, seed=0):
  keras.utils.set_random_seed(seed)
  x = keras.Input((inputs,))
  h = x
  for i in range(depth):
    h = keras.layers.Dense(width, activation="selu", name=f"dense{i}")(h)
  return keras.Model(x, keras.layers.Dense(classes, name="logits")(h), name="mlp")


def sequential_mlp(width=16, depth=4, inputs=8, classes=3, seed=0, dtype=None):
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((inputs,), dtype=dtype)]
  layers += [keras.layers.Dense(width, activation="selu", dtype=dtype) for _ in range(depth)]
  layers += [keras.layers.Dense(classes, dtype=dtype)]
  return keras.Sequential(layers, name="seq_mlp")


def skip_model(seed=0, dtype=None):
  """dense0 -> dense1 -> dense2 -> add(dense2, dense0) -> logits; the skip crosses cuts."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,), dtype=dtype)
  a = keras.layers.Dense(16, activation="tanh", name="dense0", dtype=dtype)(x)
  b = keras.layers.Dense(16, activation="tanh", name="dense1", dtype=dtype)(a)
  c = keras.layers.Dense(16, activation="tanh", name="dense2", dtype=dtype)(b)
  d = keras.layers.Add(name="add", dtype=dtype)([c, a])
  return keras.Model(x, keras.layers.Dense(3, name="logits", dtype=dtype)(d), name="skip")


def batches(n=20, batch_size=16, inputs=8, classes=3, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.standard_normal((batch_size, inputs)).astype("float32"),
           rng.integers(0, classes, batch_size)) for _ in range(n)]


def as_arrays(bs):
  return np.concatenate([b[0] for b in bs]), np.concatenate([b[1] for b in bs])


def assert_close(actual, expected, rtol=1e-5, err_msg=""):
  """`actual` equals `expected` (two computations of one value, arrays or nests of arrays)
  within `rtol` of the largest magnitude compared: float32 kernels differ between CPUs
  (AVX2, AVX-512) by a few ulps of the values' scale, so an element near zero is held to
  the array's scale, not to its own."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale, err_msg=err_msg)


def assert_weights_close(actual, expected, rtol=1e-5, atol=0.0):
  """Each weight within `rtol` of its largest magnitude (`assert_close`), or `atol`."""
  assert len(actual) == len(expected)
  for a, e in zip(actual, expected):
    a, e = np.asarray(a), np.asarray(e)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    np.testing.assert_allclose(a, e, rtol=rtol, atol=max(atol, rtol * scale))


def dropout_mlp(rate=0.3, seed=0, dtype=None):
  """dense0 drop0 dense1 drop1 dense2 drop2 logits: cut into 3 stages at [0, 2, 4, 7] (or 2
  at [0, 2, 7]), every stage draws dropout masks."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((8,), dtype=dtype)]
  for i in range(3):
    layers += [keras.layers.Dense(16, activation="tanh", name=f"dense{i}", dtype=dtype),
               keras.layers.Dropout(rate, seed=seed + i, name=f"drop{i}", dtype=dtype)]
  layers += [keras.layers.Dense(3, name="logits", dtype=dtype)]
  return keras.Sequential(layers, name="dropout_mlp")


DROPOUT_CUTS = {2: [0, 2, 7], 3: [0, 2, 4, 7]}


_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
          "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
          "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
          "on_predict_batch_begin", "on_predict_batch_end")


class TwoWayEmbedding(keras.layers.Embedding):
  """An embedding with an untied output projection (as KerasHub's `ReversibleEmbedding`):
  called on tokens it reads `embeddings`, with `reverse=True` only `kernel`."""

  def build(self, input_shape=None):
    super().build(input_shape)
    self.kernel = self.add_weight(shape=(self.output_dim, self.input_dim), name="kernel")

  def call(self, x, reverse=False):
    return keras.ops.matmul(x, self.kernel) if reverse else super().call(x)

  def compute_output_spec(self, x, reverse=False):
    if reverse:
      return keras.KerasTensor(x.shape[:-1] + (self.input_dim,), x.dtype)
    return super().compute_output_spec(x)


def two_way_lm(seed=0, vocab=40, length=6):
  """A per-token LM whose embedding layer is called again as its head (untied)."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((length,), dtype="int32")
  ends = TwoWayEmbedding(vocab, 16, name="ends")
  h = keras.layers.Dense(16, activation="relu", name="block")(ends(tokens))
  return keras.Model(tokens, ends(h, reverse=True), name="two_way_lm")


class Recorder(keras.callbacks.Callback):
  """Records every hook as (name, [index]) in `calls` and its logs in `logs`."""

  def __init__(self):
    super().__init__()
    self.calls, self.logs = [], []


def _recording(name):
  def hook(self, *args, **kwargs):
    index = tuple(a for a in args if isinstance(a, int))
    logs = kwargs.get("logs", args[-1] if args and isinstance(args[-1], dict) else None)
    self.calls.append((name,) + index)
    self.logs.append(dict(logs) if logs else {})
  return hook


for _name in _HOOKS:
  setattr(Recorder, _name, _recording(_name))


def two_input_model(seed=0):
  """Inputs "a" (8) and "b" (4), concatenated, then Dense layers: dict and list inputs."""
  keras.utils.set_random_seed(seed)
  a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
  h = keras.layers.Concatenate(name="join")([a, b])
  h = keras.layers.Dense(16, activation="tanh", name="dense0")(h)
  h = keras.layers.Dense(16, activation="tanh", name="dense1")(h)
  return keras.Model([a, b], keras.layers.Dense(3, name="logits")(h), name="two_inputs")


# The executors every weight-rule test runs on: the threaded reference interpreter, and the
# compiled executor with a window of 3 mini-batches, so batches cross many window boundaries.
# The compiled runtime calls each stage's traced task functions (`inline=False`: what real
# models get; tiny test models would otherwise be inlined, which the other tests cover).
RUNTIMES = [{"executor": "threaded"},
            {"executor": "compiled", "steps_per_execution": 3, "inline": False}]
RUNTIME_IDS = ["threaded", "compiled-w3-calls"]


def on_one_worker(group, cases, key=None):
  """`cases` (a parametrize list) as params that pytest-xdist runs on one worker per group
  (`key(case)`, or each case its own): the runs of a case on each executor then share one
  reference rule or Keras fit (`reference_train`, `keras_fit_weights` keep them per worker)."""
  params = []
  for i, case in enumerate(cases):
    name = f"{group}-{i if key is None else key(case)}"
    params.append(pytest.param(*(case if isinstance(case, tuple) else (case,)),
                               marks=pytest.mark.xdist_group(name)))
  return params


def pipeline(model, runtime, **options):
  """A Pipeline on `runtime` (an entry of RUNTIMES) and a function compiling it."""
  import tfpipe
  pipe = tfpipe.Pipeline(model, executor=runtime["executor"], **options)
  window = runtime.get("steps_per_execution", "auto")

  def compile_(*args, **kwargs):
    pipe.compile(*args, steps_per_execution=window, **kwargs)
    if "inline" in runtime:
      pipe.runtime.inline = runtime["inline"]
  return pipe, compile_


# reference_train's and keras_fit_weights's results by a digest of everything they depend on:
# a weight-rule test runs once per executor (RUNTIMES) on the same stages, data and rule, and
# the eager reference is a third of such a test's time.
_RESULTS = {}


def _renamed(config):
  """`config` with every name ("name" values, and the strings equal to one, as in a
  functional model's node links) replaced by its order of appearance: two models built
  alike digest alike, whatever names Keras gave their layers."""
  names = {}

  def collect(c):
    if isinstance(c, dict):
      if isinstance(c.get("name"), str):
        names.setdefault(c["name"], f"name{len(names)}")
      for v in c.values():
        collect(v)
    elif isinstance(c, (list, tuple)):
      for v in c:
        collect(v)

  def rename(c):
    if isinstance(c, dict):
      return {k: rename(v) for k, v in c.items()}
    if isinstance(c, (list, tuple)):
      return [rename(v) for v in c]
    return names.get(c, c) if isinstance(c, str) else c

  collect(config)
  return rename(config)


def _digest(value, h):
  """Feeds `value` (arrays, Keras objects, plain data, nested) to the hash `h`."""
  if isinstance(value, np.ndarray):
    h.update(f"{value.dtype}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
  elif isinstance(value, (keras.Model, keras.losses.Loss, keras.optimizers.Optimizer)):
    h.update(type(value).__qualname__.encode())
    h.update(json.dumps(_renamed(value.get_config()), sort_keys=True, default=repr).encode())
    if isinstance(value, keras.Model):
      for w in value.weights:
        _digest(np.asarray(w.numpy()), h)
  elif isinstance(value, dict):
    for k in sorted(value):
      h.update(repr(k).encode())
      _digest(value[k], h)
  elif isinstance(value, (list, tuple)):
    h.update(f"{type(value).__name__}{len(value)}".encode())
    for v in value:
      _digest(v, h)
  elif value is None or isinstance(value, (bool, int, float, str)):
    h.update(repr(value).encode())
  else:
    raise TypeError(f"no digest for {type(value).__name__}")


def _cached(parts, compute):
  """`compute()`, once per distinct digest of `parts` in this process (a copy of the result
  each call); parts it cannot digest are never cached."""
  h = hashlib.sha256()
  try:
    _digest(parts, h)
  except Exception:   # noqa: BLE001 - e.g. a layer without get_config: not cached
    return compute()
  key = h.hexdigest()
  if key not in _RESULTS:
    _RESULTS[key] = compute()
  return copy.deepcopy(_RESULTS[key])


def reference_train(stage_models, loss_fn, batches, method, *args, **kwargs):
  """`tfpipe.rules.reference.reference_train`, computed once per distinct input in this process
  (a copy of the result each call); inputs it cannot digest are never cached."""
  from tfpipe.rules import advice, reference
  # The options left unset resolve through tfpipe.rules.advice's tables (tests patch them).
  return _cached(["reference", list(stage_models), loss_fn, batches, method, list(args), kwargs,
                  advice.SPECTRAIN, advice.ONE_UPDATE, advice.ONE_UPDATE_STAGES,
                  advice.ADVISABLE, advice.MICRO_BATCHES],
                 lambda: reference.reference_train(stage_models, loss_fn, batches, method, *args,
                                                   **kwargs))


def keras_fit_weights(model, optimizer, loss, x, y, **fit_kwargs):
  """`model`'s weights after `model.compile(optimizer, loss)` and `model.fit(x, y,
  **fit_kwargs)`, the fit run once per distinct input in this process: many equivalence tests
  hold pipelines of several K, methods and executors to one Keras run. `model` is left
  untrained when the result is cached."""
  def fit():
    model.compile(optimizer, loss)
    model.fit(x, y, **fit_kwargs)
    return model.get_weights()
  return _cached(["keras fit", model, optimizer, loss, x, y, fit_kwargs], fit)


def hosts_unavailable():
  """Why emulated hosts cannot be made here (`tfpipe.cluster.emulation`: not root, no
  namespaces, no pyroute2), or None."""
  try:
    emulation.check_available()
  except emulation.EmulationUnavailable as e:
    return str(e)
  return None


# Tests that make emulated hosts skip, saying why, where they cannot be made.
needs_hosts = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))
