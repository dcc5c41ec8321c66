"""Per-token language models (outputs of shape (batch, sequence, vocabulary)) through a pipeline.

The synchronous schedules and `data_parallel` equal Keras `fit` on a KerasHub Llama with a
per-token head (weights, History, evaluate, predict), batches of one length and bucketed
batches of several, trained with AdamW as language models are, with and without
`global_clipnorm`; every Keras optimizer with per-row state equals Keras on an embedding's
rows at any M; the asynchronous methods follow their reference rules on a per-token model
(`tfpipe.rules.reference`), on both executors.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import helpers
from tests import test_conformance as conformance

VOCAB, LENGTH = 32, 8


def token_lm(seed=0, dtype="float64"):
  """A per-token model small enough for the reference rules: embedding, two per-token Dense
  layers, a head over the vocabulary."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((None,), dtype="int32"),
      keras.layers.Embedding(VOCAB, 8, dtype=dtype),
      keras.layers.Dense(16, activation="tanh", dtype=dtype),
      keras.layers.Dense(16, activation="tanh", dtype=dtype),
      keras.layers.Dense(VOCAB, name="lm_head", dtype=dtype)], name="token_lm")


def token_batches(n=6, batch_size=8, length=LENGTH, seed=3):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    tokens = rng.integers(1, VOCAB, (batch_size, length + 1)).astype("int32")
    out.append((tokens[:, :-1], tokens[:, 1:]))
  return out


def _loss(dtype="float64"):
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype=dtype)


# One per kind of rule: recomputing (vanilla), stashed (pipedream), predicted (spectrain, M=1
# and micro-batched), one update old (2bw), delayed (ddg), a mini-batch backward (timeprest).
ASYNC = [("vanilla", {}), ("pipedream", {}), ("spectrain", {"micro_batches": 1}),
         ("spectrain", {"micro_batches": 2, "version_difference": "exact"}),
         ("2bw", {}), ("ddg", {}), ("timeprest", {"micro_batches": 2})]


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,options", helpers.on_one_worker(
    "lm-async", ASYNC, key=lambda c: c[0] + str(c[1].get("micro_batches", ""))))
def test_asynchronous_methods_follow_their_rules_on_a_per_token_model(method, options, runtime):
  lr, momentum = 0.05, 0.9
  bs = token_batches()
  x, y = helpers.as_arrays(bs)
  pipe, compile_ = helpers.pipeline(token_lm(), runtime, num_stages=3, method=method, **options)
  assert list(pipe.stage_models[-1].outputs[0].shape) == [None, None, VOCAB]
  expected, _ = helpers.reference_train(pipe.stage_models, _loss(), bs, method, lr, momentum,
                                        **options)
  compile_(tfpipe.optimizers.SpecTrain(lr, momentum), _loss())
  history = pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  for p, ref in zip(pipe.programs, expected):
    helpers.assert_weights_close([v.numpy() for v in p.trainable], ref, rtol=1e-7, atol=1e-9)


# The synchronous schedules on a KerasHub Llama with a per-token head, against Keras.

def hub_lm(seed=0):
  keras_hub = pytest.importorskip("keras_hub")
  keras.utils.set_random_seed(seed)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
      hidden_dim=16, intermediate_dim=32, max_sequence_length=16)
  return keras.Model(backbone.inputs, keras.layers.Dense(VOCAB, name="lm_head")(backbone.output),
                     name="llama_lm")


def lm_data(n=32, length=LENGTH, seed=2):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (n, length + 1)).astype("int32")
  return ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, length), "int32")},
          tokens[:, 1:])


def bucketed(lengths=(8, 5, 8, 5), batch_size=8, seed=4):
  """Batches of text bucketed by length: each batch has its own sequence length."""
  rng = np.random.default_rng(seed)
  out = None
  for length in lengths:
    tokens = rng.integers(1, VOCAB, (batch_size, length + 1)).astype("int32")
    part = tf.data.Dataset.from_tensors(
        ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch_size, length), "int32")},
         tokens[:, 1:]))
    out = part if out is None else out.concatenate(part)
  return out


