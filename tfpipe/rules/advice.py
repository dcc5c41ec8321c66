"""The options `method="spectrain"` takes where the user leaves them unset (None), per
optimizer: the SpecTrain variant whose worst gap to synchronous training held best over
`bench/staleness.py`'s tasks (README, "Accuracy under staleness"). A value the user passes
is always kept; the summary line names what was advised.

ADVISABLE lists the options this can set, with the value they take for other methods and
optimizers (the plain method's). MICRO_BATCHES says, per optimizer, from which number of
stages K "spectrain" left `micro_batches` None splits each mini-batch, and into how many
micro-batches per stage; SPECTRAIN gives
the options with one batch per update, ONE_UPDATE what changes where the micro-batches bound
every prediction to one update (at the depths ONE_UPDATE_STAGES says it was measured).
"""

import keras

from tfpipe.plan import tasks
from tfpipe.rules import mitigations

__all__ = ["ADVISABLE", "SPECTRAIN", "ONE_UPDATE", "ONE_UPDATE_STAGES", "MICRO_BATCHES",
           "family", "in_words", "plain", "advised", "resolve", "micro_batches", "one_update",
           "batch_norm_layers"]

ADVISABLE = {"version_difference": "paper", "spike_compensation": False, "nesterov": False,
             "delay_compensation": 0.0}

# family -> {option: value}; options not named keep their ADVISABLE value. Both are the plain
# method with one batch per update (M = 1): with Adam plain spectrain is the closest option
# there (3 seeds, every task and rate; README, "Accuracy under staleness"); with momentum SGD
# plain spectrain beat exact version differences with spike compensation (worst gap on the
# choice tasks -3.9 / -55.7 / -78.0 pp at K = 2 / 4 / 8, against -6.9 / -77.7 / -79.5).
SPECTRAIN = {
    "sgd": {},
    "adam": {},
}

# family -> {option: value} on top of SPECTRAIN's where every prediction spans at most one
# update (`one_update`: M >= K - 1 micro-batches, as MICRO_BATCHES advises, or K=2). With
# momentum SGD, Nesterov's look-ahead there (`spectrain+mb+nesterov`, 3 seeds, both rates) held
# closer than every other momentum-SGD option at K = 2, 4 and 8; at K=2 with one batch per
# update (`spectrain+nesterov`) it held closer than plain spectrain on all 10 settings (worst
# gap -48.8 pp against -62.7; README, "Accuracy under staleness").
ONE_UPDATE = {"sgd": {"nesterov": True}, "adam": {"nesterov": True}}

# family -> (least K, deepest K) at which ONE_UPDATE's advice was measured and applies; a
# family not here takes it at every K. With Adam, Nesterov's look-ahead (NAdam's step), 3 seeds,
# both rates: over M=K micro-batches at K=4 (`spectrain+mb+nesterov/adam`) it held closer than
# M=K without it on the choice tasks (worst gap +0.25 pp against -0.58) and held out (-0.73
# against -1.15), within the goal on all 10 settings where M=K alone met 8; with M=1 at K=2
# (`spectrain+nesterov/adam`) closer than plain spectrain (-0.07 against -0.78, held out -0.20
# against -0.72); over M=K at K=8 closer than M=K alone on the choice tasks (worst -0.22
# against -0.33) and held out (-0.48 against -1.32), within 0.5 pp chosen and 1 pp held out
# on all 10 settings. Deeper than K=8 it was not run.
ONE_UPDATE_STAGES = {"adam": (2, 8)}


# family -> (K, F): from K stages on, "spectrain" left `micro_batches` None splits each
# mini-batch into M = F x K micro-batches (version differences counted exactly): as in 2BW
# (M >= K - 1) a stage applies its previous mini-batch's update before the forwards of the
# next, or at most one update after them, so a prediction spans at most one update where with
# M=1 it spans up to K-1 (7 at K=8); and stage k's forwards read the one-update-old weights
# on (K-1-k)/M of the micro-batches (`versions.exact_version_differences`), so F=2 halves
# that share. bench/staleness.py, 3 seeds, both rates, README "Accuracy under staleness":
# - Adam (`spectrain+mb/adam`, F=1): worst gap to synchronous Adam over the 10 settings (5
#   tasks, 2 rates) -1.15 pp at K=4 and -1.32 at K=8, where with M=1 spectrain lost up to 7.0
#   pp at K=4 and 80.7 at K=8 (2BW: 15.7 at K=8). At K=2, M=1 already held within 0.8 pp
#   (M=2: -0.24 on the choice tasks but -0.82 held out, against M=1's -0.78 and -0.72).
# - Momentum SGD, with ONE_UPDATE's Nesterov step: with F=1 (`spectrain+mb+nesterov`) worst
#   gap over the choice tasks -1.13 pp at K=4 and -15.03 at K=8 (plain spectrain: -55.7,
#   -78.0), held out -18.88 and -32.02 (-72.6, -73.9): SGD's loss plateau, left later on every
#   seed (6 seeds on counting at K=4). With F=2 (`spectrain+mb2+nesterov`) at K=4: -0.93
#   chosen, -0.22 held out (counting at the first rate 92.55% against the synchronous 92.77%;
#   F=1 73.88%), and -0.07 chosen with 3 more seeds on shapes; at K=8 within 2 pp on 9 of
#   10 settings, counting at the first rate -3.12 (-2.27 over 6 seeds run on one machine,
#   +3.24 with 4K micro-batches at 0.6x the samples/s; F=1 met 7). Not
#   advised at K=2, although there too it held all 10 settings (worst -0.32 chosen, -0.72
#   held out, against M=1 with Nesterov's step: -0.75, and -48.83 on counting's plateau):
#   M=1 already bounds K=2's predictions to one update, and M=4 costs the K=2 pipeline its
#   speed (bench/pipeline_speedup.py, snn 8 x 1024: 1.22x Keras fit with M=1, 1.01x with
#   M=2, 0.84x with M=4; Llama's start-up 1.2-1.3x Keras's with M=1, 1.6x with M=4).
MICRO_BATCHES = {"adam": (4, 1), "sgd": (4, 2)}


