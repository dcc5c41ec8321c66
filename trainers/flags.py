"""The one place that defines the trainer's flags."""

from absl import flags

import tfpipe
from trainers import datasets, models

FLAGS = flags.FLAGS


def define_flags():
  """Defines the trainer's flags (once per process)."""
  _where_flags()
  _method_flags()
  _training_flags()
  _run_flags()
  _validators()


def _where_flags():
  """What trains where: the model, data and method, the stages, devices and cluster, the layout."""
  flags.DEFINE_string("model", "snn", f"model: {', '.join(models.MODELS)}")
  flags.DEFINE_string("dataset", "digits", f"dataset: {', '.join(datasets.DATASETS)}")
  flags.DEFINE_string("method", "spectrain", f"method: {', '.join(tfpipe.METHODS)}")
  flags.DEFINE_integer("num_stages", 2, "pipeline stages (replicas for dataparallel)")
  flags.DEFINE_list("devices", None, "device per stage; default: GPUs, else logical CPUs")
  flags.DEFINE_string("cluster", None,
                      "pipeline stages on TF servers: local:W starts W worker processes on "
                      "127.0.0.1 (one stage each); tf_config connects to TF_CONFIG's cluster; "
                      "emulated:R,K,LINK runs R replicas of K stages (dataparallel: R workers; "
                      "asgd: R workers, K parameter servers) on hosts emulated here, joined by "
                      "links LINK (RATE[,DELAY[,LOSS%]], e.g. 100mbit; root only)")
  flags.DEFINE_string("client_address", None,
                      "--cluster=tf_config: the address (host or host:port) at which this "
                      "program joins the cluster, reachable from its servers; default: the "
                      "spec's localhost job, else this machine's address on the route to the "
                      "first server")
  flags.DEFINE_float("cluster_timeout", 120.0,
                     "--method=dataparallel --cluster=tf_config: seconds to wait for every "
                     "worker to start (then the missing ones are named and this one stops)")
  flags.DEFINE_integer("liveness_misses", 2,
                       "--cluster: probes (2 s each, one a second) a TF server may leave "
                       "unanswered in a row before training stops naming it")
  flags.DEFINE_string("grid", "2x2", "grid method: BATCHxMODEL devices (Laugier et al.'s integrated parallelism paper), e.g. 2x2")
  flags.DEFINE_list("stage_replicas", [],
                    "STAGE:R pairs: run stage STAGE data parallel on R devices (hybrid), e.g. 0:2")
  flags.DEFINE_integer("data_parallel", 1,
                       "pipelines: R replicas of the whole pipeline on R x num_stages devices, "
                       "each taking 1/R of every batch (data parallel x pipeline)")
  flags.DEFINE_enum("layout", "fixed", ["fixed", "auto"],
                    "fixed: --num_stages and --data_parallel as given; auto: on the --cluster's "
                    "H hosts, R replicas of a K-stage pipeline (R x K = H: data parallel, "
                    "pipeline or both) chosen by the samples/s the simulator predicts from the "
                    "probed links and a profile of the stages (tfpipe.choose_layout); "
                    "--method=gpipe, 1f1b or zb, --partition=uniform")
  flags.DEFINE_enum("cross_device_ops", None, ["ring", "reduce_to_one_device", "hierarchical_copy", "nccl"],
                    "how a replicated stage (--data_parallel, --stage_replicas) sums its "
                    "replicas' gradients (ring: each replica keeps its own weights, a ring "
                    "all-reduce sums the gradients; else tf.distribute cross-device ops; default: ring "
                    "where a synchronous stage's replicas are on different hosts, else "
                    "MirroredStrategy's choice, NCCL on local GPUs, else reduce_to_one_device)")
  flags.DEFINE_integer("virtual_stages", None,
                       "--method=interleaved: model chunks per device (default 2); the model "
                       "is cut into num_stages x virtual_stages stages")


