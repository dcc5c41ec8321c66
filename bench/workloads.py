"""The start-up and steady-state benchmarks' models and data: a KerasHub Llama from config, a
ResNet-20 and an MLP, with random data of a fixed seed (offline)."""

__all__ = ["SIZES", "model", "data"]

SIZES = {"llama": (16, 64), "resnet": (32, 32), "mlp": (512, 8)}   # batch, batches per epoch


def model(name, layers):
  import keras
  keras.utils.set_random_seed(0)
  if name == "llama":
    import keras_hub
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=1024, num_layers=layers, num_query_heads=2, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128, max_sequence_length=32)
    pooled = keras.layers.GlobalAveragePooling1D()(backbone.output)
    return keras.Model(backbone.inputs, keras.layers.Dense(10, name="head")(pooled))
  if name == "mlp":
    return keras.Sequential([keras.Input((64,))] + [keras.layers.Dense(256, activation="relu")
                                                    for _ in range(8)] + [keras.layers.Dense(10)])
  from tfpipe.models import cnn
  return cnn.resnet20((32, 32, 3), 10, scale=0.5)


def data(name):
  import numpy as np
  rng = np.random.default_rng(0)
  batch, batches = SIZES[name]
  n = batch * batches
  if name == "mlp":
    x = rng.standard_normal((n, 64)).astype("float32")
  elif name == "llama":
    x = {"token_ids": rng.integers(1, 1024, (n, 32)).astype("int32"),
         "padding_mask": np.ones((n, 32), "int32")}
  else:
    x = rng.standard_normal((n, 32, 32, 3)).astype("float32")
  return x, rng.integers(0, 10, n), batch
