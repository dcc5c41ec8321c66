"""The Keras conformance table: each case runs through plain Keras and through a pipeline.

A case names a Keras feature, builds the model, `compile` and `fit`
arguments, and says what a pipeline must do with it: the same as Keras
(equal weights, History, evaluate and predict, to `atol`) or one refusal
line (`refusal`, a regular expression), raised before any work.
`tests/test_conformance.py` runs every case; `python -m tests.conformance_cases`
prints the Keras contract table (docs/keras-contract.md) from this list, and a test keeps it
equal to it.
"""

import dataclasses
import re
from typing import Callable, Optional, Sequence

import keras
import numpy as np

# Pipelines a case runs through: method, micro-batches and other `Pipeline` options (K=2
# stages each).
SEQUENTIAL, GPIPE_1, GPIPE_2 = ("sequential", 1), ("gpipe", 1), ("gpipe", 2)
ONE_F_ONE_B_2, INTERLEAVED_2, ZB_2, ZBV_2 = ("1f1b", 2), ("interleaved", 2), ("zb", 2), ("zbv", 2)
DATA_PARALLEL = ("1f1b", 2, {"data_parallel": 2})
THREADED_SEQUENTIAL = ("sequential", 1, {"executor": "threaded"})
THREADED_ZBV = ("zbv", 2, {"executor": "threaded"})
# Every synchronous schedule, data_parallel=2 and the threaded executor.
EVERY_SYNCHRONOUS = (SEQUENTIAL, GPIPE_2, ONE_F_ONE_B_2, INTERLEAVED_2, ZB_2, ZBV_2, DATA_PARALLEL,
                     THREADED_SEQUENTIAL, THREADED_ZBV)


def data(n=64, inputs=8, classes=3, seed=1):
  rng = np.random.default_rng(seed)
  return rng.standard_normal((n, inputs)).astype("float32"), rng.integers(0, classes, n)


def one_hot(y, classes=3):
  return np.eye(classes, dtype="float32")[y]


def mlp(seed=0, **dense):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", **dense),
                           keras.layers.Dense(16, activation="relu"),
                           keras.layers.Dense(3, name="out")], name="mlp")


def deep_mlp(seed=0):
  """Four layers: enough for the schedules that cut 2 devices into 4 stages (interleaved, zbv)."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((8,))] +
                          [keras.layers.Dense(16, activation="relu") for _ in range(3)] +
                          [keras.layers.Dense(3, name="out")], name="deep_mlp")


def functional_mlp(seed=0):
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu")(x)
  h = keras.layers.Dense(16, activation="relu")(h)
  return keras.Model(x, keras.layers.Dense(3, name="out")(h), name="functional_mlp")


class AddLoss(keras.layers.Layer):
  """Adds 0.01 * mean(x^2) of its input to the model's losses (`add_loss`)."""

  def call(self, x):
    self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
    return x


def regularised(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((8,)),
      keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.05),
                         bias_regularizer="l1"),
      keras.layers.Dense(16, activation="relu", activity_regularizer=keras.regularizers.L2(0.01)),
      AddLoss(),
      keras.layers.Dense(16, activation="relu"),
      keras.layers.Dense(3, kernel_regularizer="l2")], name="regularised")


