"""The trainer's models: `tfpipe.models` and KerasHub language models (`hub_models`) built
from the flags."""

import keras

from tfpipe import models
from trainers import hub_models, text

__all__ = ["MODELS", "build_model", "is_language_model"]

MODELS = tuple(models.MODELS) + hub_models.LANGUAGE_MODELS


def is_language_model(name):
  """Whether model `name` predicts each next token (a KerasHub language model)."""
  return name in hub_models.LANGUAGE_MODELS


def build_model(config, input_shape, num_classes, vocab_size=None):
  """The model `config.model` for inputs of `input_shape`, seeded by `config.seed`.

  snn takes --snn_width / --snn_depth, mlp --mlp_width / --mlp_depth, both and dnn
  --model_scale; the
  others --model_scale; token models the dataset's vocabulary size.
  """
  keras.utils.set_random_seed(config.seed)
  name = config.model
  language = config.dataset in text.TEXT_DATASETS
  if is_language_model(name) != language:
    raise ValueError(
        f"--model={name} {'predicts the next token' if is_language_model(name) else 'classifies'}"
        f" and --dataset={config.dataset} "
        f"{'is text to predict' if language else 'is labelled examples'}: pair the language "
        f"models ({', '.join(hub_models.LANGUAGE_MODELS)}) with "
        f"{' or '.join(text.TEXT_DATASETS)}")
  if language:
    return hub_models.build(name, vocab_size, config.model_scale)
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
