"""Fully connected workloads: the SpecTrain paper's SNN and the layer-wise partitioning paper's DNN."""

import keras

__all__ = ["snn", "dnn"]


def _width(units, scale):
  return max(1, int(round(units * scale)))


def snn(input_shape, num_classes, scale=1.0, width=2048, depth=32):
  """Self-normalising MLP (the SpecTrain paper): `depth` SELU Dense layers of `width` x `scale` units."""
  layers = [keras.Input(input_shape), keras.layers.Flatten(name="flatten")]
  for i in range(depth):
    layers.append(keras.layers.Dense(_width(width, scale), activation="selu",
                                     kernel_initializer="lecun_normal", name=f"selu{i}"))
  layers.append(keras.layers.Dense(num_classes, name="logits"))
  return keras.Sequential(layers, name=f"snn_{depth}x{_width(width, scale)}")


def dnn(input_shape, num_classes, scale=1.0, width=2048, depth=7):
  """Wang et al.'s speech DNN: `depth` sigmoid layers of `width` x `scale` units, softmax output
  (the logits here; the trainer's loss applies the softmax)."""
  layers = [keras.Input(input_shape), keras.layers.Flatten(name="flatten")]
  for i in range(depth):
    layers.append(keras.layers.Dense(_width(width, scale), activation="sigmoid",
                                     name=f"sigmoid{i}"))
  layers.append(keras.layers.Dense(num_classes, name="logits"))
  return keras.Sequential(layers, name=f"dnn_{depth}x{_width(width, scale)}")


def mlp(input_shape, num_classes, scale=1.0, width=256, depth=8):
  """A plain deep MLP: `depth` ReLU Dense layers of `width` x `scale` units (the staleness
  benchmark's model, `bench/staleness.py`)."""
  layers = [keras.Input(input_shape), keras.layers.Flatten(name="flatten")]
  for i in range(depth):
    layers.append(keras.layers.Dense(_width(width, scale), activation="relu", name=f"relu{i}"))
  layers.append(keras.layers.Dense(num_classes, name="logits"))
  return keras.Sequential(layers, name=f"mlp_{depth}x{_width(width, scale)}")