def _lm_compile(data="arrays"):
  # AdamW, as language models train: its per-row moments see an embedding's rows as Keras
  # hands them (the backbone's unused reverse embedding gets no step and no decay). With
  # global_clipnorm Keras makes the gradients dense (a product with the clip factor).
  clip = {"global_clipnorm": 0.05} if data == "clipped" else {}
  return {"optimizer": keras.optimizers.AdamW(0.01, weight_decay=0.05, **clip),
          "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          "metrics": ["accuracy"]}


SYNC = [("sequential", 1, {}), ("gpipe", 2, {}), ("1f1b", 2, {}), ("interleaved", 2, {}),
        ("zb", 2, {}), ("zbv", 2, {}), ("1f1b", 2, {"data_parallel": 2}),
        ("zb", 2, {"executor": "threaded"})]
_KERAS = {}


def _train_lm(trainer, data):
  """(weights, History, evaluate's logs, predict's outputs) of `trainer` (a Keras model or a
  pipeline, compiled) on `data`: "bucketed" (no predict), else the arrays of `lm_data`."""
  if data == "bucketed":
    history = trainer.fit(bucketed(), epochs=2, shuffle=False, verbose=0)
    logs, predicted = trainer.evaluate(bucketed(), verbose=0, return_dict=True), None
  else:
    x, y = lm_data()
    history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    logs = trainer.evaluate(x, y, verbose=0, return_dict=True)
    predicted = trainer.predict(x, verbose=0)
  return history.history, logs, predicted


def _keras_lm(data):
  if data not in _KERAS:
    model = hub_lm()
    model.compile(run_eagerly=True, **_lm_compile(data))
    history, logs, predicted = _train_lm(model, data)
    _KERAS[data] = (model.get_weights(), history, logs, predicted)
  return _KERAS[data]


def _pipe_lm(data, method, micro_batches, options):
  model = hub_lm()
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=micro_batches,
                         **options)
  pipe.compile(**_lm_compile(data))
  history, logs, predicted = _train_lm(pipe, data)
  return model.get_weights(), history, logs, predicted


def _sync_id(case):
  method, m, options = case
  return f"{method}{m}" + "".join(f"-{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("method,micro_batches,options", [
    pytest.param(*c, id=_sync_id(c), marks=pytest.mark.xdist_group("lm-sync")) for c in SYNC])
def test_per_token_llama_same_as_keras_on_every_synchronous_schedule(method, micro_batches,
                                                                    options):
  expected = _keras_lm("arrays")
  got = _pipe_lm("arrays", method, micro_batches, options)
  assert got[3].shape == (32, LENGTH, VOCAB)
  conformance.assert_same(expected, got, 2e-5)


@pytest.mark.parametrize("method,micro_batches,options", [
    pytest.param(*c, id=_sync_id(c), marks=pytest.mark.xdist_group("lm-bucketed"))
    for c in [("1f1b", 2, {})]])
def test_bucketed_sequence_lengths_same_as_keras(method, micro_batches, options):
  expected = _keras_lm("bucketed")
  got = _pipe_lm("bucketed", method, micro_batches, options)
  conformance.assert_same(expected[:3] + (None,), got[:3] + (None,), 2e-5)   # no predict


