"""Trains a workload with a tfpipe method: `python -m trainers.main --flagfile=configs/X.cfg`.

Prints one line per epoch (loss, accuracy, samples/s), a summary table at the
end, and writes every epoch's numbers as TensorBoard scalars under --logdir.
Exit codes: 0 done, 2 a usage error (a bad flag, value or combination; the
message names it; a checkpoint directory none of whose checkpoints can be
restored), 3 a TF server of the cluster was lost, hung or did not answer, 4
the loss became non-finite (--stop_on_nan), 130 interrupted (SIGINT: within
two seconds, whatever the run is waiting on).
"""

import contextlib
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from trainers import flags as trainer_flags  # noqa: E402
from trainers import interrupts  # noqa: E402
from trainers.config import TrainConfig  # noqa: E402


def setup_devices(config):
  """GPUs when present; otherwise one logical CPU per stage, before TensorFlow initialises."""
  import tensorflow as tf
  import tfpipe
  if tf.config.list_physical_devices("GPU"):
    return
  replicas = tfpipe.devices.parse_stage_replicas(config.stage_replicas)
  wanted = config.num_stages * config.data_parallel + sum(r - 1 for r in replicas.values())
  if tfpipe.methods.kind(config.method).devices == "grid":
    n_b, n_m = tfpipe.tensor_parallel.parse_grid(config.grid)
    wanted = n_b * n_m
  if config.devices:
    indices = [tf.DeviceSpec.from_string(d).device_index or 0 for d in config.devices
               if (tf.DeviceSpec.from_string(d).device_type or "").upper() == "CPU"]
    wanted = max([wanted] + [i + 1 for i in indices])
  tfpipe.devices.ensure_logical_cpus(wanted, intra_op_threads=config.intra_op_threads)


def _num_stages(config):
  import tfpipe
  devices = tfpipe.methods.kind(config.method).devices
  if devices == "one":
    return 1
  if devices == "grid":
    return None   # the grid's devices: n_b x n_m
  return config.num_stages


def _method_options(config, tools):
  """The keyword arguments `tfpipe.create` takes for `config.method`."""
  import tfpipe
  kind = tfpipe.methods.kind(config.method)
  if kind.devices == "grid":
    return {"grid": config.grid}
  mitigation = dict(spike_compensation=config.spike_compensation,
                    delay_momentum=config.delay_momentum, lr_rescheduling=config.lr_rescheduling,
                    discrepancy_decay=config.discrepancy_decay, nesterov=config.nesterov,
                    delay_compensation=config.delay_compensation)
  chosen = [f"--{k}" for k, v in dict(mitigation, advice=config.advice).items()
            if v not in (None, False, 0.0)]
  if not kind.pipeline and chosen:
    raise ValueError(f"{chosen[0]} mitigates pipeline staleness; --method={config.method} is not "
                     "a pipeline")
  if not kind.pipeline and config.memory_budget:
    raise ValueError(f"--memory_budget chooses a pipeline's cuts; --method={config.method} is "
                     "not a pipeline")
  if not kind.pipeline:
    return {}
  return dict(partition=config.partition, **mitigation, spectrain_backward=config.spectrain_backward,
              version_difference=config.version_difference, micro_batches=config.micro_batches,
              recompute={"auto": None, "true": True, "false": False}[config.recompute],
              memory_budget=config.memory_budget,
              lockstep=config.lockstep, stage_replicas=config.stage_replicas,
              data_parallel=config.data_parallel, virtual_stages=config.virtual_stages,
              cross_device_ops=config.cross_device_ops, advice=config.advice,
              profile_batch_size=config.batch_size,
              executor=None if config.executor == "auto" else config.executor,
              **tools.pipeline_options())


def run(config):
  """Trains `config`'s workload; returns (history dict, trainer, the instruments' report
  lines). Never reads FLAGS."""
  import tfpipe
  from trainers import emulated, instruments

  _check_layout(config)
  tools = instruments.Instruments(config)
  tfpipe.cluster.set_liveness(misses=config.liveness_misses)
  kind = tfpipe.methods.kind(config.method)
  if config.stage_replicas and not kind.pipeline:
    raise ValueError(f"--stage_replicas replicates pipeline stages; --method={config.method} "
                     "has none")
  if config.data_parallel > 1 and not kind.pipeline:
    raise ValueError(f"--data_parallel replicates a pipeline; --method={config.method} is not "
                     "one (for plain data parallelism use --method=dataparallel)")
  if _multi_worker(config):
    # Before any TensorFlow op; each worker has its CPU. Waits for every worker to start.
    tfpipe.multi_worker.make_strategy(timeout=config.cluster_timeout)
    emulated.counting(tools)
  else:
    setup_devices(config)
  with _cluster(config, tools) as placed:
    if kind.parameter_servers:
      return _train(config, tools, spec=placed)
    if placed:
      config = dataclasses.replace(config, devices=placed)
    return _train(config, tools)


