"""A KerasHub task with its preprocessor attached trains from strings, as `task.fit` does.

The tokenizer's assets are made here: a SentencePiece model trained on sentences of the
trainer's grammar (`trainers.text`). The model computes in float64: Adam's step on a row whose
gradient is a few ulps from zero is the learning rate either way, so float32's summation
order alone would part the runs. On every synchronous schedule the pipeline's weights
equal the Keras-trained task's, and `generate` afterwards gives the Keras-trained task's
text (asserted after 1f1b: it reads the task's weights, equal on every schedule).
"""

import io

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests import helpers

keras_hub = pytest.importorskip("keras_hub")
spm = pytest.importorskip("sentencepiece")

SEQUENCE = 16
_KERAS = {}


@pytest.fixture(scope="module")
def proto():
  from trainers import text
  lines = text.grammar(40_000).split(". ")
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_writer=model, vocab_size=96, model_type="unigram",
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>",
      bos_piece="<s>", eos_piece="</s>", minloglevel=2)
  return model.getvalue()


def _texts(n=32):
  from trainers import text
  return [s + "." for s in text.grammar(200 * n, seed=7).split(". ")[:n]]


def _task(proto, seed=0, dtype="float64", preprocessor=None):
  keras.utils.set_random_seed(seed)
  tokenizer = keras_hub.models.LlamaTokenizer(proto=proto)
  backbone = keras_hub.models.LlamaBackbone(
      vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_query_heads=2,
      num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, dtype=dtype)
  preprocessor = (preprocessor or keras_hub.models.LlamaCausalLMPreprocessor)(
      tokenizer, sequence_length=SEQUENCE)
  return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=preprocessor)


def _optimizer():
  return keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=1.0)


def _generated(task):
  task.compile(sampler="greedy")   # the trained weights stay; generate is deterministic
  return task.generate(["The cat", "Two dogs"], max_length=SEQUENCE)


def _keras(proto):
  if "run" not in _KERAS:
    task = _task(proto)
    task.compile(optimizer=_optimizer())
    history = task.fit(tf.data.Dataset.from_tensor_slices(_texts()).batch(8), epochs=2,
                       verbose=0)
    _KERAS["run"] = (task.get_weights(), history.history["loss"], _generated(task))
  return _KERAS["run"]


@pytest.mark.parametrize("method,options", [
    pytest.param(m, o, id=m + "".join(f"-{k}={v}" for k, v in o.items()),
                 marks=pytest.mark.xdist_group("text-in"))
    for m, o in [("sequential", {}), ("gpipe", {}), ("1f1b", {}), ("interleaved", {}),
                 ("zb", {}), ("zbv", {}), ("1f1b", {"data_parallel": 2}),
                 ("1f1b", {"as_list": True})]])
def test_a_task_with_its_preprocessor_trains_from_strings_as_keras_does(proto, method, options):
  options = dict(options)
  as_list = options.pop("as_list", False)
  weights, losses, generated = _keras(proto)
  task = _task(proto)
  stages = 2 if method in ("interleaved", "zbv") else 4 // options.get("data_parallel", 2)
  pipe = tfpipe.Pipeline(task, num_stages=stages, method=method,
                         micro_batches=1 if method == "sequential" else 2, **options)
  pipe.compile(optimizer=_optimizer())
  data = _texts() if as_list else tf.data.Dataset.from_tensor_slices(_texts()).batch(8)
  history = pipe.fit(data, batch_size=8 if as_list else None, epochs=2, shuffle=False, verbose=0)
  np.testing.assert_allclose(history.history["loss"], losses, rtol=1e-5)
  helpers.assert_weights_close(task.get_weights(), weights, rtol=1e-5, atol=1e-5)
  if method == "1f1b" and not options and not as_list:   # it reads the weights, equal above
    assert list(_generated(task)) == list(generated)