def test_a_new_sequence_length_does_not_trace_the_windows_again(caplog):
  # Six lengths: the first traces at its own shape, the second at a shape relaxed to any
  # length (TensorFlow's reduce_retracing), the rest run that trace; no retracing warning.
  lengths = (4, 6, 8, 10, 12, 14)
  data = None
  for i, length in enumerate(lengths):
    x, y = token_batches(n=1, length=length, seed=i)[0]
    part = tf.data.Dataset.from_tensors((x, y))
    data = part if data is None else data.concatenate(part)
  pipe = tfpipe.Pipeline(token_lm(), num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(keras.optimizers.SGD(0.1), _loss())
  with caplog.at_level("WARNING", logger="tensorflow"):
    history = pipe.fit(data, epochs=2, shuffle=False, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert pipe.runtime.traces <= 2, pipe.runtime.traces
  assert not [r for r in caplog.records if "retracing" in r.getMessage()]


@pytest.mark.parametrize("method,micro_batches,options", [
    pytest.param(*c, id=_sync_id(c), marks=pytest.mark.xdist_group("lm-clipped"))
    for c in [("1f1b", 2, {"data_parallel": 2})]])
def test_per_token_llama_global_clipnorm_same_as_keras(method, micro_batches, options):
  expected = _keras_lm("clipped")
  assert max(float(np.max(np.abs(a - b)))   # the clip acts: the weights differ from unclipped
             for a, b in zip(expected[0], _keras_lm("arrays")[0])) > 1e-2
  conformance.assert_same(expected, _pipe_lm("clipped", method, micro_batches, options), 2e-5)


# Keras's optimizers on an embedding's rows: Keras hands the optimizer the batch's rows (a
# token read twice, twice), which Adam, Adagrad, RMSprop, ... square one by one; the
# micro-batches' rows are kept and handed over together, never summed into a dense matrix.

ROW_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
}
ROW_CASES = ([(name, "1f1b", 4, {}) for name in ROW_OPTIMIZERS] +
             [("adamw", "gpipe", 2, {}), ("adamw", "zb", 3, {}), ("adamw", "interleaved", 2, {}),
              ("adamw", "zbv", 2, {}), ("adamw", "1f1b", 2, {"data_parallel": 2}),
              ("adamw", "zb", 2, {"executor": "threaded"})])
_ROW_KERAS = {}


def _row_keras(name):
  if name not in _ROW_KERAS:
    model = token_lm()
    model.compile(ROW_OPTIMIZERS[name](), _loss())
    model.fit(*helpers.as_arrays(token_batches()), batch_size=8, epochs=2, shuffle=False,
              verbose=0)
    _ROW_KERAS[name] = model.get_weights()
  return _ROW_KERAS[name]


@pytest.mark.parametrize("name,method,micro_batches,options", [
    pytest.param(*c, id=f"{c[0]}-{_sync_id(c[1:])}", marks=pytest.mark.xdist_group(f"rows-{c[0]}"))
    for c in ROW_CASES])
def test_optimizers_with_per_row_state_equal_keras_on_an_embeddings_rows(name, method,
                                                                        micro_batches, options):
  # float64: Keras's own result within 1e-9. Summed dense, the rows gave Adam 5e-2 apart.
  model = token_lm()
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=micro_batches,
                         **options)
  pipe.compile(ROW_OPTIMIZERS[name](), _loss())
  pipe.fit(*helpers.as_arrays(token_batches()), batch_size=8, epochs=2, shuffle=False, verbose=0)
  if not options:
    assert pipe.programs[0].updates.seen_rows == {0}   # the embedding's rows were kept
  helpers.assert_weights_close(model.get_weights(), _row_keras(name), rtol=1e-7, atol=1e-9)


class SpareDense(keras.layers.Dense):
  """A Dense layer with a weight nothing reads."""

  def build(self, input_shape):
    super().build(input_shape)
    self.spare = self.add_weight(shape=(3,), initializer="ones", name="spare")


@pytest.mark.parametrize("method,micro_batches,options", [
    ("1f1b", 2, {}), ("zb", 2, {"executor": "threaded"}), ("1f1b", 2, {"data_parallel": 2}),
    ("1f1b", 2, {"data_parallel": 2, "cross_device_ops": "ring"})])
