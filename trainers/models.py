"""The trainer's models: `tfpipe.models` built from the flags."""

import keras

from tfpipe import models

__all__ = ["MODELS", "build_model"]

MODELS = tuple(models.MODELS)


def build_model(config, input_shape, num_classes, vocab_size=None):
  """The model `config.model` for inputs of `input_shape`, seeded by `config.seed`.

  snn takes --snn_width / --snn_depth, mlp --mlp_width / --mlp_depth, both and dnn
  --model_scale; the
  others --model_scale; token models the dataset's vocabulary size.
  """
  keras.utils.set_random_seed(config.seed)
  name = config.model
  options = {}
  if name in models.INPUTS and models.INPUTS[name] == "tokens":
    if vocab_size is None:
      raise ValueError(f"model {name!r} reads token ids; use a text dataset (imdb_reviews, "
                       f"synthetic_text). Received: --dataset={config.dataset}")
    options["vocab_size"] = vocab_size
  if name == "snn":
    options.update(width=config.snn_width, depth=config.snn_depth)
  if name == "mlp":
    options.update(width=config.mlp_width, depth=config.mlp_depth)
  return models.build(name, input_shape, num_classes, scale=config.model_scale, **options)