def batch_norm_layers(model):
  """Names of `model`'s BatchNormalization layers, nested models' included."""
  found = []
  for layer in model.layers:
    if isinstance(layer, keras.layers.BatchNormalization):
      found.append(layer.name)
    if hasattr(layer, "layers"):
      found += batch_norm_layers(layer)
  return found


def micro_batches(policy, optimizer, num_stages, asked, version_difference, batch_norm):
  """M that `MICRO_BATCHES` advises for `policy`'s method (SpecTrain's: it predicts) with
  `optimizer` at `num_stages` stages, or
  None (the method's own default): only where the user left `asked` (micro_batches) None and
  nothing they chose excludes it (`version_difference` "paper" counts one update per batch;
  `batch_norm`: BatchNormalization whose statistics micro-batches would change)."""
  least, per_stage = MICRO_BATCHES.get(family(optimizer), (None, None))
  if (not policy.predicts or least is None or num_stages < least or asked is not None
      or batch_norm):
    return None
  return per_stage * num_stages if version_difference in (None, "exact") else None


def family(optimizer):
  """"sgd" (momentum SGD, SpecTrain's optimizer), "adam" (Adam, AdamW) or None (others)."""
  if isinstance(optimizer, keras.optimizers.Adam):
    return "adam"
  if mitigations.momentum_of(optimizer) is not None:
    return "sgd"
  return None


def plain(policy, unset, micro_batches):
  """{option: value} for the options in `unset` without advice: the method's own rule
  (`ADVISABLE`'s values; "exact" version differences for a prediction over micro-batches,
  the ones that count their updates)."""
  values = {n: ADVISABLE[n] for n in unset}
  if "version_difference" in values and policy.predicts and micro_batches > 1:
    values["version_difference"] = "exact"
  return values


def in_words(optimizer):
  """`optimizer` as a person names it: "momentum SGD (SpecTrain's optimizer, momentum 0.9)",
  "SGD", "Adam", "AdamW", else its class's name."""
  name = type(optimizer).__name__
  momentum = mitigations.momentum_of(optimizer)
  if momentum is None:
    return name
  momentum = float(momentum)
  if name == "SGD":
    return f"momentum SGD (momentum {momentum:g})" if momentum else "SGD"
  return f"momentum SGD ({name}'s optimizer, momentum {momentum:g})"


def one_update(micro_batches, num_stages):
  """Whether M micro-batches at K > 1 stages bound every 1F1B prediction to one update:
  M >= K - 1 (2BW's m >= d; at K=2 one batch per update does)."""
  return num_stages > 1 and micro_batches >= num_stages - 1


def advised(policy, optimizer, unset, micro_batches, num_stages, paper=False):
  """{option: value} for the options in `unset` (left None by the user): the advice for
  `method` and `optimizer`'s family with `micro_batches` at `num_stages` stages (`ONE_UPDATE`'s
  on top where `one_update` at the depths `ONE_UPDATE_STAGES` allows, unless `paper`: the
  paper's version differences were asked for), the plain defaults otherwise."""
  table = {}
  if policy.predicts:   # the advice was measured for SpecTrain
    kind = family(optimizer)
    table = dict(SPECTRAIN.get(kind, {}))
    least, deepest = ONE_UPDATE_STAGES.get(kind, (2, None))
    measured = least <= num_stages and (deepest is None or num_stages <= deepest)
    if one_update(micro_batches, num_stages) and not paper and measured:
      table.update(ONE_UPDATE.get(kind, {}))
  return {name: table.get(name, ADVISABLE[name]) for name in unset}


def resolve(policy, micro_batches, num_stages, optimizer, unset, delayed, given):
  """{option: value} for the options in `unset` under `policy` (`tfpipe.plan.policies`) with
  `micro_batches` at `num_stages` stages and `optimizer`: the advice, each option only where
  it can act (`delayed`: some stage has a delay; an optimizer its rule is written for; a
  backward that reads the forward's weights for delay compensation; not beside an option in
  `given`, the values passed, that excludes it: version_difference="paper" asks for the paper's
  rule), else its plain value ("exact" version differences with micro-batches, whose updates
  "paper" does not count)."""
  values = advised(policy, optimizer, unset, micro_batches, num_stages,
                   paper=given.get("version_difference") == "paper")
  if "version_difference" in values and policy.predicts and micro_batches > 1:
    values["version_difference"] = "exact"
  for name in ("spike_compensation", "nesterov", "delay_compensation"):
    if not values.get(name):
      continue
    try:
      if not delayed:
        raise ValueError("no delay")
      if name != "delay_compensation":
        mitigations.check_optimizer(optimizer, name)
      elif tasks.op(policy, "B").reads != "kept":
        raise ValueError("recomputes")
    except ValueError:
      values[name] = ADVISABLE[name]
  if values.get("nesterov") and given.get("spike_compensation"):
    values["nesterov"] = False
  if values.get("spike_compensation") and given.get("nesterov") and "nesterov" not in values:
    values["spike_compensation"] = False
  return values