def _method_flags():
  """The method's options: the cuts, micro-batches, recomputation, the executor, the mitigations."""
  flags.DEFINE_string("partition", "uniform", "stage balancing: uniform, params, profile")
  flags.DEFINE_string("spectrain_backward", "reuse", "spectrain backward weights: reuse, repredict")
  flags.DEFINE_string("version_difference", None,
                      "spectrain version difference: paper, exact (default: paper; exact with "
                      "micro-batches; with --advice, tfpipe.rules.advice's for the optimizer)")
  flags.DEFINE_integer("micro_batches", None,
                       "micro-batches per mini-batch (gpipe, 1f1b, interleaved, zb, timeprest: default 4; "
                       "vanilla, "
                       "pipedream, spectrain: default 1; with --advice, spectrain from 4 stages "
                       "on: K with adam, 2K with momentum SGD)")
  flags.DEFINE_bool("advice", False,
                    "pipelines: options left unset (micro_batches, version_difference, "
                    "spike_compensation, nesterov, delay_compensation) take what "
                    "tfpipe.rules.advice measured best for the optimizer (more accurate, "
                    "slower); default: the method's paper, with the options passed")
  flags.DEFINE_enum("recompute", "auto", ["auto", "true", "false"],
                    "recompute stage forwards before backwards (auto: the method's rule)")
  flags.DEFINE_string("memory_budget", None,
                      "pipelines: each device's memory (bytes, or 3g, 512MiB): at the first "
                      "fit the partition moves to the fastest cuts whose predicted peaks fit, "
                      "or the run is refused naming the stage (Pipeline(memory_budget=))")
  flags.DEFINE_enum("executor", "auto", ["auto", "compiled", "threaded"],
                    "pipelines: compiled (one graph call per window of batches) or threaded "
                    "(a thread per stage: the reference, for debugging); auto: compiled")
  flags.DEFINE_string("steps_per_execution", "auto",
                      "pipelines, compiled executor: mini-batches per graph call (auto: 1 when "
                      "a callback reads every batch, else 16)")
  flags.DEFINE_bool("lockstep", False,
                    "ddg, feature_replay: end every step with a barrier on all stages")
  flags.DEFINE_bool("spike_compensation", None,
                    "asynchronous pipelines: give each delayed gradient the momentum it missed "
                    "at once (Kosson et al. 2021); default off (--advice: "
                    "tfpipe.rules.advice's for the optimizer)")
  flags.DEFINE_bool("delay_momentum", False,
                    "asynchronous pipelines: lower each stage's momentum by its delay D to "
                    "max(0, momentum - D/(D+1)) (Mitliagkas et al. 2016)")
  flags.DEFINE_bool("nesterov", None,
                    "asynchronous pipelines: every stage's update looks ahead along its momentum "
                    "(Nesterov; with --method=pipedream, Ajanthan et al. 2025; momentum SGD or "
                    "Adam, whose look-ahead is NAdam's step); default off (--advice: "
                    "--method=spectrain takes it where a prediction spans one update: "
                    "tfpipe.rules.advice)")
  flags.DEFINE_float("delay_compensation", None,
                     "DC-ASGD's lambda (0: off): move each gradient from the weights its "
                     "forward read to the current ones, g + lambda*g*g*(W - W_read)")
  flags.DEFINE_integer("lr_rescheduling", None,
                       "PipeMare's learning-rate rescheduling over this many updates (0: off; "
                       "default: 500 for --method=pipemare, else off)")
  flags.DEFINE_float("discrepancy_decay", None,
                     "--method=pipemare: decay of the average weight change its backward "
                     "corrects with (default 0.9)")


def _training_flags():
  """The optimizer, precision and training loop; the data and the models' sizes."""
  flags.DEFINE_enum("optimizer", "spectrain", ["spectrain", "sgd", "adam", "adamw"],
                    "spectrain: v = g*v + (1-g)*grad, w -= lr*v; sgd: Keras momentum SGD; adam, "
                    "adamw: Keras's (spectrain's prediction follows each one's own step)")
  flags.DEFINE_float("weight_decay", None, "adamw: decoupled weight decay (default Keras's 0.004)")
  flags.DEFINE_float("global_clipnorm", None,
                     "clip the gradients of the whole model to this global norm, as Keras's "
                     "optimizers do (default: no clipping)")
  flags.DEFINE_enum("precision", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                    "Keras's dtype policy for the model (mixed_float16 scales the loss)")
  flags.DEFINE_integer("batch_size", 64, "global batch size")
  flags.DEFINE_float("learning_rate", 0.01, "learning rate eta")
  flags.DEFINE_float("momentum", 0.9, "momentum / smoothing factor gamma")
  flags.DEFINE_integer("epochs", 1, "epochs")
  flags.DEFINE_integer("steps", None, "batches per epoch (default: the whole training set)")
  flags.DEFINE_integer("seed", 0, "random seed (weights, shuffling, synthetic data)")
  flags.DEFINE_string("logdir", None, "TensorBoard directory (scalars per epoch)")
  flags.DEFINE_string("data_dir", None, "tfds data directory (default: $TFDS_DATA_DIR)")
  flags.DEFINE_integer("snn_width", 2048, "snn: units per layer")
  flags.DEFINE_integer("snn_depth", 32, "snn: hidden layers")
  flags.DEFINE_integer("mlp_width", 256, "mlp: units per layer")
  flags.DEFINE_integer("mlp_depth", 8, "mlp: hidden layers")
  flags.DEFINE_float("model_scale", 1.0,
                     "multiplier on every model's widths (filters, units, embedding sizes)")
  flags.DEFINE_integer("synthetic_samples", 2048, "synthetic: training samples")
  flags.DEFINE_list("synthetic_shape", ["32", "32", "3"], "synthetic: input shape")
  flags.DEFINE_integer("sequence_length", 20,
                       "imdb_reviews, synthetic_text: words (token ids) per example; "
                       "grammar_text, tiny_shakespeare: characters a language model reads")