def with_batch_norm(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                           keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
                           keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def frozen_first(seed=0):
  model = mlp(seed)
  model.layers[0].trainable = False
  return model


def two_outputs(seed=0):
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu")(x)
  return keras.Model(x, [keras.layers.Dense(3, name="a")(h), keras.layers.Dense(1, name="b")(h)])


def auxiliary_head(seed=0, as_dict=False):
  """A main head on the last layers and an auxiliary head on the first: cut in 2 or 4 stages,
  the auxiliary output is made on stage 0 and carried to the last."""
  keras.utils.set_random_seed(seed)
  x = keras.Input((8,))
  h = keras.layers.Dense(16, activation="relu", name="d0")(x)
  aux = keras.layers.Dense(2, name="aux")(h)
  h = keras.layers.Dense(16, activation="relu", name="d1")(h)
  h = keras.layers.Dense(16, activation="relu", name="d2")(h)
  main = keras.layers.Dense(3, name="main")(h)
  return keras.Model(x, {"main": main, "aux": aux} if as_dict else [main, aux],
                     name="auxiliary_head")


def two_labels(as_dict=False):
  x, y = data()
  aux = np.random.default_rng(3).standard_normal((len(y), 2)).astype("float32")
  return x, ({"main": y, "aux": aux} if as_dict else [y, aux])


class OwnTrainStep(keras.Sequential):
  def train_step(self, data):   # noqa: D102 (a user's override)
    return super().train_step(data)


class OwnComputeLoss(keras.Sequential):
  def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    return keras.ops.zeros(())


def subclassed(cls):
  def build(seed=0):
    keras.utils.set_random_seed(seed)
    return cls([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
  return build


def my_metric(y_true, y_pred):
  """A metric function: Keras logs it as 'my_metric'."""
  return keras.ops.mean(keras.ops.abs(y_pred))


def my_loss(y_true, y_pred):
  """A loss function (per sample), with one-hot labels."""
  return keras.ops.mean(keras.ops.square(y_true - keras.ops.softmax(y_pred)), axis=-1)


def sparse_xent():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(**overrides):
  """`compile` arguments: SGD(0.1), sparse cross-entropy on logits and accuracy, with
  `overrides`; a lambda among them is called for a fresh object each run."""
  def make():
    out = {"optimizer": keras.optimizers.SGD(0.1), "loss": sparse_xent(),
           "metrics": ["accuracy"]}
    out.update({k: v() if getattr(v, "__name__", "") == "<lambda>" else v
                for k, v in overrides.items()})
    return out
  return make


def exclude_bias_from_decay():
  optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.5)
  optimizer.exclude_from_weight_decay(var_names=["bias"])
  return optimizer


@dataclasses.dataclass
class Case:
  """One row of the contract. `fit(x, y)` gives fit's arguments beyond x and y;
  `evaluate(x, y)` evaluate's. `data()` -> (x, y)."""
  name: str
  feature: str
  compile: Callable = dataclasses.field(default_factory=compiled)
  model: Callable = mlp
  data: Callable = data
  fit: Callable = lambda x, y: {}
  evaluate: Callable = lambda x, y: {}
  callbacks: Callable = lambda: []
  pipelines: Sequence = (SEQUENTIAL, GPIPE_2)
  refusal: Optional[str] = None
  atol: float = 2e-5
  refused_on: tuple = SEQUENTIAL   # the pipeline a refusal is asked of

  @property
  def outcome(self):
    return "refused" if self.refusal else "same as Keras"


def _sample_weight(x, y):
  return {"sample_weight": np.linspace(0.1, 2.0, len(y)).astype("float32")}


def _nan_weight(x, y, at=3):
  w = np.ones(len(y), "float32")
  w[at] = np.nan
  return {"sample_weight": w}


def _optimizer_case(name, make, pipelines=(GPIPE_2,), atol=2e-5):
  return Case(f"optimizer_{name}", f"`keras.optimizers.{name}`",
              compile=compiled(optimizer=make), pipelines=pipelines, atol=atol)


CASES = [
    # Item 1: metrics are weighted only when listed in weighted_metrics.
    Case("class_weight_metrics", "`class_weight` with `metrics` (unweighted, as Keras)",
         fit=lambda x, y: {"class_weight": {0: 5.0, 1: 0.2, 2: 1.0}},
         pipelines=(SEQUENTIAL, GPIPE_1, GPIPE_2)),
    Case("sample_weight_weighted_metrics", "`sample_weight` with `weighted_metrics`",
         compile=compiled(weighted_metrics=["accuracy"]), fit=_sample_weight,
         evaluate=_sample_weight),
    Case("nan_sample_weight_evaluate", "a NaN sample weight in `evaluate`",
         evaluate=_nan_weight, pipelines=(SEQUENTIAL,)),
    # Item 2: whole-model gradient clipping.
    Case("global_clipnorm", "`global_clipnorm` (one norm over every stage's gradient)",
         compile=compiled(optimizer=lambda: keras.optimizers.SGD(0.5, momentum=0.5,
                                                                 global_clipnorm=0.05)),
         model=deep_mlp, pipelines=EVERY_SYNCHRONOUS),
    Case("global_clipnorm_asynchronous", "`global_clipnorm` with an asynchronous method",
         compile=compiled(optimizer=lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05)),
         refusal=r"global_clipnorm=0\.05 needs every stage's gradient of a mini-batch before "
                 r"any stage updates, which method 'pipedream' \(asynchronous\) never has",
         refused_on=("pipedream", 1)),
    Case("clipnorm", "`clipnorm` (per variable)",
         compile=compiled(optimizer=lambda: keras.optimizers.Adam(0.05, clipnorm=0.05))),
    Case("clipvalue", "`clipvalue`",
         compile=compiled(optimizer=lambda: keras.optimizers.SGD(0.5, clipvalue=0.01))),
    # Item 3: loss scaling. A scale that overflows float16 at first: steps are skipped, then
    # it grows every 2 steps until it overflows again.
    Case("loss_scale_optimizer", "`keras.optimizers.LossScaleOptimizer` (skipped steps, a "
         "growing scale)", model=lambda seed=0: _policy_model("mixed_float16", deep_mlp),
         compile=compiled(optimizer=lambda: keras.optimizers.LossScaleOptimizer(
             keras.optimizers.SGD(0.1, momentum=0.5), initial_scale=2.0 ** 17,
             dynamic_growth_steps=2)),
         pipelines=(SEQUENTIAL, ONE_F_ONE_B_2, ZBV_2, THREADED_ZBV), atol=5e-3),
    Case("loss_scaling_asynchronous", "loss scaling with an asynchronous method",
         model=lambda seed=0: _policy_model("mixed_float16", mlp),
         refusal=r"loss scaling \(a LossScaleOptimizer, or a mixed_float16 model, which Keras "
                 r"trains with one\) needs every stage's gradient",
         refused_on=("spectrain", 1)),
    # Item 4: EMA and its end-of-fit swap.
    Case("use_ema", "`use_ema=True` (weights swapped for their average at the end of `fit`)",
         compile=compiled(optimizer=lambda: keras.optimizers.Adam(0.05, use_ema=True,
                                                                  ema_momentum=0.5))),
    # Item 5: weight-decay exclusions.
    Case("exclude_from_weight_decay", "`AdamW.exclude_from_weight_decay(var_names=...)`",
         compile=compiled(optimizer=lambda: exclude_bias_from_decay())),
    # Item 6: regularisation losses of every stage in the reported losses.
    Case("regularisation_losses", "`kernel_regularizer`, `bias_regularizer`, "
         "`activity_regularizer`, `add_loss` (in `loss`, `val_loss`, `evaluate`)",
         model=regularised, fit=lambda x, y: {"validation_data": (x[:32], y[:32])},
         pipelines=(SEQUENTIAL, GPIPE_1, GPIPE_2)),
    # Item 7: overridden train steps.
    Case("override_train_step", "a `keras.Model` subclass that overrides `train_step`",
         model=subclassed(OwnTrainStep), refusal=r"overrides train_step"),
    Case("override_compute_loss", "a `keras.Model` subclass that overrides `compute_loss`",
         model=subclassed(OwnComputeLoss), refusal=r"overrides compute_loss"),
    # Item 8: "accuracy" is resolved from the labels' and outputs' shapes.
    Case("accuracy_mse_one_hot", '`metrics=["accuracy"]` with `loss="mse"` and one-hot labels',
         compile=compiled(loss="mse"), data=lambda: (data()[0], one_hot(data()[1]))),
    Case("accuracy_custom_loss", '`metrics=["accuracy"]` with a loss function',
         compile=compiled(loss=lambda: my_loss), data=lambda: (data()[0], one_hot(data()[1]))),
    Case("accuracy_named_loss", '`metrics=["accuracy"]` with a renamed loss object',
         compile=compiled(loss=lambda: keras.losses.SparseCategoricalCrossentropy(
             from_logits=True, name="xent"))),
    Case("accuracy_kl_divergence", '`metrics=["accuracy"]` with `KLDivergence`',
         compile=compiled(loss=lambda: keras.losses.KLDivergence()),
         data=lambda: (data()[0], one_hot(data()[1]))),
    # Item 9: metric names.
    Case("metric_function_name", "a metric function (logged under its name)",
         compile=compiled(metrics=[my_metric, "sparse_categorical_accuracy"]),
         callbacks=lambda: [keras.callbacks.EarlyStopping(monitor="my_metric", mode="min",
                                                          patience=0)]),
    # Item 14: crashes become support or one-line refusals.
    Case("gradient_accumulation", "`gradient_accumulation_steps`",
         compile=compiled(optimizer=lambda: keras.optimizers.SGD(
             0.1, momentum=0.5, gradient_accumulation_steps=2))),
    Case("multi_output_losses", "a multi-output model with an auxiliary head on an early "
         "stage (lists of losses, loss weights and metrics)", model=auxiliary_head,
         data=two_labels,
         compile=compiled(loss=lambda: [sparse_xent(), "mse"], loss_weights=[1.0, 0.5],
                          metrics=[["accuracy"], ["mae"]]),
         pipelines=EVERY_SYNCHRONOUS),
    Case("multi_output_dicts", "a multi-output model with dict outputs (losses, loss weights "
         "and metrics by output name)", model=lambda seed=0: auxiliary_head(seed, True),
         data=lambda: two_labels(True),
         compile=compiled(loss=lambda: {"main": sparse_xent(), "aux": "mse"},
                          loss_weights={"main": 1.0, "aux": 0.5},
                          metrics={"main": ["accuracy"], "aux": ["mae"]}),
         pipelines=(ONE_F_ONE_B_2,)),
    Case("metrics_dict", "`metrics` and `loss` as dicts keyed by output name",
         model=functional_mlp,
         compile=compiled(loss=lambda: {"out": sparse_xent()}, metrics={"out": ["accuracy"]})),
    Case("loss_weights", "`loss_weights`", compile=compiled(loss_weights=[0.5])),
    Case("string_labels", "string labels", data=lambda: (data()[0], np.array(["a", "b"] * 32)),
         refusal=r"labels are strings"),
    Case("one_hot_sparse_loss", "one-hot labels with a sparse loss",
         data=lambda: (data()[0], one_hot(data()[1])), refusal=r"look one-hot"),
    Case("string_inputs", "string inputs",
         data=lambda: (np.array([["a"] * 8] * 64), data()[1]), refusal=r"is strings"),
    # Compile and fit arguments.
    Case("run_eagerly", "`run_eagerly=True`", compile=compiled(run_eagerly=True),
         refusal=r"run_eagerly=True is not supported"),
    # With micro-batches each float16 gradient sums half the samples: float16 round-off apart
    # (measured 1.6e-3 on the weights, 4e-3 on the float16 predictions after 8 steps; sequential 0).
    Case("mixed_float16", "a `mixed_float16` model (Keras scales its loss)",
         model=lambda seed=0: _policy_model("mixed_float16", deep_mlp),
         pipelines=(SEQUENTIAL, ONE_F_ONE_B_2, INTERLEAVED_2, DATA_PARALLEL, THREADED_ZBV),
         atol=1e-2),
    Case("mixed_bfloat16", "a `mixed_bfloat16` model",
         model=lambda seed=0: _policy_mlp("mixed_bfloat16"), atol=1e-2),
    Case("steps_per_execution", "`steps_per_execution`",
         compile=compiled(steps_per_execution=3)),
    Case("fit_arguments", "`validation_split`, `validation_freq`, `initial_epoch`, "
         "`batch_size`, `shuffle=False`",
         fit=lambda x, y: {"validation_split": 0.25, "validation_freq": 2, "initial_epoch": 1,
                           "epochs": 4, "batch_size": 12}),
    Case("validation_data_weights", "`validation_data` with sample weights, "
         "`validation_batch_size`",
         fit=lambda x, y: {"validation_data": (x[:20], y[:20], np.linspace(0, 1, 20)),
                           "validation_batch_size": 8}),
    Case("frozen_before_compile", "`layer.trainable = False` before `compile`",
         model=frozen_first),
    # Callbacks Keras ships.
    Case("early_stopping", "`EarlyStopping`",
         fit=lambda x, y: {"epochs": 5},
         callbacks=lambda: [keras.callbacks.EarlyStopping(monitor="accuracy", patience=0,
                                                          restore_best_weights=True)]),
    Case("reduce_lr_on_plateau", "`ReduceLROnPlateau`, `LearningRateScheduler`",
         fit=lambda x, y: {"epochs": 3},
         callbacks=lambda: [keras.callbacks.ReduceLROnPlateau(monitor="loss", min_delta=10,
                                                              factor=0.5, patience=0),
                            keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.9)]),
    # The loss turns NaN at batch 2 through one sample's weight, the predictions stay finite:
    # the batch's accuracy is defined (argmax over NaN logits is not, and depends on shapes).
    Case("terminate_on_nan", "`TerminateOnNaN`",
         fit=lambda x, y: {"epochs": 3, **_nan_weight(x, y, at=40)},
         callbacks=lambda: [keras.callbacks.TerminateOnNaN()]),
    # Optimizers Keras ships.
    _optimizer_case("SGD", lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                    pipelines=(SEQUENTIAL, GPIPE_2)),
    _optimizer_case("RMSprop", lambda: keras.optimizers.RMSprop(0.01, momentum=0.5,
                                                                centered=True)),
    _optimizer_case("Adam", lambda: keras.optimizers.Adam(0.01, amsgrad=True),
                    pipelines=(SEQUENTIAL, GPIPE_2)),
    _optimizer_case("AdamW", lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)),
    _optimizer_case("Adagrad", lambda: keras.optimizers.Adagrad(0.1)),
    _optimizer_case("Adadelta", lambda: keras.optimizers.Adadelta(1.0)),
    _optimizer_case("Adamax", lambda: keras.optimizers.Adamax(0.01)),
    _optimizer_case("Nadam", lambda: keras.optimizers.Nadam(0.01)),
    _optimizer_case("Ftrl", lambda: keras.optimizers.Ftrl(0.1)),
    _optimizer_case("Lion", lambda: keras.optimizers.Lion(0.001)),
    _optimizer_case("Lamb", lambda: keras.optimizers.Lamb(0.01)),
    _optimizer_case("Adafactor", lambda: keras.optimizers.Adafactor(0.05)),
]