def _on_emulated_workers(config):
  """--method=dataparallel --cluster=emulated:R,1,LINK: R worker programs on emulated hosts."""
  import tfpipe
  from trainers import emulated
  return (tfpipe.methods.kind(config.method).across_processes
          and (config.cluster or "").startswith(emulated.PREFIX))


def _multi_worker(config):
  """--method=dataparallel --cluster=tf_config: this process is a MultiWorkerMirroredStrategy
  worker (every worker runs the same command with its own TF_CONFIG task)."""
  import tfpipe
  return tfpipe.methods.kind(config.method).across_processes and config.cluster == "tf_config"


@contextlib.contextmanager
def _cluster(config, tools):
  """--cluster: starts or joins the TF servers; yields the stages' devices (None: local), or
  for asgd the cluster spec (its default cluster is local:2,1)."""
  import tfpipe
  from trainers import emulated
  kind = tfpipe.methods.kind(config.method)
  if (config.cluster or "").startswith(emulated.PREFIX) and (
      kind.pipeline or kind.parameter_servers):
    with emulated.cluster(config, tools) as placed:
      yield placed
    return
  if kind.parameter_servers:
    with _asgd_cluster(config) as spec:
      yield spec
    return
  if not config.cluster:
    yield None
    return
  if _multi_worker(config):
    yield None   # MultiWorkerMirroredStrategy: this process is one of TF_CONFIG's workers
    return
  if not kind.pipeline:
    raise ValueError(f"--cluster places pipeline stages; --method={config.method} has none "
                     "(dataparallel runs across processes with --cluster=tf_config)")
  if config.cluster == "tf_config":
    spec = tfpipe.cluster.from_tf_config()
    devices = tfpipe.cluster.connect(spec, address=config.client_address)
    if config.layout == "auto":   # the layout is chosen over every worker
      yield devices
      return
    if not config.devices and len(devices) < config.num_stages:
      raise ValueError(f"TF_CONFIG's cluster has {len(devices)} workers, fewer than "
                       f"--num_stages={config.num_stages} (one stage per worker)")
    yield config.devices or devices[:config.num_stages]
    return
  kind, _, count = config.cluster.partition(":")
  if kind != "local" or not count.isdigit() or int(count) < 1:
    raise ValueError(f"--cluster is local:W (W worker processes here) or tf_config. "
                     f"Received: {config.cluster!r}")
  if not config.devices and int(count) != config.num_stages and config.layout != "auto":
    raise ValueError(f"--cluster={config.cluster} starts {count} servers, one per stage, but "
                     f"--num_stages={config.num_stages}")
  with tfpipe.cluster.LocalCluster({"worker": int(count)}) as local:
    devices = tfpipe.cluster.connect(local.spec)
    if config.verbose:
      print(f"started {count} TF servers: {', '.join(local.spec['worker'])}", flush=True)
    yield config.devices or devices


@contextlib.contextmanager
def _asgd_cluster(config):
  """The parameter-server cluster of --method=asgd: --cluster=local:W,P (default local:2,1)
  starts W workers and P parameter servers here; tf_config takes TF_CONFIG's."""
  import tfpipe
  if config.cluster == "tf_config":
    yield tfpipe.cluster.from_tf_config()
    return
  kind, _, counts = (config.cluster or "local:2,1").partition(":")
  parts = counts.split(",")
  if kind != "local" or len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--method=asgd takes --cluster=local:W,P (W workers, P parameter servers) "
                     f"or tf_config. Received: {config.cluster!r}")
  with tfpipe.cluster.LocalCluster({"worker": int(parts[0]), "ps": int(parts[1])}) as local:
    if config.verbose:
      print(f"started {parts[0]} workers and {parts[1]} parameter servers: "
            f"{', '.join(local.spec['worker'] + local.spec['ps'])}", flush=True)
    yield local.spec


def _arrays(dataset):
  """A batched (x, y) dataset as numpy arrays: x's structure (a dict of a language model's
  token ids and padding mask) kept."""
  import numpy as np
  import tensorflow as tf
  xs, ys = zip(*[(tf.nest.map_structure(lambda t: t.numpy(), x), y.numpy()) for x, y in dataset])
  return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *xs), np.concatenate(ys)