def _run_flags():
  """What a run records, keeps and survives: traces, checkpoints, restarts; threads and output."""
  flags.DEFINE_string("trace_steps", None,
                      "FIRST,LAST: trace these steps (TensorBoard profile, and for pipelines "
                      "tfpipe_trace.json for Perfetto) into --trace_dir")
  flags.DEFINE_string("trace_dir", None, "where traces go (default: LOGDIR/METHOD/trace)")
  flags.DEFINE_bool("breakdown", False,
                    "pipelines: print and log each stage's compute / transfer / idle shares "
                    "(the compiled executor reads them from the TensorFlow profiler, which "
                    "slows training while it runs)")
  flags.DEFINE_bool("transfer_share", False,
                    "--cluster=emulated:...: after training, one more epoch traced on every host "
                    "(TensorFlow's profiler, through each server); prints each host's share of "
                    "time computing and waiting on transfers")
  flags.DEFINE_string("throughput_window", "50,250",
                      "FIRST,LAST: report samples/s between these steps (empty: off)")
  flags.DEFINE_bool("prediction_error", False,
                    "spectrain: record the RMSE of predicted and stale weights (s = 1, 2, 3)")
  flags.DEFINE_string("checkpoint_dir", None,
                      "save every --checkpoint_every epochs here, and resume from the latest "
                      "checkpoint found here")
  flags.DEFINE_integer("checkpoint_every", 1, "epochs between checkpoints")
  flags.DEFINE_string("save_weights", None,
                      "after training, write the trained model's weights here (Keras's "
                      "`model.save_weights`: a path ending in .weights.h5)")
  flags.DEFINE_integer("max_restarts", 0,
                       "pipelines on TF servers: bring a lost task back (its server started "
                       "again when this trainer started it, else waited for up to "
                       "--cluster_timeout s) up to this many times and resume from the newest "
                       "checkpoint in --checkpoint_dir; the training runs in a process of its "
                       "own, started again when it must leave to get past a lost task")
  flags.DEFINE_bool("stop_on_nan", True,
                    "stop (exit code 4) when an epoch's loss is not finite, before saving it; "
                    "--nostop_on_nan trains on (a non-finite epoch is still never saved)")
  flags.DEFINE_integer("intra_op_threads", 1, "threads per op (1: one core per logical CPU)")
  flags.DEFINE_integer("verbose", 2, "0: silent, 1: progress bar, 2: one line per epoch")


def _validators():
  """Each flag refused in one line where its value cannot work."""
  flags.register_validator("num_stages", lambda v: v >= 1, "--num_stages must be >= 1")
  flags.register_validator("data_parallel", lambda v: v >= 1, "--data_parallel must be >= 1")
  flags.register_validator("virtual_stages", lambda v: v is None or v >= 1,
                           "--virtual_stages must be >= 1")
  flags.register_validator("cluster_timeout", lambda v: v > 0, "--cluster_timeout must be > 0")
  flags.register_validator("liveness_misses", lambda v: v >= 1, "--liveness_misses must be >= 1")
  flags.register_validator("batch_size", lambda v: v >= 1, "--batch_size must be >= 1")
  flags.register_validator("micro_batches", lambda v: v is None or v >= 1,
                           "--micro_batches must be >= 1")
  flags.register_validator("epochs", lambda v: v >= 1, "--epochs must be >= 1")
  flags.register_validator("save_weights", lambda v: v is None or v.endswith(".weights.h5"),
                           "--save_weights must end in .weights.h5 (as Keras's save_weights)")
  flags.register_validator("steps_per_execution", lambda v: v == "auto" or (v.isdigit() and int(v) >= 1),
                           "--steps_per_execution must be 'auto' or a positive integer")
  flags.register_validator("checkpoint_every", lambda v: v >= 1, "--checkpoint_every must be >= 1")
  flags.register_validator("max_restarts", lambda v: v >= 0, "--max_restarts must be >= 0")
  flags.register_validator("steps", lambda v: v is None or v >= 1, "--steps must be >= 1")
  flags.register_validator("learning_rate", lambda v: v >= 0, "--learning_rate must be >= 0")
  flags.register_validator("global_clipnorm", lambda v: v is None or v > 0,
                           "--global_clipnorm must be > 0")
  flags.register_validator("sequence_length", lambda v: v >= 1, "--sequence_length must be >= 1")
  flags.register_validator("momentum", lambda v: 0 <= v < 1, "--momentum must be in [0, 1)")
  flags.register_validator("lr_rescheduling", lambda v: v is None or v >= 0,
                           "--lr_rescheduling must be >= 0")
  flags.register_validator("discrepancy_decay", lambda v: v is None or 0 <= v < 1,
                           "--discrepancy_decay must be in [0, 1)")
  flags.register_multi_flags_validator(
      ["devices", "num_stages", "stage_replicas", "data_parallel"],
      lambda f: f["devices"] is None or len(f["devices"]) == f["num_stages"] * f[
          "data_parallel"] + sum(int(p.split(":")[1]) - 1 for p in f["stage_replicas"]
                                 if p.count(":") == 1 and p.split(":")[1].isdigit()),
      "--devices must list one device per stage (--num_stages), R for a stage replicated R "
      "times (--stage_replicas), R x num_stages for --data_parallel=R")
