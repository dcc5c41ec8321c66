"""The papers' workloads as Keras models, each with a width `scale` so a small one runs in tests.

Images (CIFAR-10 shaped): vgg16, resnet20, resnet152, inception_v4 (the SpecTrain paper,
Kang's model-parallelism report). Flat inputs: snn (the SpecTrain paper: 32 x 2048 SELU), dnn (Wang
et al.'s layer-wise partitioning paper: 7 x
2048 sigmoid), mlp (8 x 256 ReLU, the staleness benchmark's). Token sequences: transformer (the
SpecTrain paper: 6 + 6 blocks, 8 heads,
512 units), bert (Kang's model-parallelism report: 3 encoders, 768 hidden, 12 heads),
residual_lstm (the SpecTrain paper: 8 LSTM layers; 512 embedding, 512 output, 1024
memory units). The staleness benchmark's: mlp, small_cnn (images), counter
(tokens). Repeated blocks (residual, inception, encoder, decoder, LSTM
layers) are nested Keras models, so a pipeline cuts between blocks, as the
Kang's model-parallelism report partitions ResNet20 into 11 layers and BERT into encoders.
"""

from tfpipe.models import cnn, mlp, sequence
from tfpipe.plan import names

__all__ = ["MODELS", "INPUTS", "build"]

MODELS = {
    "snn": mlp.snn, "dnn": mlp.dnn, "mlp": mlp.mlp,
    "vgg16": cnn.vgg16, "resnet20": cnn.resnet20, "resnet152": cnn.resnet152,
    "inception_v4": cnn.inception_v4,
    "transformer": sequence.transformer, "bert": sequence.bert,
    "residual_lstm": sequence.residual_lstm,
    "small_cnn": cnn.small_cnn, "counter": sequence.counter,
}
# What each model reads: "image" (H, W, C), "flat" (anything, flattened), "tokens" (ids).
INPUTS = {"snn": "flat", "dnn": "flat", "mlp": "flat", "vgg16": "image", "resnet20": "image",
          "resnet152": "image", "inception_v4": "image", "transformer": "tokens",
          "bert": "tokens", "residual_lstm": "tokens", "small_cnn": "image", "counter": "tokens"}


def build(name, input_shape, num_classes, scale=1.0, **options):
  """Model `name` for `input_shape` and `num_classes` logits; `scale` multiplies its widths.

  Token models take `vocab_size`; snn, dnn and mlp take `width` and `depth` too.
  """
  name = names.lookup("model", name, tuple(MODELS))
  if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
    raise ValueError(f"`scale` must be a positive number. Received: scale={scale!r}")
  kind = INPUTS[name]
  if kind == "image" and len(input_shape) != 3:
    raise ValueError(f"{name} reads images (height, width, channels). Received input shape "
                     f"{tuple(input_shape)}")
  if kind == "tokens" and (len(input_shape) != 1 or "vocab_size" not in options):
    raise ValueError(f"{name} reads token ids: an input shape (sequence_length,) and a "
                     f"vocab_size. Received input shape {tuple(input_shape)}, options "
                     f"{sorted(options)}")
  return MODELS[name](tuple(input_shape), num_classes, scale=scale, **options)
