"""Token-sequence workloads: SpecTrain's Transformer and Residual LSTM, Kang's report's BERT;
and the staleness benchmark's small attention classifier.

L: sequence length, V: vocabulary size, d: model width. Inputs are integer
token ids of shape (L,). The embedding is the first layer (an embedding
stage); each encoder, decoder or LSTM layer is a nested Keras model, so a
pipeline cuts between them. `scale` multiplies the widths (heads stay as
given; a head is at least one unit wide).
"""

import keras
from keras import ops

__all__ = ["transformer", "bert", "residual_lstm", "counter"]


def _w(units, scale):
  return max(1, int(round(units * scale)))


class PositionEmbedding(keras.layers.Layer):
  """Adds a learned embedding of each position to a (batch, L, d) input."""

  def build(self, input_shape):
    self.positions = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal",
                                     name="positions")

  def call(self, x):
    return x + ops.cast(self.positions, x.dtype)


class TakeStep(keras.layers.Layer):
  """A (batch, L, d) input's step `index` (negative counts from the end): (batch, d). A layer,
  not a `Lambda`, so that the model clones and saves (a Python lambda does not deserialise)."""

  def __init__(self, index, **kwargs):
    super().__init__(**kwargs)
    self.index = index

  def call(self, x):
    return x[:, self.index]

  def compute_output_shape(self, input_shape):
    return (input_shape[0],) + tuple(input_shape[2:])

  def get_config(self):
    return {**super().get_config(), "index": self.index}


def _embed(tokens, vocab_size, width, name):
  x = keras.layers.Embedding(vocab_size, width, name=f"{name}_tokens")(tokens)
  return PositionEmbedding(name=f"{name}_positions")(x)


def _attention(x, heads, width, name, context=None, causal=False):
  key_dim = max(1, width // heads)
  attend = keras.layers.MultiHeadAttention(heads, key_dim, name=name)
  y = attend(x, x if context is None else context, use_causal_mask=causal)
  return keras.layers.LayerNormalization(epsilon=1e-6)(keras.layers.Add()([x, y]))


def _feed_forward(x, hidden, width, activation="relu"):
  y = keras.layers.Dense(hidden, activation=activation)(x)
  y = keras.layers.Dense(width)(y)
  return keras.layers.LayerNormalization(epsilon=1e-6)(keras.layers.Add()([x, y]))


def _encoder(shape, heads, hidden, name, activation="relu"):
  inputs = keras.Input(shape)
  x = _attention(inputs, heads, shape[-1], "attention")
  return keras.Model(inputs, _feed_forward(x, hidden, shape[-1], activation), name=name)


def _decoder(shape, heads, hidden, name):
  inputs, context = keras.Input(shape), keras.Input(shape)
  x = _attention(inputs, heads, shape[-1], "self_attention", causal=True)
  x = _attention(x, heads, shape[-1], "cross_attention", context=context)
  return keras.Model([inputs, context], _feed_forward(x, hidden, shape[-1]), name=name)


def transformer(input_shape, num_classes, scale=1.0, vocab_size=20000, blocks=6, heads=8,
                width=512, hidden=2048):
  """The SpecTrain paper's Transformer for sentiment (Vaswani et al.): `blocks` encoder and `blocks`
  decoder blocks, `heads` heads, model width `width` (the paper's 512 units), feed-forward
  `hidden`. The decoder reads the same tokens (its own embedding) and attends to the
  encoder; its mean over positions feeds the classifier."""
  d, h = _w(width, scale), _w(hidden, scale)
  tokens = keras.Input(input_shape, dtype="int32")
  x = _embed(tokens, vocab_size, d, "encoder")
  for i in range(blocks):
    x = _encoder((input_shape[0], d), heads, h, f"encoder{i}")(x)
  y = _embed(tokens, vocab_size, d, "decoder")
  for i in range(blocks):
    y = _decoder((input_shape[0], d), heads, h, f"decoder{i}")([y, x])
  y = keras.layers.GlobalAveragePooling1D(name="pool")(y)
  return keras.Model(tokens, keras.layers.Dense(num_classes, name="logits")(y),
                     name="transformer")


def bert(input_shape, num_classes, scale=1.0, vocab_size=20000, encoders=3, heads=12,
         width=768):
  """Kang's model-parallelism report's small BERT: an embedding layer, `encoders` encoders of width
  `width`
  with `heads` heads and a 4 x width GELU feed-forward, the first position classified."""
  d = _w(width, scale)
  tokens = keras.Input(input_shape, dtype="int32")
  x = _embed(tokens, vocab_size, d, "embedding")
  x = keras.layers.LayerNormalization(epsilon=1e-12, name="embedding_norm")(x)
  for i in range(encoders):
    x = _encoder((input_shape[0], d), heads, 4 * d, f"encoder{i}", activation="gelu")(x)
  first = TakeStep(0, name="first_token")(x)
  pooled = keras.layers.Dense(d, activation="tanh", name="pooler")(first)
  return keras.Model(tokens, keras.layers.Dense(num_classes, name="logits")(pooled), name="bert")


def _lstm_layer(shape, memory, output, name):
  """An LSTM with `memory` cells projected to `output` units, plus the residual input
  (Kim et al.'s residual LSTM, with the projection as a Dense layer)."""
  inputs = keras.Input(shape)
  y = keras.layers.LSTM(memory, return_sequences=True, name="lstm")(inputs)
  y = keras.layers.Dense(output, name="projection")(y)
  if shape[-1] == output:
    y = keras.layers.Add()([inputs, y])
  return keras.Model(inputs, y, name=name)


def residual_lstm(input_shape, num_classes, scale=1.0, vocab_size=20000, layers=8,
                  embedding=512, output=512, memory=1024):
  """The SpecTrain paper's Residual LSTM: `layers` LSTM layers of `memory` cells with `output` units
  and
  residual connections, over a `embedding`-unit embedding; the last step classifies."""
  e, o, m = _w(embedding, scale), _w(output, scale), _w(memory, scale)
  tokens = keras.Input(input_shape, dtype="int32")
  x = keras.layers.Embedding(vocab_size, e, name="embedding")(tokens)
  for i in range(layers):
    x = _lstm_layer((input_shape[0], x.shape[-1]), m, o, f"lstm{i}")(x)
  last = TakeStep(-1, name="last_step")(x)
  return keras.Model(tokens, keras.layers.Dense(num_classes, name="logits")(last),
                     name="residual_lstm")


def counter(input_shape, num_classes, scale=1.0, vocab_size=16, encoders=4, heads=2, width=64):
  """The staleness benchmark's sequence model (`bench/staleness.py`, task `counting`): token
  and position embeddings, `encoders` encoder blocks (width x scale, `heads` heads, a 2 x
  width ReLU feed-forward), mean over positions, logits."""
  d = _w(width, scale)
  tokens = keras.Input(input_shape, dtype="int32")
  x = _embed(tokens, vocab_size, d, "embedding")
  for i in range(encoders):
    x = _encoder((input_shape[0], d), heads, 2 * d, f"encoder{i}")(x)
  x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
  return keras.Model(tokens, keras.layers.Dense(num_classes, name="logits")(x), name="counter")
