"""Convolutional workloads for CIFAR-10-sized images: VGG16, ResNet20, ResNet-152, Inception v4;
and the staleness benchmark's small CNN.

Every residual or inception block is a nested Keras model (one layer of the
outer model), so pipelines cut between blocks. `scale` multiplies the
channel counts.
"""

import keras

__all__ = ["vgg16", "resnet20", "resnet152", "inception_v4", "small_cnn"]

_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _c(channels, scale):
  return max(1, int(round(channels * scale)))


def _check_size(name, input_shape, smallest=32):
  if min(input_shape[0], input_shape[1]) < smallest:
    raise ValueError(f"{name} needs images of at least {smallest}x{smallest} pixels. Received "
                     f"input shape {tuple(input_shape)}")


def vgg16(input_shape, num_classes, scale=1.0):
  """VGG16 for 32x32 inputs (CIFAR-10): 13 conv layers, 5 pools, a 512-unit classifier."""
  _check_size("vgg16", input_shape)
  layers, conv, pool = [keras.Input(input_shape)], 0, 0
  for item in _VGG16:
    if item == "M":
      layers.append(keras.layers.MaxPooling2D(name=f"pool{pool}"))
      pool += 1
    else:
      layers.append(keras.layers.Conv2D(_c(item, scale), 3, padding="same", activation="relu",
                                        name=f"conv{conv}"))
      conv += 1
  layers += [keras.layers.Flatten(name="flatten"),
             keras.layers.Dense(_c(512, scale), activation="relu", name="fc"),
             keras.layers.Dense(num_classes, name="logits")]
  return keras.Sequential(layers, name="vgg16")


def _conv_bn(x, channels, kernel, strides=1, relu=True, name=None):
  x = keras.layers.Conv2D(channels, kernel, strides=strides, padding="same", use_bias=False,
                          name=None if name is None else name + "_conv")(x)
  x = keras.layers.BatchNormalization(name=None if name is None else name + "_bn")(x)
  return keras.layers.ReLU()(x) if relu else x


def _block(x, body, name):
  """Applies `body` (a function of one tensor) as a nested model called `name`."""
  inputs = keras.Input(x.shape[1:])
  return keras.Model(inputs, body(inputs), name=name)(x)