def _policy_model(policy, build):
  """build() under the global dtype policy `policy` (as a user sets it)."""
  keras.mixed_precision.set_global_policy(policy)
  try:
    return build()
  finally:
    keras.mixed_precision.set_global_policy("float32")


def _policy_mlp(policy):
  return _policy_model(policy, mlp)


# Cases with a procedure of their own (tests/test_conformance.py), for the table.
SPECIAL = [
    ("`keras.callbacks.BackupAndRestore` (epoch saves)", "same as Keras: an interrupted `fit` "
     "resumes after the last saved epoch (tfpipe's `BackupAndRestore` runs in its place)"),
    ("`keras.callbacks.BackupAndRestore(save_freq=N)` (batch saves)", "refused"),
    ("`LambdaCallback` batch hooks", "same as Keras (the running batch logs)"),
    ("XLA stages (`Pipeline(jit_compile=True)`) with regularisers", "same as Keras (epoch "
     "and batch logs, within 1e-4)"),
    ("`layer.trainable = False` after `compile`", "`predict` and `evaluate` same as Keras; "
     "`fit` refused until `compile` is called again, then same as Keras"),
    ("gpipe with M > 1 and `BatchNormalization`", "statistics per micro-batch, as GPipe "
     "computes them: a warning by default; `batch_statistics=\"refuse\"` refuses"),
    ("an `Embedding` with Adam, AdamW, Adagrad, RMSprop, Adamax, Nadam, Lion, Adafactor, Ftrl "
     "at any M", "same as Keras: the micro-batches' gradient rows are kept and handed to the "
     "optimizer together, as Keras hands it the batch's (a token read twice counts twice in "
     "Adam's second moment); summed dense they differed by 5e-2. Across hosts without "
     "`global_clipnorm` such a stage takes the reduction to one replica, not the ring"),
    ("a weight the loss does not read (a backbone's unused reverse embedding)", "same as "
     "Keras: no step, no weight decay, its slots untouched"),
    ("KerasHub `LlamaBackbone`, `BertBackbone` (from config) with a classifier head",
     "same as Keras"),
    ("a per-token language model (KerasHub Llama, outputs (batch, sequence, vocabulary); "
     "`tests/test_language_models.py`)", "same as Keras with AdamW on every synchronous "
     "schedule, `data_parallel=2` and both executors, with `global_clipnorm` too; the "
     "asynchronous methods follow their rules"),
    ("batches of different sequence lengths (bucketed text)", "same as Keras"),
    ("a `keras.utils.PyDataset` (`x`, `validation_data`, `evaluate`, `predict`; "
     "`tests/test_data.py`)", "same as Keras (its epoch hooks run per pass)"),
    ("a Python generator", "same as Keras with `steps_per_epoch`, and without it for one "
     "epoch (more: stops after one, with Keras's warning)"),
    ("KerasHub task models as built (`LlamaCausalLM`, `GemmaCausalLM`, `MistralCausalLM`, "
     "`BertTextClassifier`, `ResNetImageClassifier`; `tests/test_language_models.py`)",
     "same as Keras at K=4 (cut through the backbone; `compile` takes the task's defaults); "
     "`generate`, `save` and `load_model` after a pipelined `fit`"),
    ("a weight several stages read (a causal LM head's tied token embedding; BART's shared "
     "embedding)", "same as Keras on the synchronous schedules (one summed gradient, every "
     "copy updated alike); refused on the asynchronous methods"),
    ("a layer called on several stages that reads its own weight on each (an untied embedding "
     "and its reverse kernel)", "same as Keras: each stage steps what it reads (the embedding "
     "as rows); every method takes it"),
]


