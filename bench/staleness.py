"""Accuracy under staleness: every asynchronous method and mitigation against synchronous
training, on five offline tasks of different kinds, at K = 2, 4, 8 stages, two learning rates
per task, over several seeds; and advice chosen on some tasks, tested on the others.

Tasks (trainers/datasets.py), each with its model: `classes` (20 classes of Gaussian
clusters) and `teacher` (labels of a fixed random deep network) with the 8 x 256 ReLU `mlp`;
`regions` (Voronoi regions of random centres) with a deeper 12 x 256 mlp; `shapes` (16 x 16
images of shifted noisy templates) with `small_cnn`; `counting` (which key token occurs
most often in a sequence) with the attention model `counter`. Every option of a setting
(task, learning rate) trains with the same rate, batch size and epochs; its score is the best
validation accuracy of its run (as in the SpecTrain paper's table 1), averaged over the seeds,
with the spread (sample standard deviation) beside it, and the gap to the synchronous
reference of the same optimizer and rate (`single` and `dataparallel`, both plain Keras at the
global batch). samples/s: training samples per second over epochs 2.. (validation included),
the best over the seeds, measured in the same process one run after another, so compare
within a K only.

Advice (`bench/staleness_advice.py`): per optimizer family, options ranked by their worst gap
over the settings of the `--choose_on` tasks; the chosen option's worst gap on the
`--held_out` tasks says whether it transfers.

Each finished run is appended to bench/results/staleness_runs.jsonl, and a run already
there is not repeated: the benchmark can be stopped and resumed. Writes
bench/results/staleness.md and staleness_<task>.png (validation accuracy per epoch at K=4,
mean over the seeds, at the task's first learning rate) from every run on file: the default
rows and the asked ones, at every K and task run, so a run of a few options adds to the
report rather than replacing it (`report_scope`).

  python bench/staleness.py [--tasks=classes,teacher,shapes,regions,counting --stages=2,4,8
                             --seeds=0,1,2 --epochs=15 --options=default]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import common  # noqa: E402

from bench import results_io, staleness_advice  # noqa: E402

# Option values that stand for the run's depth K, 2K and 4K.
STAGES, TWICE_STAGES, FOUR_STAGES = "K", "2K", "4K"
_PER_STAGE = {STAGES: 1, TWICE_STAGES: 2, FOUR_STAGES: 4}

# name: (method, Pipeline options, optimizer). The baselines run once per seed, single on one
# device and dataparallel on BASELINE_REPLICAS (their accuracy does not depend on K); every
# other option at every K. PipeMare's rescheduling warms up over 60 updates (about an epoch).
OPTIONS = {
    "single": ("single", {}, "spectrain"),
    "dataparallel": ("dataparallel", {}, "spectrain"),
    "vanilla": ("vanilla", {}, "spectrain"),
    "pipedream": ("pipedream", {}, "spectrain"),
    "spectrain": ("spectrain", {}, "spectrain"),
    "pipemare": ("pipemare", {"lr_rescheduling": 60}, "spectrain"),
    "timeprest": ("timeprest", {}, "spectrain"),
    "i_timeprest": ("i_timeprest", {}, "spectrain"),
    "vanilla+sc": ("vanilla", {"spike_compensation": True}, "spectrain"),
    "pipedream+sc": ("pipedream", {"spike_compensation": True}, "spectrain"),
    "spectrain+sc": ("spectrain", {"spike_compensation": True}, "spectrain"),
    "spectrain+sc/exact": ("spectrain", {"spike_compensation": True,
                                         "version_difference": "exact"}, "spectrain"),
    "pipedream+dm": ("pipedream", {"delay_momentum": True}, "spectrain"),
    "spectrain+dm": ("spectrain", {"delay_momentum": True}, "spectrain"),
    "pipedream+resched": ("pipedream", {"lr_rescheduling": 60}, "spectrain"),
    "spectrain+sc+resched": ("spectrain", {"spike_compensation": True, "lr_rescheduling": 60},
                             "spectrain"),
    "dataparallel/adam": ("dataparallel", {}, "adam"),
    "pipedream/adam": ("pipedream", {}, "adam"),
    "spectrain/adam": ("spectrain", {}, "adam"),   # PipeOptim / XPipe: Adam's own step
    "spectrain/exact/adam": ("spectrain", {"version_difference": "exact"}, "adam"),
    "single/adam": ("single", {}, "adam"),
    "2bw": ("2bw", {}, "spectrain"),
    "2bw+nesterov": ("2bw", {"nesterov": True}, "spectrain"),
    "pipedream+nesterov": ("pipedream", {"nesterov": True}, "spectrain"),
    "spectrain+nesterov": ("spectrain", {"nesterov": True}, "spectrain"),
    "pipedream+dc": ("pipedream", {"delay_compensation": 1.0}, "spectrain"),
    "spectrain+dc": ("spectrain", {"delay_compensation": 1.0}, "spectrain"),
    "2bw/adam": ("2bw", {}, "adam"),
    "pipedream+dc/adam": ("pipedream", {"delay_compensation": 1.0}, "adam"),
    # SpecTrain over K micro-batches per mini-batch (STAGES: K at each depth): with M >= K - 1,
    # as in 2BW, a prediction spans at most one update (the schedule's exact count).
    "spectrain+mb/adam": ("spectrain", {"micro_batches": STAGES, "version_difference": "exact"},
                          "adam"),
    "spectrain+mb": ("spectrain", {"micro_batches": STAGES, "version_difference": "exact"},
                     "spectrain"),
    "spectrain+mb+nesterov": ("spectrain", {"micro_batches": STAGES, "nesterov": True,
                                            "version_difference": "exact"}, "spectrain"),
    # Local accumulation as the bound on version drift (PACI, arXiv 2606.07881, as its
    # abstract states it: neither stashed nor predicted weights, one update per mini-batch of
    # M = K micro-batches, so a micro-batch's forward and backward cross at most one update).
    # Nesterov's look-ahead with Adam (`tfpipe.rules.mitigations`; 2505.01099's code runs NAdam).
    "spectrain+mb+nesterov/adam": ("spectrain", {"micro_batches": STAGES, "nesterov": True,
                                                 "version_difference": "exact"}, "adam"),
    "spectrain+nesterov/adam": ("spectrain", {"nesterov": True}, "adam"),
    # 2K micro-batches: a stage k's forwards read the one-update-old weights on (K-1-k)/M of
    # the micro-batches (`versions.exact_version_differences`), half of what M=K leaves.
    "spectrain+mb2+nesterov": ("spectrain", {"micro_batches": TWICE_STAGES, "nesterov": True,
                                             "version_difference": "exact"}, "spectrain"),
    # 4K: a quarter of M=K's stale share (what bounds K=8 with 2K, README).
    "spectrain+mb4+nesterov": ("spectrain", {"micro_batches": FOUR_STAGES, "nesterov": True,
                                             "version_difference": "exact"}, "spectrain"),
    "vanilla+mb": ("vanilla", {"micro_batches": STAGES}, "spectrain"),
    "vanilla+mb/adam": ("vanilla", {"micro_batches": STAGES}, "adam"),
}
BASELINES = ("single", "dataparallel", "dataparallel/adam", "single/adam")
# task: (model, its trainer options, SpecTrain-form SGD learning rates, Adam learning rates).
# The first rate of each is the tables' and plots'.
TASKS = {
    "classes": ("mlp", {}, (0.1, 0.05), (0.001, 0.0005)),
    "teacher": ("mlp", {}, (0.1, 0.05), (0.001, 0.0005)),
    "regions": ("mlp", {"mlp_depth": 12}, (0.1, 0.05), (0.001, 0.0005)),
    "shapes": ("small_cnn", {}, (0.1, 0.15), (0.001, 0.0005)),
    "counting": ("counter", {"model_scale": 0.5}, (0.1, 0.05), (0.001, 0.0005)),
}
BASELINE_REPLICAS = 2   # MirroredStrategy on 8 logical CPUs of 2 cores ran at 135 samples/s
DEFAULT = [n for n in OPTIONS if n not in ("vanilla+sc", "pipedream+resched",
                                           "spectrain+nesterov", "spectrain+dc",
                                           "spectrain+mb4+nesterov")]
# The rows the advice is drawn from on every task (both baselines' rules are Keras's; single,
# six times faster here than MirroredStrategy on 2 logical CPUs, is the reference run).
ADVICE = ["single", "single/adam", "spectrain", "spectrain+sc/exact", "spectrain+sc+resched",
          "timeprest", "2bw", "2bw+nesterov", "pipedream+nesterov", "pipedream+dc",
          "spectrain/adam", "2bw/adam", "pipedream+dc/adam", "spectrain+mb/adam", "spectrain+mb",
          "spectrain+mb+nesterov", "spectrain+mb2+nesterov", "spectrain+nesterov",
          "spectrain+mb+nesterov/adam",
          "spectrain+nesterov/adam", "vanilla+mb", "vanilla+mb/adam"]

flags.DEFINE_list("tasks", list(TASKS), "tasks (trainers/datasets.py)")
flags.DEFINE_list("choose_on", ["classes", "teacher", "shapes"],
                  "tasks the advice is chosen on (the others are held out)")
flags.DEFINE_list("learning_rate_index", ["0", "1"],
                  "which of each task's two learning rates to run (0: the tables' rate)")
flags.DEFINE_list("stages", ["2", "4", "8"], "pipeline depths K")
flags.DEFINE_list("seeds", ["0", "1", "2"], "training seeds (initial weights, data order)")
flags.DEFINE_list("options", ["default"],
                  f"rows: default (all but {', '.join(n for n in OPTIONS if n not in DEFAULT)}"
                  f"), advice (the rows the advice ranks), all, or some of "
                  f"{', '.join(OPTIONS)}")
flags.DEFINE_integer("epochs", 15, "epochs per run")
common.define(batch_size=128, results_dir=results_io.RESULTS)
flags.DEFINE_float("momentum", 0.9, "momentum gamma")
flags.DEFINE_bool("report_only", False, "write the table and plots from the runs on file")
FLAGS = flags.FLAGS


class _EpochTimer:
  """A Keras callback's epoch hooks: the wall time of each epoch."""

  def __init__(self):
    import keras

    class Timer(keras.callbacks.Callback):
      def on_epoch_begin(cb, epoch, logs=None):  # noqa: N805
        cb.start = time.perf_counter()

      def on_epoch_end(cb, epoch, logs=None):  # noqa: N805
        self.seconds.append(time.perf_counter() - cb.start)

    self.seconds, self.callback = [], Timer()