def _train(config, tools, spec=None):
  import keras
  import tfpipe
  from trainers import datasets, models, report
  keras.utils.set_random_seed(config.seed)
  data = datasets.load(config)
  keras.mixed_precision.set_global_policy(config.precision)   # before the model is built
  model = models.build_model(config, data.input_shape, data.num_classes, data.vocab_size)
  kind = tfpipe.methods.kind(config.method)
  config, data, trainer = _trainer(config, tools, spec, model, data, kind)
  if config.max_restarts and not isinstance(trainer, tfpipe.Pipeline):
    raise ValueError(f"--max_restarts brings back a pipeline's lost stage host; "
                     f"--method={config.method} is not a pipeline")
  if config.max_restarts and not config.checkpoint_dir:
    raise ValueError("--max_restarts resumes from the newest checkpoint: give --checkpoint_dir")
  if config.save_weights and (_multi_worker(config) or getattr(trainer, "model", None) is None):
    raise ValueError(f"--save_weights is not supported with --method={config.method}"
                     + (" on several workers" if _multi_worker(config) else "") + " yet")
  window = {}
  if isinstance(trainer, tfpipe.Pipeline):
    window = dict(steps_per_execution=config.steps_per_execution if
                  config.steps_per_execution == "auto" else int(config.steps_per_execution))
  trainer.compile(
      optimizer=make_optimizer(config),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
      **window)
  if config.verbose:
    # After compile: the options advised for the optimizer (tfpipe.rules.advice) are then known.
    trainer.summary(print_fn=lambda line: print(line, flush=True))
  if kind.parameter_servers:
    train, fit_options = data.train, dict(batch_size=config.batch_size, seed=config.seed)
  else:
    train, fit_options = (data.train.repeat() if config.steps else data.train), {}
  if config.max_restarts:
    fit_options.update(max_restarts=config.max_restarts, restart_timeout=config.cluster_timeout)
    train = _attempts(train, config)
  saver = checkpoint_callback(config)
  guard = report.StopOnNonFinite() if config.stop_on_nan else None
  history = trainer.fit(*(train if isinstance(train, tuple) else (train,)), **fit_options,
                        epochs=config.epochs, steps_per_epoch=config.steps,
                        validation_data=data.validation,
                        callbacks=[report.EpochReport(config)] + tools.callbacks() +
                        ([tools.traffic] if tools.traffic is not None else []) +
                        [report.ResumeReport(config, saver)] + ([guard] if guard else []) +
                        ([saver] if saver else []),
                        verbose=1 if config.verbose == 1 else 0)
  if config.transfer_share and not (guard is not None and guard.stopped):
    tools.trace_one_more_epoch(lambda cbs: trainer.fit(
        *(train if isinstance(train, tuple) else (train,)), **fit_options, epochs=1,
        steps_per_epoch=config.steps, callbacks=cbs, verbose=0),
        barrier=trainer.barrier if _multi_worker(config) else None)
  if guard is not None and guard.stopped:
    epoch, loss = guard.stopped
    kept = getattr(saver, "manager", None)
    kept = f"; the last checkpoint ({kept.latest_checkpoint}) is kept" if kept else ""
    raise Diverged(f"the loss became {loss} in epoch {epoch}: training stopped before saving "
                   f"it{kept}. Lower --learning_rate, or pass --nostop_on_nan to train on")
  lines = tools.finish(trainer)
  if config.save_weights:
    trainer.model.save_weights(config.save_weights)
    lines.append(f"weights saved to {config.save_weights}")
  if getattr(saver, "restored_epoch", None):
    lines.insert(0, f"resumed after epoch {saver.restored_epoch} from {saver.restored_path}")
  if config.max_restarts:
    restarts = getattr(history, "restarts", [])
    lines.append(f"restarts: {len(restarts)} of at most {config.max_restarts}"
                 + "".join(f"\n  {line}" for line in restarts))
  return history.history, trainer, lines


