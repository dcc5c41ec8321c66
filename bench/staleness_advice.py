"""Advice from the staleness benchmark's runs that is tested on tasks it was not drawn from.

A setting is (task, learning rate): each option runs at its optimizer's rates of the task.
The setting's reference is the mean best validation accuracy of the synchronous baselines
with the same optimizer and rate (`single` and `dataparallel`: both plain Keras training at
the global batch), over their seeds. An option's gap on a setting is its mean best accuracy
over its seeds minus the reference. Options are ranked by their *worst* gap over the settings
of the tasks the advice is chosen on (an option must have run on all of them), per optimizer
family (momentum SGD in SpecTrain's form; Adam); the held-out tasks then show whether the
chosen option holds where nobody looked. Pure Python over the run records of
`bench/staleness.py` (dicts with task, option, K, seed, learning_rate, val_accuracy).
"""

import collections
import statistics

__all__ = ["family", "is_baseline", "gaps", "rank", "advice_lines"]


def family(option):
  """The optimizer family of a benchmark option: "adam" (rows ending /adam) or "sgd"."""
  return "adam" if option.endswith("/adam") else "sgd"


def is_baseline(option):
  return option.split("/")[0] in ("single", "dataparallel")


def _best(run):
  return 100.0 * max(run["val_accuracy"])


def gaps(runs, K):
  """{(option, task, learning rate): gap in pp} at K stages, for every option with runs at K
  on a setting that has a reference."""
  reference, scores = collections.defaultdict(list), collections.defaultdict(list)
  for r in runs:
    setting = (r["task"], r["learning_rate"])
    if is_baseline(r["option"]):
      reference[(family(r["option"]),) + setting].append(_best(r))
    elif r["K"] == K:
      scores[(r["option"],) + setting].append(_best(r))
  out = {}
  for (option, task, lr), values in scores.items():
    ref = reference.get((family(option), task, lr))
    if ref:
      out[(option, task, lr)] = statistics.mean(values) - statistics.mean(ref)
  return out


def rank(gap_table, tasks):
  """Per family, [(option, worst gap, its setting)] best first, over the settings of `tasks`:
  an option counts only if it ran on every setting of `tasks` that its family's options ran."""
  settings = collections.defaultdict(set)
  for option, task, lr in gap_table:
    if task in tasks:
      settings[family(option)].add((task, lr))
  out = collections.defaultdict(list)
  options = sorted({o for o, _, _ in gap_table})
  for option in options:
    wanted = settings[family(option)]
    got = {(t, lr): g for (o, t, lr), g in gap_table.items() if o == option and t in tasks}
    if wanted and set(got) == wanted:
      where = min(got, key=got.get)
      out[family(option)].append((option, got[where], where))
  for ranked in out.values():
    ranked.sort(key=lambda item: -item[1])
  return dict(out)


def advice_lines(runs, K, choose, held_out):
  """Markdown: per family the ranking on `choose` (worst gap), the chosen option, and how each
  option, the chosen one first, holds on `held_out`."""
  table = gaps(runs, K)
  on_choose, on_held = rank(table, choose), rank(table, held_out)
  lines = []
  for fam in ("sgd", "adam"):
    ranked = on_choose.get(fam)
    if not ranked:
      continue
    name = {"sgd": "momentum SGD (SpecTrain form)", "adam": "Adam"}[fam]
    held = {o: (g, w) for o, g, w in on_held.get(fam, [])}
    chosen = ranked[0][0]
    lines.append(f"**{name}, K={K}: chosen on {', '.join(choose)}: `{chosen}`** "
                 f"(worst gap {ranked[0][1]:+.2f} pp, at {ranked[0][2][0]} lr {ranked[0][2][1]:g})")
    if not held_out:
      pass
    elif chosen in held:
      g, (task, lr) = held[chosen]
      lines.append(f"- held out ({', '.join(held_out)}): worst gap {g:+.2f} pp (at {task} "
                   f"lr {lr:g}); best held-out option `{on_held[fam][0][0]}` "
                   f"{on_held[fam][0][1]:+.2f} pp")
    else:
      lines.append(f"- held out ({', '.join(held_out)}): `{chosen}` has not run on every "
                   "held-out setting")
    for option, g, (task, lr) in ranked:
      after = f"; held out {held[option][0]:+.2f}" if option in held else ""
      lines.append(f"  - `{option}`: worst {g:+.2f} pp ({task} lr {lr:g}){after}")
  return lines