def test_a_weight_the_loss_does_not_read_gets_no_step_as_in_keras(method, micro_batches, options):
  # AdamW would decay it, Adam's moments move it: Keras's optimizer leaves it alone.
  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), SpareDense(16, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), SpareDense(3)])
  x, y = helpers.as_arrays(helpers.batches(4, batch_size=8, inputs=8))
  optimizer = lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5)
  expected = build()
  expected.compile(optimizer(), "sparse_categorical_crossentropy")
  expected.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  model = build()
  pipe = tfpipe.Pipeline(model, num_stages=2, method=method, micro_batches=micro_batches,
                         **options)
  pipe.compile(optimizer(), "sparse_categorical_crossentropy")
  pipe.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  for layer in (model.layers[0], model.layers[2]):
    np.testing.assert_array_equal(layer.spare.numpy(), np.ones(3))
  helpers.assert_weights_close(model.get_weights(), expected.get_weights(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("data", [
    pytest.param("arrays", marks=pytest.mark.xdist_group("lm-sync")),
    pytest.param("clipped", marks=pytest.mark.xdist_group("lm-clipped"))])
def test_per_token_llama_same_as_keras_when_auto_chooses_a_synchronous_schedule(data,
                                                                               monkeypatch):
  # Momentum SGD: the probe trains first. Its profile, forced to pay, runs after its second
  # mini-batch and puts back what its updates change (embedding rows as slices, momentum, a
  # global-norm decision, the running metrics); gpipe at M=4 takes over the rest on the
  # probe's programs.
  from tfpipe.plan import auto as auto_plan
  from tfpipe.training import probe as probe_lib
  monkeypatch.setattr(probe_lib, "PROFILE_SHARE", 1e9)
  monkeypatch.setattr(auto_plan, "candidates", lambda *a: [
      auto_plan.Candidate("gpipe", 4, "synchronous")])
  expected = _keras_lm(data)
  model = hub_lm()
  pipe = tfpipe.Pipeline(model, num_stages=2, method="auto")
  pipe.compile(steps_per_execution=1, **_lm_compile(data))
  history, logs, predicted = _train_lm(pipe, data)
  assert pipe.chosen.name == "gpipe M=4" and pipe.chosen.after == 2
  assert pipe.micro_batches == 4 and predicted.shape == (32, LENGTH, VOCAB)
  conformance.assert_same(expected, (model.get_weights(), history, logs, predicted), 2e-5)


def test_a_weight_two_stages_read_is_refused_on_asynchronous_methods_one_they_hold_is_not():
  tied = llama_causal_lm(tie=True)
  with pytest.raises(ValueError, match=r"weight 'token_embedding/embeddings' of model "
                                       r"'llama_causal_lm(_\d+)?' is used on stages 0 and 1 .* "
                                       r"method 'spectrain' \(asynchronous\)"):
    tfpipe.Pipeline(tied, num_stages=2, method="spectrain")
  pipe = tfpipe.Pipeline(tied, num_stages=4, method="1f1b")   # cut through its backbone
  assert pipe.partition.layer_names == [["token_embedding", "transformer_layer_0"],
                                        ["transformer_layer_1"], ["sequence_output_layernorm"],
                                        ["token_embedding"]]
  assert pipe.partition.shared == (((0, 0), (3, 0)),)   # read on 0 and 3
  # Untied, the embedding layer is called on both stages too, but stage 0 reads only its
  # embeddings and stage 3 only its reverse kernel: nothing is shared, each holds the other's
  # unread, and the asynchronous methods take it.
  untied = llama_causal_lm()
  pipe = tfpipe.Pipeline(untied, num_stages=4, method="1f1b")
  assert pipe.partition.shared == () and pipe.partition.unread == ((1,), (), (), (0,))
  tfpipe.Pipeline(untied, num_stages=2, method="spectrain")
  with pytest.raises(ValueError, match=r"partition names layer 'no_such_layer'"):
    tfpipe.Pipeline(untied, num_stages=2, method="1f1b", partition=["no_such_layer"])


# KerasHub task models as users build them (from config, random weights), passed as built.

def _hub():
  return pytest.importorskip("keras_hub").models


def llama_causal_lm(seed=0, tie=False):   # untied: its head reads a reverse kernel of its own
  keras.utils.set_random_seed(seed)
  backbone = _hub().LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                  tie_word_embeddings=tie)
  return _hub().LlamaCausalLM(backbone=backbone, preprocessor=None)


def gemma_causal_lm(seed=0):   # its head is the token embedding, tied
  keras.utils.set_random_seed(seed)
  backbone = _hub().GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32,
                                  head_dim=8)
  return _hub().GemmaCausalLM(backbone=backbone, preprocessor=None)


def mistral_causal_lm(seed=0):
  keras.utils.set_random_seed(seed)
  backbone = _hub().MistralBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
                                    num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
  return _hub().MistralCausalLM(backbone=backbone, preprocessor=None)


def bert_classifier(seed=0):
  keras.utils.set_random_seed(seed)
  backbone = _hub().BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                 intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
  return _hub().BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None,
                                   dropout=0.0)


def resnet_classifier(seed=0):
  """In float64: batch normalisation over 32 images amplifies float32 round-off (CPU kernels
  differ by a few ulps) to 4e-4 of the weights' scale in a few steps; float64 keeps the
  comparison to what the pipeline computes."""
  keras.utils.set_random_seed(seed)
  backbone = _hub().ResNetBackbone(
      input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
      stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
      image_shape=(16, 16, 3), dtype="float64")
  return _hub().ResNetImageClassifier(backbone=backbone, num_classes=3, preprocessor=None,
                                      dtype="float64")