def _trainer(config, tools, spec, model, data, kind):
  """(config, data, the trainer of `config.method` for `model`): ASGD's parameter servers
  (the data read as arrays first), multi-worker data parallelism, or a pipeline (its layout
  chosen first with --layout=auto)."""
  import tfpipe
  from trainers import models
  if kind.parameter_servers:
    if config.checkpoint_dir:
      raise ValueError("--checkpoint_dir is not supported with --method=asgd yet")
    # The data as arrays, read before joining the cluster (which strands local tensors).
    data = data._replace(train=_arrays(data.train), validation=_arrays(data.validation))
    # Built again, not cloned: a KerasHub layer's get_config may fail (Llama's in 0.32).
    trainer = tfpipe.create(model, "asgd", spec=spec, build=lambda: models.build_model(
        config, data.input_shape, data.num_classes, data.vocab_size))
  elif _multi_worker(config):
    if config.checkpoint_dir:
      raise ValueError("--checkpoint_dir is not supported with --cluster=tf_config "
                       "dataparallel (MultiWorkerMirroredStrategy) yet")
    # Built again, not cloned: a KerasHub layer's get_config may fail (Llama's in 0.32).
    trainer = tfpipe.multi_worker.MultiWorkerDataParallel(model, build=lambda: models.build_model(
        config, data.input_shape, data.num_classes, data.vocab_size))
  else:
    if config.layout == "auto":
      config = _chosen_layout(config, model)
    trainer = tfpipe.create(model, config.method, devices=config.devices,
                            num_stages=None if config.devices else _num_stages(config),
                            **_method_options(config, tools))
  return config, data, trainer


def _attempts(first, config):
  """The training data as a function `fit` calls for each attempt: `first`, then a dataset
  built again after a restart, whose reshuffling replays an uninterrupted run's order (the
  same dataset, iterated again in this process, would shuffle on from where it was)."""
  from trainers import datasets
  built = [first]

  def train():
    if built:
      return built.pop()
    fresh = datasets.load(config).train
    return fresh.repeat() if config.steps else fresh
  return train


def _check_layout(config):
  """--layout=auto: refuses, before any host starts, what it would have to override."""
  if config.layout != "auto":
    return
  if config.method not in ("gpipe", "1f1b", "zb"):
    raise ValueError(f"--layout=auto lays out a synchronous schedule (--method=gpipe, 1f1b or "
                     f"zb). Received: --method={config.method}")
  if not config.cluster:
    raise ValueError("--layout=auto chooses among the hosts of a --cluster; none was given")
  given = [f"--{name}={getattr(config, name)}" for name, default in
           (("data_parallel", 1), ("micro_batches", None), ("stage_replicas", ()),
            ("devices", None)) if getattr(config, name) not in (default, [], None)]
  if config.partition != "uniform":
    given.append(f"--partition={config.partition}")
  if given:
    raise ValueError(f"--layout=auto chooses the replicas, stages and micro-batches over "
                     f"uniform cuts; leave {', '.join(given)} unset (or use --layout=fixed)")


def _chosen_layout(config, model):
  """--layout=auto: `config` with the layout `tfpipe.choose_layout` ranks first on its hosts."""
  import tfpipe
  choice = tfpipe.choose_layout(
      model, config.devices, config.batch_size, method=config.method,
      cross_device_ops=config.cross_device_ops or "ring",
      print_fn=(lambda line: print(line, flush=True)) if config.verbose else None)
  layout = choice.layout
  if config.verbose:
    print(f"--layout=auto chose {layout.name}: {choice.rows[0].samples_per_second:.0f} "
          f"samples/s predicted", flush=True)
  return dataclasses.replace(
      config, devices=choice.devices[:layout.hosts], data_parallel=layout.data_parallel,
      num_stages=layout.num_stages, micro_batches=layout.micro_batches,
      cross_device_ops=choice.cross_device_ops if layout.data_parallel > 1 else None)


class Diverged(RuntimeError):
  """Training stopped on a non-finite loss (--stop_on_nan); exit code `DIVERGED`."""


def make_optimizer(config):
  """--optimizer with --learning_rate, --momentum (spectrain, sgd), --weight_decay and
  --global_clipnorm."""
  import keras
  import tfpipe
  decay = {} if config.weight_decay is None else {"weight_decay": config.weight_decay}
  if config.global_clipnorm is not None:
    decay["global_clipnorm"] = config.global_clipnorm
  if config.optimizer == "spectrain":
    return tfpipe.optimizers.SpecTrain(config.learning_rate, config.momentum, **decay)
  if config.optimizer == "sgd":
    return keras.optimizers.SGD(config.learning_rate, momentum=config.momentum, **decay)
  if config.optimizer == "adam":
    return keras.optimizers.Adam(config.learning_rate, **decay)
  if config.optimizer == "adamw":
    return keras.optimizers.AdamW(config.learning_rate, **decay)
  raise ValueError(f"--optimizer must be spectrain, sgd, adam or adamw. Received: "
                   f"{config.optimizer!r}")


