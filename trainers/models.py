"""Workload models: seed 000's SNN and VGG16 for CIFAR-10."""

import keras

from tfpipe import names

__all__ = ["MODELS", "build_model"]


def snn(input_shape, num_classes, width=2048, depth=32):
  """Self-normalising MLP (seed 000's SNN): `depth` SELU Dense layers of `width`."""
  layers = [keras.Input(input_shape), keras.layers.Flatten(name="flatten")]
  for i in range(depth):
    layers.append(keras.layers.Dense(width, activation="selu", kernel_initializer="lecun_normal",
                                     name=f"selu{i}"))
  layers.append(keras.layers.Dense(num_classes, name="logits"))
  return keras.Sequential(layers, name=f"snn_{depth}x{width}")


_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(input_shape, num_classes, scale=1.0):
  """VGG16 for 32x32 inputs (CIFAR-10): 13 conv layers, 5 pools, a 512-unit classifier."""
  if len(input_shape) != 3 or min(input_shape[0], input_shape[1]) < 32:
    raise ValueError(f"vgg16 needs images of at least 32x32 pixels. Received input shape "
                     f"{tuple(input_shape)}")
  layers, conv, pool = [keras.Input(input_shape)], 0, 0
  for item in _VGG16:
    if item == "M":
      layers.append(keras.layers.MaxPooling2D(name=f"pool{pool}"))
      pool += 1
    else:
      layers.append(keras.layers.Conv2D(max(1, int(item * scale)), 3, padding="same",
                                        activation="relu", name=f"conv{conv}"))
      conv += 1
  layers += [keras.layers.Flatten(name="flatten"),
             keras.layers.Dense(max(1, int(512 * scale)), activation="relu", name="fc"),
             keras.layers.Dense(num_classes, name="logits")]
  return keras.Sequential(layers, name="vgg16")


MODELS = ("snn", "vgg16")


def build_model(config, input_shape, num_classes):
  """The model `config.model` for inputs of `input_shape`, seeded by `config.seed`."""
  name = names.lookup("model", config.model, MODELS)
  keras.utils.set_random_seed(config.seed)
  if name == "snn":
    return snn(input_shape, num_classes, config.snn_width, config.snn_depth)
  return vgg16(input_shape, num_classes, config.model_scale)
