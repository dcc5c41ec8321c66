"""The trainer's language models: KerasHub backbones built from config, with a per-token head.

At `--model_scale=1` a backbone has 4 transformer layers of width 64 (4 query heads); the
scale multiplies the width (a multiple of 8). The head is a Dense layer over the vocabulary
(untied, as Llama's is), in float32 under a mixed precision policy, as Keras's mixed-precision
guide advises for the logits.
"""

import keras

__all__ = ["LANGUAGE_MODELS", "build"]

LANGUAGE_MODELS = ("llama", "gemma")
LAYERS, WIDTH, HEADS = 4, 64, 4


def _keras_hub():
  try:
    import keras_hub
  except ImportError:
    raise ValueError("the language models are KerasHub's: pip install --no-deps keras-hub "
                     "(the README's set-up installs it)") from None
  return keras_hub


def build(name, vocab_size, scale=1.0):
  """`name` (one of LANGUAGE_MODELS): a backbone of `LAYERS` layers, width WIDTH x `scale`,
  reading token ids and a padding mask, and a head giving each position's logits over
  `vocab_size` tokens."""
  if name not in LANGUAGE_MODELS:
    raise ValueError(f"unknown language model {name!r}; choose from {', '.join(LANGUAGE_MODELS)}")
  width = max(8, int(round(WIDTH * scale / 8)) * 8)
  models = _keras_hub().models
  if name == "llama":
    backbone = models.LlamaBackbone(
        vocabulary_size=vocab_size, num_layers=LAYERS, num_query_heads=HEADS,
        num_key_value_heads=HEADS // 2, hidden_dim=width, intermediate_dim=2 * width)
  else:
    backbone = models.GemmaBackbone(
        vocabulary_size=vocab_size, num_layers=LAYERS, num_query_heads=HEADS,
        num_key_value_heads=1, hidden_dim=width, intermediate_dim=2 * width,
        head_dim=width // HEADS)
  logits = keras.layers.Dense(vocab_size, name="lm_head", dtype="float32")(backbone.output)
  return keras.Model(backbone.inputs, logits, name=f"{name}_lm")