def checkpoint_callback(config):
  """--checkpoint_dir: tfpipe's BackupAndRestore for pipelines, Keras's for the baselines."""
  if not config.checkpoint_dir:
    return None
  import keras
  import tfpipe
  if tfpipe.methods.kind(config.method).pipeline:
    return tfpipe.checkpoint.BackupAndRestore(config.checkpoint_dir, config.checkpoint_every)
  if config.checkpoint_every != 1:
    raise ValueError(f"--method={config.method} checkpoints every epoch (Keras's "
                     f"BackupAndRestore). Received: --checkpoint_every={config.checkpoint_every}")
  return keras.callbacks.BackupAndRestore(config.checkpoint_dir, delete_checkpoint=False)


USAGE_ERROR = 2   # every usage error exits with this code
LOST = 3          # a TF server of the cluster was lost (or did not answer)
DIVERGED = 4      # the loss became non-finite (--stop_on_nan)
INTERRUPTED = 130  # SIGINT, as a shell reports it
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort")


def _usage_error(message):
  print(f"error: {message}\nTry --help for the trainer's flags.", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _parse_flags(argv):
  """absl's parsing, with flag errors as usage errors (exit code 2, one message)."""
  try:
    return trainer_flags.FLAGS(argv)
  except flags.Error as e:
    _usage_error(e)


def _help():
  """The trainer's flags (absl's --helpfull adds absl's and TensorFlow's own)."""
  print(__doc__)
  print(trainer_flags.FLAGS.module_help(trainer_flags))
  print("\nabsl's own flags (--flagfile, --logtostderr, ...): --helpfull")


def main(argv):
  """The process's entry after absl parsed the flags: `command` with the SIGINT watcher;
  exits at once after a run that started TF servers."""
  values = trainer_flags.FLAGS
  if values.max_restarts:
    from tfpipe.cluster import agent
    if agent.SUPERVISED not in os.environ:
      # This process is the agent: the training runs in a process of its own, started again
      # if it has to leave to get past a lost task (`tfpipe.cluster.agent`).
      return agent.supervise([sys.executable, "-m", "trainers.main", *sys.argv[1:]],
                             values.max_restarts)
    values.max_restarts = int(os.environ[agent.REMAINING])   # the agent's restarts count too
  interrupts.exit_on_interrupt(INTERRUPTED)
  if not trainer_flags.FLAGS["verbosity"].present:
    # absl logs at INFO under app.run; TensorFlow's INFO lines (one per checkpoint save, per
    # traced cross-device reduction, ...) are not the trainer's to show unless asked.
    absl_logging.set_verbosity(absl_logging.WARNING)
  code = command(argv)
  if code == 0 and (_parameter_servers(values.method)
                    or (values.cluster or "").startswith(("local:", "emulated:"))):
    # The servers this run started are gone; TensorFlow's teardown would try to reach them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
  return code


def _parameter_servers(method):
  """Whether `method` ran on a cluster of parameter servers (False for a name that is none)."""
  import tfpipe
  return method in tfpipe.METHODS and tfpipe.methods.kind(method).parameter_servers


def command(argv):
  """The trainer on the parsed flags (`argv`: what absl left over); returns the exit code, or
  exits with `USAGE_ERROR` on a bad argument. Touches nothing process-wide (no signal
  handler, no exit after a run), so tests call it in their own process."""
  if len(argv) > 1:
    _usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
  config = TrainConfig.from_flags(trainer_flags.FLAGS)
  from trainers import datasets, emulated, models
  try:
    if _on_emulated_workers(config):
      return emulated.run_workers(config, trainer_flags.FLAGS)
    history, trainer, lines = run(config)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED
  except (datasets.DataUnavailableError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return USAGE_ERROR
  except Diverged as e:
    print(f"error: {e}", file=sys.stderr)
    return DIVERGED
  except Exception as e:  # pylint: disable=broad-except
    import tfpipe
    if not isinstance(e, tfpipe.cluster.WorkerLost):
      raise
    print(f"error: {e}", file=sys.stderr)
    return LOST
  from trainers import report
  print(report.format_table(config, history, trainer, models.is_language_model(config.model)))
  for line in lines:
    print(line)
  return 0


def entry():
  trainer_flags.define_flags()
  flags.adopt_module_key_flags(trainer_flags)   # absl's --helpshort lists them too
  if any(a in HELP_FLAGS for a in sys.argv[1:]):
    _help()
    sys.exit(0)
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  entry()