def _basic(channels, strides):
  def body(x):
    y = _conv_bn(x, channels, 3, strides)
    y = _conv_bn(y, channels, 3, relu=False)
    shortcut = x
    if strides != 1 or x.shape[-1] != channels:
      shortcut = _conv_bn(x, channels, 1, strides, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
  return body


def _bottleneck(channels, strides):
  def body(x):
    y = _conv_bn(x, channels, 1)
    y = _conv_bn(y, channels, 3, strides)
    y = _conv_bn(y, 4 * channels, 1, relu=False)
    shortcut = x
    if strides != 1 or x.shape[-1] != 4 * channels:
      shortcut = _conv_bn(x, 4 * channels, 1, strides, relu=False)
    return keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
  return body


def _head(x, num_classes):
  x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
  return keras.layers.Dense(num_classes, name="logits")(x)


def resnet20(input_shape, num_classes, scale=1.0):
  """ResNet20 for CIFAR-10 (He et al.; Kang's model-parallelism report): a 3x3 conv, 9 basic blocks
  of 16/32/64
  channels, pool and classifier: the report's 11 layers (stem, blocks, head)."""
  _check_size("resnet20", input_shape)
  inputs = keras.Input(input_shape)
  x = _block(inputs, lambda t: _conv_bn(t, _c(16, scale), 3), "stem")
  for stage, channels in enumerate((16, 32, 64)):
    for i in range(3):
      x = _block(x, _basic(_c(channels, scale), 2 if stage and not i else 1),
                 f"block{stage}_{i}")
  return keras.Model(inputs, _head(x, num_classes), name="resnet20")


def resnet152(input_shape, num_classes, scale=1.0):
  """ResNet-152 for 32x32 inputs: a 3x3 stem, bottleneck stages of 3, 8, 36, 3 blocks
  (64/128/256/512 channels, x4 out), pool and classifier."""
  _check_size("resnet152", input_shape)
  inputs = keras.Input(input_shape)
  x = _block(inputs, lambda t: _conv_bn(t, _c(64, scale), 3), "stem")
  for stage, (blocks, channels) in enumerate(zip((3, 8, 36, 3), (64, 128, 256, 512))):
    for i in range(blocks):
      x = _block(x, _bottleneck(_c(channels, scale), 2 if stage and not i else 1),
                 f"block{stage}_{i}")
  return keras.Model(inputs, _head(x, num_classes), name="resnet152")


def _concat(branches):
  return keras.layers.Concatenate()(branches)


def _avg_branch(x, channels):
  return _conv_bn(keras.layers.AveragePooling2D(3, 1, padding="same")(x), channels, 1)


def _inception_a(s):
  def body(x):
    b3 = _conv_bn(_conv_bn(x, _c(64, s), 1), _c(96, s), 3)
    b5 = _conv_bn(_conv_bn(_conv_bn(x, _c(64, s), 1), _c(96, s), 3), _c(96, s), 3)
    return _concat([_avg_branch(x, _c(96, s)), _conv_bn(x, _c(96, s), 1), b3, b5])
  return body


def _reduction_a(s):
  def body(x):
    pool = keras.layers.MaxPooling2D(3, 2, padding="same")(x)
    b3 = _conv_bn(x, _c(384, s), 3, 2)
    b5 = _conv_bn(_conv_bn(_conv_bn(x, _c(192, s), 1), _c(224, s), 3), _c(256, s), 3, 2)
    return _concat([pool, b3, b5])
  return body


def _inception_b(s):
  def body(x):
    b7 = _conv_bn(_conv_bn(_conv_bn(x, _c(192, s), 1), _c(224, s), (1, 7)), _c(256, s), (7, 1))
    b77 = _conv_bn(x, _c(192, s), 1)
    for channels, kernel in ((192, (1, 7)), (224, (7, 1)), (224, (1, 7)), (256, (7, 1))):
      b77 = _conv_bn(b77, _c(channels, s), kernel)
    return _concat([_avg_branch(x, _c(128, s)), _conv_bn(x, _c(384, s), 1), b7, b77])
  return body


def _reduction_b(s):
  def body(x):
    pool = keras.layers.MaxPooling2D(3, 2, padding="same")(x)
    b3 = _conv_bn(_conv_bn(x, _c(192, s), 1), _c(192, s), 3, 2)
    b7 = _conv_bn(x, _c(256, s), 1)
    for channels, kernel in ((256, (1, 7)), (320, (7, 1))):
      b7 = _conv_bn(b7, _c(channels, s), kernel)
    return _concat([pool, b3, _conv_bn(b7, _c(320, s), 3, 2)])
  return body


def _inception_c(s):
  def body(x):
    b3 = _conv_bn(x, _c(384, s), 1)
    b3 = [_conv_bn(b3, _c(256, s), (1, 3)), _conv_bn(b3, _c(256, s), (3, 1))]
    b5 = _conv_bn(_conv_bn(_conv_bn(x, _c(384, s), 1), _c(448, s), (3, 1)), _c(512, s), (1, 3))
    b5 = [_conv_bn(b5, _c(256, s), (1, 3)), _conv_bn(b5, _c(256, s), (3, 1))]
    return _concat([_avg_branch(x, _c(256, s)), _conv_bn(x, _c(256, s), 1)] + b3 + b5)
  return body


def inception_v4(input_shape, num_classes, scale=1.0):
  """Inception v4 (Szegedy et al.) for 32x32 inputs: a 3-conv stem without its downsampling,
  4 Inception-A, Reduction-A, 7 Inception-B, Reduction-B, 3 Inception-C, pool, classifier."""
  _check_size("inception_v4", input_shape)
  inputs = keras.Input(input_shape)
  x = _block(inputs, lambda t: _conv_bn(_conv_bn(_conv_bn(t, _c(32, scale), 3), _c(32, scale), 3),
                                        _c(64, scale), 3), "stem")
  for i in range(4):
    x = _block(x, _inception_a(scale), f"inception_a{i}")
  x = _block(x, _reduction_a(scale), "reduction_a")
  for i in range(7):
    x = _block(x, _inception_b(scale), f"inception_b{i}")
  x = _block(x, _reduction_b(scale), "reduction_b")
  for i in range(3):
    x = _block(x, _inception_c(scale), f"inception_c{i}")
  return keras.Model(inputs, _head(x, num_classes), name="inception_v4")


def small_cnn(input_shape, num_classes, scale=1.0, blocks=4):
  """The staleness benchmark's image model (`bench/staleness.py`, task `shapes`): `blocks`
  blocks of two 3x3 ReLU convolutions (32 channels x scale), a 2x2 pool after each of the
  first two, global average pooling and the logits. No BatchNormalization, so that
  micro-batches do not change the statistics a method trains with."""
  x = inputs = keras.Input(input_shape)
  for b in range(blocks):
    for i in range(2):
      x = keras.layers.Conv2D(_c(32, scale), 3, padding="same", activation="relu",
                              name=f"conv{b}_{i}")(x)
    if b < 2:
      x = keras.layers.MaxPooling2D(name=f"pool{b}")(x)
  x = keras.layers.GlobalAveragePooling2D(name="global_pool")(x)
  return keras.Model(inputs, keras.layers.Dense(num_classes, name="logits")(x), name="small_cnn")
