"""Time to accuracy: each candidate's wall-clock to the synchronous accuracy, on the staleness
benchmark's tasks at K = 4 and 8, and how `method="auto"` chooses among them.

Target, per task, seed and K: the synchronous reference's best validation accuracy over
its epochs (`single`: Keras at the global batch, which every synchronous schedule equals)
less 0.5 pp. A candidate's epochs to target come from its accuracy curve in
bench/results/staleness_runs.jsonl (the staleness benchmark's runs, at each task's first
learning rate, SpecTrain-form momentum SGD or Adam; runs missing there are run first and
appended): the synchronous schedules, gpipe, 1f1b and zb at M = K and 2K and 1f1b at
M = 1 and K/2 (every schedule alike there on these shared cores), and the
data-parallel baseline (MirroredStrategy over K replicas) follow the reference's curve (the
same updates); spectrain plain (M=1), spectrain advised (`advice=True`), 2bw and `auto` (the
curve of what it chose) their own. Its seconds come from training it here for
`--speed_epochs` epochs on the task (momentum SGD, validation each epoch, as the staleness
runs; its fit asks for the runs' `--epochs`, which `auto` weighs start-up against, and is
stopped after those): the first epoch (start-up, and `auto`'s profile, included) and the
median later one; time to target = first + (epochs to target - 1) x later. A candidate that does not reach the
target within the runs' epochs on a seed has no time there ("-", with how many seeds it
reached).

Part 1 (`epochs`, no training): per optimizer family, depth and candidate kind, the epochs
to target relative to the reference's, over the tasks chosen on (`--choose_on`; the others
held out): the table `tfpipe.rules.epochs` holds and `auto` reads. Part 2 (`times`): the
wall-clock table. Writes bench/results/time_to_accuracy.md (and .jsonl, the measured
seconds) and docs/time-to-accuracy.md from them.

  python bench/time_to_accuracy.py [--stages=4,8 --tasks=classes,teacher,regions,shapes,counting
                                    --seeds=0,1,2 --parts=epochs,times]
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from bench import results_io, staleness  # noqa: E402   (its flags: tasks, stages, seeds, ...)

flags.DEFINE_list("parts", ["epochs", "times"], "epochs (from the runs on file), times (trains)")
flags.DEFINE_bool("run_missing", True, "run the staleness runs the tables need and lack")
flags.DEFINE_integer("speed_epochs", 3, "epochs each candidate trains to time it")
flags.DEFINE_integer("repeats", 1, "timings of each candidate of --repeated, taken in turn "
                     "across the candidates of a task and K; the table takes their medians")
flags.DEFINE_list("repeated", ["1f1b M=1", "1f1b M=K/2", "gpipe M=K", "gpipe M=2K",
                               "1f1b M=K", "1f1b M=2K", "zb M=K", "zb M=2K", "auto"],
                  "the candidates timed --repeats times (the others once: on these tasks "
                  "they take 2-40x the fastest's time)")
FLAGS = flags.FLAGS

GOAL_PP = 0.5
# family -> kind -> staleness option (at K=2 the advice is Nesterov's step alone, M=1).
KINDS = {
    "sgd": {"synchronous": "single", "spectrain": "spectrain",
            "spectrain advised": "spectrain+mb2+nesterov", "2bw": "2bw"},
    "adam": {"synchronous": "single/adam", "spectrain": "spectrain/adam",
             "spectrain advised": "spectrain+mb+nesterov/adam", "2bw": "2bw/adam"},
}
ADVISED_AT_2 = {"sgd": "spectrain+nesterov", "adam": "spectrain+nesterov/adam"}
HALF_STAGES = "K/2"   # an option value that stands for half the run's depth
# The candidates timed: (name, kind, create's method, its options).
TIMED = [("1f1b M=1", "synchronous", "1f1b", {"micro_batches": 1}),
         ("1f1b M=K/2", "synchronous", "1f1b", {"micro_batches": HALF_STAGES}),
         ("gpipe M=K", "synchronous", "gpipe", {"micro_batches": "K"}),
         ("gpipe M=2K", "synchronous", "gpipe", {"micro_batches": "2K"}),
         ("1f1b M=K", "synchronous", "1f1b", {"micro_batches": "K"}),
         ("1f1b M=2K", "synchronous", "1f1b", {"micro_batches": "2K"}),
         ("zb M=K", "synchronous", "zb", {"micro_batches": "K"}),
         ("zb M=2K", "synchronous", "zb", {"micro_batches": "2K"}),
         ("dataparallel", "synchronous", "dataparallel", {}),
         ("spectrain", "spectrain", "spectrain", {}),
         ("spectrain advised", "spectrain advised", "spectrain", {"advice": True}),
         ("2bw", "2bw", "2bw", {}),
         ("auto", None, "auto", {})]
RESULTS_FILE = "time_to_accuracy.jsonl"


def option_for(family, kind, K):
  if kind == "spectrain advised" and K == 2:
    return ADVISED_AT_2[family]
  return KINDS[family][kind]


def epochs_to(curve, target):
  """The 1-based epoch at which `curve` first reaches `target`, or None."""
  return next((i + 1 for i, a in enumerate(curve) if a >= target), None)


def curves(runs, task, option, K, seed, lr):
  """The accuracy curve of a run on file, or None."""
  for r in runs:
    if (r["task"] == task and r["option"] == option and r["seed"] == seed
        and r["learning_rate"] == lr and r["epochs"] == FLAGS.epochs
        and r["batch_size"] == FLAGS.batch_size
        and (r["K"] == K or option in staleness.BASELINES)):
      return r["val_accuracy"]
  return None


def _learning_rate(task, family):
  _, _, sgd, adam = staleness.TASKS[task]
  return (adam if family == "adam" else sgd)[0]


def ensure_runs(tasks, stages, seeds, families):
  """Runs the staleness runs the tables need that are not on file; returns all runs."""
  path = os.path.join(FLAGS.results_dir, "staleness_runs.jsonl")
  runs = staleness.load_runs(path)
  for family in families:
    for task in tasks:
      lr = _learning_rate(task, family)
      for K in stages:
        for kind in KINDS[family]:
          option = option_for(family, kind, K)
          for seed in seeds:
            if curves(runs, task, option, K, seed, lr) is None and FLAGS.run_missing:
              print(f"running {option} on {task}, K={K}, seed {seed}", flush=True)
              result = staleness.run_one(task, option, K, seed, lr)
              with open(path, "a") as f:
                f.write(json.dumps(result) + "\n")
              runs.append(result)
  return runs


def epochs_table(runs, tasks, stages, seeds, families):
  """{(family, K, kind): (mean epochs / the reference's, seeds reached, seeds)} over `tasks`."""
  table = {}
  for family in families:
    for K in stages:
      for kind in KINDS[family]:
        ratios, reached, total = [], 0, 0
        for task in tasks:
          lr = _learning_rate(task, family)
          for seed in seeds:
            reference = curves(runs, task, KINDS[family]["synchronous"], K, seed, lr)
            curve = curves(runs, task, option_for(family, kind, K), K, seed, lr)
            if reference is None or curve is None:
              continue
            target = max(reference) - GOAL_PP / 100
            e, e0 = epochs_to(curve, target), epochs_to(reference, target)
            total += 1
            if e is not None:
              reached += 1
              ratios.append(e / e0)
        if total:
          table[(family, K, kind)] = (statistics.mean(ratios) if ratios else None, reached,
                                      total)
  return table


def _StopAfter(epochs):
  """A Keras callback that stops training after `epochs` epochs."""
  import keras

  class StopAfter(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      if epoch + 1 >= epochs:
        self.model.stop_training = True
  return StopAfter()


def _time_one(task, name, K):
  """Trains candidate `name` at K on `task` for --speed_epochs epochs: its seconds."""
  import keras
  import tfpipe
  from trainers import config as config_lib, datasets, main as trainer_main, models
  _, kind, method, options = next(t for t in TIMED if t[0] == name)
  per_stage = dict(staleness._PER_STAGE, **{HALF_STAGES: 0.5})
  options = {k: int(per_stage[v] * K) if v in per_stage else v for k, v in options.items()}
  model_name, model_options, sgd, _ = staleness.TASKS[task]
  config = config_lib.TrainConfig(model=model_name, dataset=task, method="1f1b", num_stages=K,
                                  batch_size=FLAGS.batch_size, learning_rate=sgd[0],
                                  momentum=FLAGS.momentum, epochs=FLAGS.speed_epochs, seed=0,
                                  optimizer="spectrain", **model_options)
  keras.backend.clear_session()
  keras.utils.set_random_seed(0)
  data = datasets.load(config)
  model = models.build_model(config, data.input_shape, data.num_classes, data.vocab_size)
  trainer = tfpipe.create(model, method, num_stages=K, **options)
  trainer.compile(trainer_main.make_optimizer(config),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
  timer = staleness._EpochTimer()
  start = time.perf_counter()
  # The fit asks for the runs' epochs (what `auto` weighs start-up against) and stops after
  # --speed_epochs.
  trainer.fit(data.train, epochs=FLAGS.epochs, validation_data=data.validation,
              callbacks=[timer.callback, _StopAfter(FLAGS.speed_epochs)], verbose=0)
  first = time.perf_counter() - start - sum(timer.seconds[1:])
  chosen = None
  if method == "auto":
    chosen = trainer.chosen.kind
  return {"task": task, "candidate": name, "K": K, "first": first,
          "later": statistics.median(timer.seconds[1:]), "chosen": chosen,
          "chosen_name": trainer.chosen.name if method == "auto" else None,
          "profile": trainer.chosen.seconds if method == "auto" else 0.0,
          "kept": bool(trainer.chosen.kept) if method == "auto" else False}


def merged(timings):
  """One candidate's timings as one: the medians of its first and later epochs and of its
  profile; for auto, the choice most of them made (kept where all kept their probe)."""
  median = lambda key: statistics.median(t.get(key) or 0.0 for t in timings)
  names = [t.get("chosen_name") for t in timings]
  chosen_name = max(names, key=names.count)
  return dict(timings[0], first=median("first"), later=median("later"),
              profile=median("profile"), chosen_name=chosen_name,
              chosen=next(t["chosen"] for t in timings if t.get("chosen_name") == chosen_name),
              kept=all(t.get("kept") for t in timings), repeats=len(timings))


def times_rows(runs, timed, tasks, stages, seeds, held_out):
  """The wall-clock table's rows: per task and K, each candidate's mean seconds to target."""
  rows, auto_ratios = [], []
  for task in tasks:
    lr = _learning_rate(task, "sgd")
    for K in stages:
      cells, best = {}, None
      for name, kind, _, _ in TIMED:
        t = timed.get((task, name, K))
        if t is None:
          continue
        kind = t["chosen"] if name == "auto" else kind
        seconds, reached = [], 0
        for seed in seeds:
          reference = curves(runs, task, "single", K, seed, lr)
          curve = curves(runs, task, option_for("sgd", kind, K), K, seed, lr)
          if reference is None or curve is None:
            continue
          e = epochs_to(curve, max(reference) - GOAL_PP / 100)
          if e is not None:
            reached += 1
            seconds.append(t["first"] + (e - 1) * t["later"])
        mean = statistics.mean(seconds) if reached == len(seeds) else None
        cells[name] = (mean, reached, t)
        if mean is not None and name != "auto" and (best is None or mean < best):
          best = mean
      auto, _, auto_run = cells.get("auto", (None, 0, None))
      ratio = auto / best if auto is not None and best else None
      choice = ((auto - auto_run["profile"]) / best if auto is not None and best else None)
      if ratio is not None:
        auto_ratios.append((task, K, ratio, choice, auto_run["profile"] / best,
                            bool(auto_run.get("kept"))))
      row = [task + (" (held out)" if task in held_out else ""), K]
      for name, _, _, _ in TIMED:
        mean, reached, t = cells.get(name, (None, 0, None))
        text = "-" if t is None else (f"{mean:.1f}" if mean is not None
                                      else f"- ({reached}/{len(seeds)})")
        if mean is not None and mean == best:
          text = f"**{text}**"
        row.append(text)
      chosen = cells.get("auto", (None, 0, {}))[2] or {}
      row.append((chosen.get("chosen_name") or "-") + (" (kept)" if chosen.get("kept") else ""))
      row.append(f"{ratio:.2f}" if ratio is not None else "-")
      row.append(f"{choice:.2f}" if choice is not None else "-")
      rows.append(row)
  return rows, auto_ratios


def _repeats(timed):
  """How many timings each candidate's seconds are the median of, in words."""
  counts = sorted({t.get("repeats", 1) for t in timed.values()})
  if counts == [1]:
    return "one each"
  return (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}") + " each"


def main(argv):
  del argv
  tasks, stages = FLAGS.tasks, [int(k) for k in FLAGS.stages]
  seeds = [int(s) for s in FLAGS.seeds]
  held_out = [t for t in tasks if t not in FLAGS.choose_on]
  import tfpipe
  tfpipe.devices.ensure_logical_cpus(max(stages), intra_op_threads=1)
  runs = ensure_runs(tasks, stages, seeds, ("sgd", "adam"))
  sections = []
  if "epochs" in FLAGS.parts:
    table = epochs_table(runs, [t for t in tasks if t in FLAGS.choose_on], stages, seeds,
                         ("sgd", "adam"))
    rows = [[family, K, kind, "-" if v[0] is None else f"{v[0]:.2f}", f"{v[1]}/{v[2]}"]
            for (family, K, kind), v in sorted(table.items())]
    sections.append(
        f"## Epochs to the synchronous accuracy less {GOAL_PP} pp, relative to synchronous "
        f"training\n\nOn the tasks chosen on ({', '.join(FLAGS.choose_on)}), seeds "
        f"{', '.join(FLAGS.seeds)}, each task's first learning rate: the mean of the "
        "candidate's epochs over the reference's where it reached the target, and on how "
        "many runs it did (`tfpipe.rules.epochs` holds this table).\n\n"
        + results_io.markdown_table(["optimizer", "K", "kind", "epochs (x synchronous)",
                                     "reached"], rows))
  if "times" in FLAGS.parts:
    path = os.path.join(FLAGS.results_dir, RESULTS_FILE)
    timings = {}   # (task, candidate, K) -> its timings
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          t = json.loads(line)
          timings.setdefault((t["task"], t["candidate"], t["K"]), []).append(t)
    for task in tasks:
      for K in stages:
        # In turn: a drift of the machine's speed reaches every candidate alike.
        for repeat in range(FLAGS.repeats):
          for name, _, _, _ in TIMED:
            if (len(timings.get((task, name, K), [])) > repeat
                or (repeat and name not in FLAGS.repeated)):
              continue
            print(f"timing {name} on {task}, K={K} ({repeat + 1}/{FLAGS.repeats})", flush=True)
            t = _time_one(task, name, K)
            timings.setdefault((task, name, K), []).append(t)
            with open(path, "a") as f:
              f.write(json.dumps(t) + "\n")
    timed = {key: merged(runs) for key, runs in timings.items()}
    rows, ratios = times_rows(runs, timed, tasks, stages, seeds, held_out)
    within = sum(r <= 1.1 for _, _, r, _, _, _ in ratios)
    chosen_within = sum(c <= 1.1 for _, _, _, c, _, _ in ratios)
    shares = [p for *_, p, kept in ratios if not kept]
    kept = sum(k for *_, k in ratios)
    bounded = sum(p > 0.1 for p in shares)
    profiled = (f"Its profile, where it ran, took {min(shares):.0%}-{max(shares):.0%} of the "
                f"fastest column's time (over 10% on {bounded} of {len(shares)})"
                if shares else "It ran no profile")
    sections.append(
        f"## Seconds to the synchronous accuracy less {GOAL_PP} pp (momentum SGD, batch "
        f"{FLAGS.batch_size})\n\nMean over seeds {', '.join(FLAGS.seeds)} (the seconds: "
        f"the median of each candidate's timings, {_repeats(timed)}); the fastest "
        f"in bold; \"- (n/{len(seeds)})\": did not reach it on every seed within "
        f"{FLAGS.epochs} epochs. auto (its profile included) within 10% of the fastest: "
        f"{within} of {len(ratios)}; its choice alone (its time less the profile's): "
        f"{chosen_within} of {len(ratios)}. It kept its probe without a profile (\"(kept)\": "
        f"a profile would have cost over a tenth of the rest of the fit) on {kept} of "
        f"{len(ratios)}. {profiled}.\n\n"
        + results_io.markdown_table(["task", "K"] + [t[0] for t in TIMED]
                                    + ["auto chose", "auto / fastest",
                                       "less its profile"], rows))
  title = ("# Time to accuracy\n\n`python bench/time_to_accuracy.py`: K logical CPUs of this "
           "machine's cores (one intra-op thread each).")
  text = title + "\n\n" + "\n\n".join(sections)
  results_io.write(FLAGS.results_dir, "time_to_accuracy.md", text)
  print(text, flush=True)


if __name__ == "__main__":
  FLAGS.set_default("stages", ["4", "8"])
  app.run(main)