def test_evaluate_and_predict_take_strings_too(proto):
  texts = _texts()[:16]
  expected = _task(proto)
  expected.compile(optimizer=_optimizer())
  loss = expected.evaluate(texts, batch_size=8, verbose=0, return_dict=True)["loss"]
  outputs = expected.predict(texts, batch_size=8, verbose=0)
  task = _task(proto)
  pipe = tfpipe.Pipeline(task, num_stages=2, method="1f1b", micro_batches=2)
  pipe.compile(optimizer=_optimizer())
  logs = pipe.evaluate(texts, batch_size=8, verbose=0, return_dict=True)
  assert logs["loss"] == pytest.approx(loss, rel=1e-5)
  got = pipe.predict(texts, batch_size=8, verbose=0)
  np.testing.assert_allclose(got, outputs, rtol=1e-4, atol=1e-5)
  # Validation text is preprocessed too; what is made already (token ids) passes as given.
  history = pipe.fit(texts, batch_size=8, validation_data=(texts[:8],), epochs=1, verbose=0)
  x, y, weights = task.preprocessor(tf.constant(texts[:8]))
  again = pipe.fit(texts, batch_size=8, validation_data=(x, y, weights), epochs=1, verbose=0)
  assert history.history["val_loss"][0] > 0 and again.history["val_loss"][0] > 0
  with pytest.raises(ValueError, match="not one string"):
    pipe.fit("The cat sees the moon.", epochs=1, verbose=0)


BUCKETS = (14, 18, 22, 26)


class BucketedPreprocessor(keras_hub.models.LlamaCausalLMPreprocessor):
  """A KerasHub user's bucketing: each batch packed to the shortest of `BUCKETS` that holds
  its longest text, so batches of short texts are short (`task.fit` maps it over the batches,
  as it maps any attached preprocessor)."""

  def call(self, x, y=None, sample_weight=None, sequence_length=None):
    if sequence_length is not None:
      return super().call(x, y, sample_weight, sequence_length=sequence_length)
    longest = tf.reduce_max(self.tokenizer(x).row_lengths()) + 1   # and the start token
    index = tf.reduce_sum(tf.cast(longest > tf.constant(BUCKETS[:-1], longest.dtype), "int32"))
    pack = lambda n: lambda: keras_hub.models.LlamaCausalLMPreprocessor.call(
        self, x, sequence_length=n)
    return tf.switch_case(index, [pack(n) for n in BUCKETS])


def _users_script(trainer):
  """Texts sorted into like lengths, the attached preprocessor packing each batch to its
  bucket, AdamW with global_clipnorm, two epochs; `trainer`: the task, or a pipeline of it.
  Returns the epochs' losses."""
  trainer.compile(optimizer=_optimizer())
  data = tf.data.Dataset.from_tensor_slices(sorted(_texts(32), key=len)).batch(8)
  history = trainer.fit(data, epochs=2, verbose=0)
  return history.history["loss"]


def test_a_keras_hub_users_bucketed_mixed_precision_script_gives_keras_losses(proto):
  # mixed_float16 (Keras wraps the optimizer in a LossScaleOptimizer) through zb. The weights
  # equal Keras's in float64 on this script (measured within 5e-6; an untied embedding's rows:
  # tests/test_language_models.py); float16 products round differently when a batch is cut
  # into micro-batches, so the losses agree to float16's resolution (measured 3e-5 apart) and
  # the weights, through Adam, to 7e-3.
  build = lambda: _task(proto, dtype="mixed_float16", preprocessor=BucketedPreprocessor)
  task = build()
  lengths = {int(x["token_ids"].shape[1]) for x, _, _ in tf.data.Dataset.from_tensor_slices(
      sorted(_texts(32), key=len)).batch(8).map(task.preprocessor)}
  assert len(lengths) >= 3, lengths   # the batches really come in several lengths
  losses = _users_script(task)
  task = build()
  pipe = tfpipe.Pipeline(task, num_stages=2, method="zb", micro_batches=2)
  got_losses = _users_script(pipe)
  np.testing.assert_allclose(got_losses, losses, rtol=1e-3)
  assert task.backbone.compute_dtype == "float16" and len(got_losses) == 2