def _describe(pipeline):
  """A pipeline of a case in words: "1f1b M=2 data_parallel=2"."""
  method, m = pipeline[:2]
  options = pipeline[2] if len(pipeline) > 2 else {}
  words = [method] + ([f"M={m}"] if m > 1 else [])
  words += ["threaded" if v == "threaded" else f"{k}={v}" for k, v in options.items()]
  return " ".join(words)


def table():
  """The Keras contract table (docs/keras-contract.md, markdown), from the cases."""
  rows = ["| Keras feature | in a pipeline (sequential, gpipe and as listed; "
          "`tests/test_conformance.py`) |",
          "|---|---|"]
  for case in CASES:
    outcome = case.outcome
    if tuple(case.pipelines) == EVERY_SYNCHRONOUS and not case.refusal:
      outcome += " (every synchronous schedule, `data_parallel=2`, both executors)"
    elif tuple(case.pipelines) != (SEQUENTIAL, GPIPE_2) and not case.refusal:
      outcome += f" ({', '.join(_describe(p) for p in case.pipelines)})"
    if case.refusal:
      outcome = "refused: " + re.sub(r"\\(.)", r"\1", case.refusal.replace(".*", "...")) + " ..."
    rows.append(f"| {case.feature} | {outcome} |")
  rows += [f"| {feature} | {outcome} |" for feature, outcome in SPECIAL]
  return "\n".join(rows)


if __name__ == "__main__":
  print(table())