def bart_lm(seed=0):
  """An encoder-decoder whose encoder and decoder share the token embedding, with a head."""
  keras.utils.set_random_seed(seed)
  backbone = _hub().BartBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                                 intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
  head = keras.layers.Dense(VOCAB, name="lm_head")(backbone.output["decoder_sequence_output"])
  return keras.Model(backbone.inputs, head, name="bart_lm")


def _causal_data():
  x, y = lm_data()
  x["padding_mask"][:, -2:] = 0   # padded ends, weighted out as KerasHub's preprocessors do
  return x, y, {"sample_weight": x["padding_mask"].astype("float32")}


def _text_data():
  rng = np.random.default_rng(5)
  x = {"token_ids": rng.integers(1, VOCAB, (32, LENGTH)).astype("int32"),
       "padding_mask": np.ones((32, LENGTH), "int32"),
       "segment_ids": np.zeros((32, LENGTH), "int32")}
  return x, rng.integers(0, 3, 32), {}


def _image_data():
  rng = np.random.default_rng(6)
  return rng.standard_normal((32, 16, 16, 3)), rng.integers(0, 3, 32), {}   # float64


def _seq2seq_data():
  rng = np.random.default_rng(7)
  tokens = rng.integers(1, VOCAB, (32, LENGTH + 1)).astype("int32")
  ones = np.ones((32, LENGTH), "int32")
  return ({"encoder_token_ids": rng.integers(1, VOCAB, (32, LENGTH)).astype("int32"),
           "encoder_padding_mask": ones, "decoder_token_ids": tokens[:, :-1],
           "decoder_padding_mask": ones}, tokens[:, 1:], {})


def _task_compile(name=""):
  # The untied Llama without clipping: its embedding's gradient reaches Keras's AdamW as
  # rows (only stage 0 reads it; the head's stage holds it unread), and the pipeline's too.
  clip = {} if name == "llama_causal_lm" else {"global_clipnorm": 1.0}
  return {"optimizer": keras.optimizers.AdamW(0.01, weight_decay=0.05, **clip),
          "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
          "weighted_metrics": ["accuracy"]}


TASKS = {
    # name: (build, data, method, micro-batches, Pipeline options); K=4 devices unless the
    # options say (zbv: 2, each holding two stages)
    "llama_causal_lm": (llama_causal_lm, _causal_data, "1f1b", 2, {}),
    "llama_causal_lm-threaded-zbv": (llama_causal_lm, _causal_data, "zbv", 2,
                                     {"executor": "threaded", "num_stages": 2}),
    "gemma_causal_lm-data_parallel": (gemma_causal_lm, _causal_data, "zb", 2,
                                      {"num_stages": 2, "data_parallel": 2}),
    "mistral_causal_lm": (mistral_causal_lm, _causal_data, "1f1b", 2,
                          {"partition": ["transformer_layer_1", "sequence_output_layernorm",
                                         "token_embedding"]}),
    "bert_text_classifier": (bert_classifier, _text_data, "gpipe", 2, {"num_stages": 2}),
    "resnet_image_classifier": (resnet_classifier, _image_data, "sequential", 1,
                                {"num_stages": 2}),
    "bart_shared_embedding": (bart_lm, _seq2seq_data, "1f1b", 2,
                              {"partition": ["token_embedding", "transformer_encoder_layer_0",
                                             "transformer_decoder_layer_0"]}),
}


def _fit_task(trainer, data, fit_kwargs):
  x, y, weights = data
  history = trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **fit_kwargs,
                        **weights)
  logs = trainer.evaluate(x, y, verbose=0, return_dict=True, **weights)
  return history.history, logs, trainer.predict(x, verbose=0)