def _learning_rate(task, name, index=0):
  """The `index`-th learning rate of `task` for option `name`'s optimizer."""
  _, _, sgd, adam = TASKS[task]
  return (adam if OPTIONS[name][2] == "adam" else sgd)[index]


def run_one(task, name, K, seed, lr):
  """Trains option `name` at K stages on `task` with `seed` and rate `lr`: a result dict."""
  import keras
  import tfpipe
  from tfpipe.rules import advice
  from trainers import config as config_lib, datasets, main as trainer_main, models
  method, options, optimizer = OPTIONS[name]
  options = {k: _PER_STAGE[v] * K if v in _PER_STAGE else v for k, v in options.items()}
  model_name, model_options, _, _ = TASKS[task]
  config = config_lib.TrainConfig(model=model_name, dataset=task, method=method, num_stages=K,
                                  batch_size=FLAGS.batch_size, learning_rate=lr,
                                  momentum=FLAGS.momentum, epochs=FLAGS.epochs, seed=seed,
                                  optimizer=optimizer, **model_options)
  keras.backend.clear_session()
  keras.utils.set_random_seed(seed)
  data = datasets.load(config)
  model = models.build_model(config, data.input_shape, data.num_classes, data.vocab_size)
  if method == "spectrain":   # a row means what it names, not today's advised default
    options = {**advice.ADVISABLE, "micro_batches": 1, **options}
  trainer = tfpipe.create(model, method, num_stages=1 if method == "single" else K, **options)
  trainer.compile(trainer_main.make_optimizer(config),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  timer = _EpochTimer()
  history = trainer.fit(data.train, epochs=FLAGS.epochs, validation_data=data.validation,
                        callbacks=[timer.callback], verbose=0).history
  later = timer.seconds[1:] or timer.seconds
  return {"task": task, "option": name, "K": K, "seed": seed, "epochs": FLAGS.epochs,
          "learning_rate": lr, "batch_size": FLAGS.batch_size,
          "val_accuracy": [float(a) for a in history["val_accuracy"]],
          "loss": [float(v) for v in history["loss"]],
          "samples_per_second": data.train_size // FLAGS.batch_size * FLAGS.batch_size
          * len(later) / sum(later)}


def _key(r):
  return (r["task"], r["option"], r["K"], r["seed"], r["epochs"], r["learning_rate"],
          r["batch_size"])


def load_runs(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _mean_spread(values):
  mean = statistics.mean(values)
  return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(runs, tasks, stages, names, curve_k):
  """Per task: (markdown table, {K: {option: mean best accuracy}}, curves at K=curve_k)."""
  out = {}
  for task in tasks:
    best, speed, curves = {}, {}, {}
    for r in runs:
      if r["task"] != task or r["option"] not in names:
        continue
      Ks = stages if r["option"] in BASELINES else [r["K"]]
      for K in Ks:
        best.setdefault((r["option"], K), []).append(100 * max(r["val_accuracy"]))
        speed.setdefault((r["option"], K), []).append(r["samples_per_second"])
        if K == curve_k:
          curves.setdefault(r["option"], []).append(r["val_accuracy"])
    means = {K: {n: _mean_spread(best[(n, K)])[0] for n in names if (n, K) in best}
             for K in stages}
    # The reference of each family: the synchronous baselines' runs pooled (same rule).
    for K in stages:
      for fam in ("sgd", "adam"):
        pooled = [v for n in BASELINES if staleness_advice.family(n) == fam
                  for v in best.get((n, K), [])]
        if pooled:
          means[K][_REFERENCE[fam]] = statistics.mean(pooled)
    head = ["option"] + [f"K={K}: best val. accuracy % (gap to the reference)" for K in stages] + [
        f"K={K} samples/s" for K in stages]
    rows = []
    for n in names:
      cells = [n]
      reference = _REFERENCE[staleness_advice.family(n)]
      for K in stages:
        if (n, K) not in best:
          cells.append("-")
          continue
        mean, spread = _mean_spread(best[(n, K)])
        gap = "" if n in BASELINES or reference not in means[K] else (
            f" ({mean - means[K][reference]:+.2f})")
        cells.append(f"{mean:.2f} ± {spread:.2f}{gap} [{len(best[(n, K)])}]")
      for K in stages:
        ran = (n, K) in speed and (n not in BASELINES or K == BASELINE_REPLICAS)
        cells.append(f"{max(speed[(n, K)]):.0f}" if ran else "-")
      rows.append(cells)
    out[task] = (results_io.markdown_table(head, rows), means, curves, rows)
  return out


_REFERENCE = {"sgd": "reference", "adam": "reference/adam"}   # keys of the pooled baselines


def compact_table(summary, stages, K=4):
  """Every option run at K, one column per task (the cells of the full tables), and
  samples/s."""
  tasks = list(summary)
  column = 1 + stages.index(K)
  speed_column = 1 + len(stages) + stages.index(K)
  baseline_column = (1 + len(stages) + stages.index(BASELINE_REPLICAS)
                     if BASELINE_REPLICAS in stages else speed_column)
  head = ["option"] + [f"{t}: best val. accuracy % (gap)" for t in tasks] + [
      f"samples/s ({tasks[0]})"]
  rows = []
  for i, row in enumerate(summary[tasks[0]][3]):
    speed = row[baseline_column if row[0] in BASELINES else speed_column]
    cells = [summary[t][3][i][column] for t in tasks]
    if any(c != "-" for c in cells):
      rows.append([row[0]] + cells + [speed])
  return results_io.markdown_table(head, rows)


def goal_lines(summary, K=4):
  """The issue's goal: at K, the best asynchronous option within 0.5 pp of the synchronous
  reference with the same optimizer (and the best of the SpecTrain-form SGD rows alone)."""
  lines = []
  for task, (_, means, _, _) in summary.items():
    at = means.get(K, {})
    gaps = {}
    for n, a in at.items():
      reference = _REFERENCE[staleness_advice.family(n)]
      if n not in BASELINES and n not in _REFERENCE.values() and reference in at:
        gaps[n] = (a - at[reference], a, reference)
    for label, chosen in (("any optimizer", gaps),
                          ("momentum SGD", {n: g for n, g in gaps.items()
                                            if not n.endswith("/adam")})):
      if not chosen:
        continue
      name = max(chosen, key=lambda n: chosen[n][0])
      gap, accuracy, reference = chosen[name]
      lines.append(f"- {task}, K={K}, {label}: `{name}` {accuracy:.2f}% vs {reference} "
                   f"{at[reference]:.2f}% ({gap:+.2f} pp): "
                   f"{'within' if gap >= -0.5 else 'outside'} 0.5 pp")
  return lines


def plot(curves, title, path):
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(9, 5))
  colors = plt.cm.tab20.colors   # enough distinct colours for every row
  for i, (name, runs) in enumerate(sorted(curves.items())):
    length = min(len(c) for c in runs)
    mean = [100 * statistics.mean(c[e] for c in runs) for e in range(length)]
    ax.plot(range(1, length + 1), mean, label=name, color=colors[i % len(colors)],
            linestyle="--" if name in BASELINES else ":" if name.endswith("adam") else "-")
  ax.set_xlabel("epoch")
  ax.set_ylabel("validation accuracy % (mean over seeds)")
  ax.set_title(title)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def report_scope(runs, names, stages, tasks):
  """(options, K, tasks) the report covers: the asked ones and, from the runs on file, the
  default rows and every K and task run, so that a run of a few options adds to the report
  rather than replacing it. Options without a run are left out."""
  ran = {r["option"] for r in runs}
  options = [n for n in dict.fromkeys(DEFAULT + list(names)) if n in ran]
  stages = sorted(set(stages) | {r["K"] for r in runs if r["option"] not in BASELINES})
  tasks = [t for t in TASKS if t in tasks or any(r["task"] == t for r in runs)]
  return options, stages, tasks


def main(argv):
  del argv
  names = {"all": list(OPTIONS), "default": DEFAULT, "advice": ADVICE}.get(
      ",".join(FLAGS.options), FLAGS.options)
  unknown = [n for n in names if n not in OPTIONS]
  if unknown:
    raise app.UsageError(f"unknown --options {unknown}; choose from {', '.join(OPTIONS)}")
  stages = [int(k) for k in FLAGS.stages]
  seeds = [int(s) for s in FLAGS.seeds]
  path = os.path.join(FLAGS.results_dir, "staleness_runs.jsonl")
  runs = load_runs(path)
  indices = [int(i) for i in FLAGS.learning_rate_index]
  if not FLAGS.report_only:
    import tfpipe
    tfpipe.devices.ensure_logical_cpus(max(stages))
    done = {_key(r) for r in runs}
    # The goal's K=4 and the baselines first, then the other K one seed at a time: a stopped
    # benchmark leaves the most useful part done.
    first = [(task, n, 4 if n not in BASELINES else BASELINE_REPLICAS, seed, i)
             for i in indices for task in FLAGS.tasks for seed in seeds for n in names
             if n in BASELINES or 4 in stages]
    todo = first + [(task, n, K, seed, i) for seed in seeds for K in stages if K != 4
                    for i in indices for task in FLAGS.tasks for n in names
                    if n not in BASELINES]
    os.makedirs(FLAGS.results_dir, exist_ok=True)
    for j, (task, n, K, seed, i) in enumerate(todo):
      lr = _learning_rate(task, n, i)
      if (task, n, K, seed, FLAGS.epochs, lr, FLAGS.batch_size) in done:
        continue
      start = time.perf_counter()
      result = run_one(task, n, K, seed, lr)
      runs.append(result)
      with open(path, "a") as f:
        f.write(json.dumps(result) + "\n")
      print(f"[{j + 1}/{len(todo)}] {task} {n} K={K} seed={seed} lr={lr:g}: best "
            f"{100 * max(result['val_accuracy']):.2f}%, {result['samples_per_second']:.0f} "
            f"samples/s ({time.perf_counter() - start:.0f} s)", flush=True)
  runs = [r for r in runs if r["epochs"] == FLAGS.epochs and r["batch_size"] == FLAGS.batch_size
          and r["task"] in TASKS]
  names, stages, tasks = report_scope(runs, names, stages, FLAGS.tasks)
  advice_runs = [r for r in runs if r["task"] in tasks]
  runs = [r for r in runs if r["learning_rate"] == _learning_rate(r["task"], r["option"])]
  curve_k = 4 if 4 in stages else max(stages)
  summary = summarise(runs, tasks, stages, names, curve_k)
  rates = "; ".join(f"{t}: {m}, SGD lr {'/'.join(f'{v:g}' for v in sgd)}, Adam "
                    f"{'/'.join(f'{v:g}' for v in adam)}"
                    for t, (m, _, sgd, adam) in TASKS.items() if t in tasks)
  text = [f"# Accuracy under staleness\n\nBatch {FLAGS.batch_size}, {FLAGS.epochs} epochs, "
          f"SpecTrain-form momentum SGD (gamma {FLAGS.momentum}) and Adam. Tasks, models and "
          f"learning rates ({rates}); the tables are at each task's first rate. Cells: mean ± "
          "spread of the best validation accuracy over the seeds [runs], (gap to the "
          "synchronous reference of the same optimizer: the single and dataparallel runs "
          "pooled, pp); samples/s: the best over the seeds. Baselines: single on one device, "
          f"dataparallel on {BASELINE_REPLICAS} replicas (their samples/s in that column). "
          "`bench/staleness.py`."]
  held_out = [t for t in tasks if t not in FLAGS.choose_on]
  for K in stages:
    lines = staleness_advice.advice_lines(advice_runs, K, FLAGS.choose_on, held_out)
    if lines:
      text.append(f"## Advice at K={K}: the worst gap over both learning rates\n\n"
                  + "\n".join(lines))
  if 4 in stages and summary:
    text.append(f"## K=4\n\n{compact_table(summary, stages)}")
  for task, (table, _, curves, _) in summary.items():
    text.append(f"## {task}\n\n{table}")
    if curves:
      plot(curves, f"{task}: validation accuracy at K={curve_k}",
           os.path.join(FLAGS.results_dir, f"staleness_{task}.png"))
  goals = goal_lines(summary)
  if goals:
    text.append("## Goal: within 0.5 pp of the synchronous reference at K=4\n\n"
                + "\n".join(goals))
  results_io.write(FLAGS.results_dir, "staleness.md", "\n\n".join(text))
  print("\n\n".join(text), flush=True)


if __name__ == "__main__":
  app.run(main)