@pytest.mark.parametrize("name", list(TASKS))
def test_keras_hub_task_models_train_as_built_same_as_keras(name, tmp_path):
  build, data, method, micro_batches, options = TASKS[name]
  data = data()
  task = build()
  task.compile(run_eagerly=True, **_task_compile(name))
  expected = _fit_task(task, data, {})
  expected = (task.get_weights(),) + expected
  model = build()
  pipe = tfpipe.Pipeline(model, **{"num_stages": 4, **options}, method=method,
                         micro_batches=micro_batches)
  pipe.compile(**_task_compile(name))
  got = _fit_task(pipe, data, {})
  got = (model.get_weights(),) + got
  conformance.assert_same(expected, got, 5e-5)
  if hasattr(model, "generate"):   # the trained weights are the task's own: it generates
    x = data[0]
    prompt = {"token_ids": x["token_ids"][:2], "padding_mask": x["padding_mask"][:2]}
    np.testing.assert_array_equal(
        np.asarray(model.generate(prompt, stop_token_ids=None)["token_ids"]),
        np.asarray(task.generate(prompt, stop_token_ids=None)["token_ids"]))
  path = str(tmp_path / "task.keras")   # and saves and loads as Keras
  model.save(path)
  loaded = keras.saving.load_model(path)
  np.testing.assert_allclose(loaded.predict(data[0], verbose=0), got[3], atol=1e-5)


# Several outputs under the asynchronous methods: each follows its rule (`tfpipe.rules.reference`).

def _two_head_batches(n=6, seed=8):
  rng = np.random.default_rng(seed)
  return [(rng.standard_normal((8, 8)), (rng.integers(0, 3, 8), rng.standard_normal((8, 2))))
          for _ in range(n)]


def _two_head_model():
  keras.utils.set_random_seed(0)
  x = keras.Input((8,), dtype="float64")
  h = keras.layers.Dense(16, activation="tanh", name="d0", dtype="float64")(x)
  aux = keras.layers.Dense(2, name="aux", dtype="float64")(h)   # made on stage 0 of 3
  h = keras.layers.Dense(16, activation="tanh", name="d1", dtype="float64")(h)
  h = keras.layers.Dense(16, activation="tanh", name="d2", dtype="float64")(h)
  return keras.Model(x, [keras.layers.Dense(3, name="main", dtype="float64")(h), aux])


@pytest.mark.parametrize("runtime", helpers.RUNTIMES, ids=helpers.RUNTIME_IDS)
@pytest.mark.parametrize("method,options", helpers.on_one_worker(
    "two-heads", [("pipedream", {}), ("spectrain", {"micro_batches": 1}), ("vanilla", {}),
                  ("timeprest", {"micro_batches": 2})], key=lambda c: c[0]))
def test_asynchronous_methods_follow_their_rules_with_an_auxiliary_head(method, options,
                                                                        runtime):
  lr, momentum = 0.05, 0.9
  bs = _two_head_batches()
  x = np.concatenate([b[0] for b in bs])
  y = [np.concatenate([b[1][i] for b in bs]) for i in range(2)]
  pipe, compile_ = helpers.pipeline(_two_head_model(), runtime, num_stages=3, method=method,
                                    **options)
  sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
  mse = keras.losses.MeanSquaredError(dtype="float64")
  rule_loss = lambda y_true, y_pred: sce(y_true[0], y_pred[0]) + 0.5 * tf.cast(
      mse(y_true[1], y_pred[1]), "float64")
  expected, _ = helpers.reference_train(pipe.stage_models, rule_loss, bs, method, lr, momentum,
                                        **options)
  compile_(tfpipe.optimizers.SpecTrain(lr, momentum), [sce, mse], loss_weights=[1.0, 0.5])
  history = pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  assert {"main_loss", "aux_loss"} <= set(history.history)
  for p, ref in zip(pipe.programs, expected):
    helpers.assert_weights_close([v.numpy() for v in p.trainable], ref, rtol=1e-6, atol=1e-8)


def test_compile_takes_the_tasks_defaults_and_arguments():
  task = llama_causal_lm()
  pipe = tfpipe.Pipeline(task, num_stages=2, method="1f1b")
  pipe.compile(sampler="greedy")   # no loss given: the task's own, as task.compile() gives it
  assert isinstance(pipe.step.user_loss, keras.losses.SparseCategoricalCrossentropy)
  assert type(task.sampler).__name__ == "GreedySampler"
  with pytest.raises(TypeError, match=r"unexpected keyword arguments \['sampler'\]"):
    tfpipe.Pipeline(token_lm(), num_stages=2, method="1f1b").compile(loss="mse",
                                                                      sampler="greedy")
