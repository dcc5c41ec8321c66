"""The options `method="spectrain"` takes where the user leaves them unset (None), per
optimizer: the SpecTrain variant whose worst gap to synchronous training held best over
`bench/staleness.py`'s tasks (README, "Accuracy under staleness"). A value the user passes
is always kept; the summary line names what was advised.

ADVISABLE lists the options this can set, with the value they take for other methods and
optimizers (the plain method's). MICRO_BATCHES says, per optimizer, from which number of
stages K "spectrain" left `micro_batches` None splits each mini-batch into K. DEEPER names,
per method and optimizer, the number of stages from which other options held closer: the
summary line says so, and changes nothing.
"""

import keras

from tfpipe import mitigations
from tfpipe.plan import tasks

__all__ = ["ADVISABLE", "SPECTRAIN", "MICRO_BATCHES", "DEEPER", "STAGES", "family", "advised",
           "resolve", "deeper", "micro_batches", "batch_norm_layers"]

ADVISABLE = {"version_difference": "paper", "spike_compensation": False, "nesterov": False,
             "delay_compensation": 0.0}

# family -> {option: value}; options not named keep their ADVISABLE value. Both are the plain
# method today. With momentum SGD (3 seeds on every task and rate), plain spectrain's worst gap
# on the choice tasks is -3.9 / -55.7 / -78.0 pp at K = 2 / 4 / 8, against -6.9 / -77.7 / -79.5
# with exact version differences and spike compensation, and at K=4 it is the closer of the two
# on 9 of the 10 settings; with Adam plain spectrain is the closest option (README, "Accuracy
# under staleness").
SPECTRAIN = {
    "sgd": {},
    "adam": {},
}


# family -> K: from K stages on, "spectrain" left `micro_batches` None splits each mini-batch
# into K micro-batches (version differences counted exactly): as in 2BW (M >= K - 1) a stage
# applies its previous mini-batch's update before the forwards of the next, or at most one
# update after them, so a prediction spans at most one update where with M=1 it spans up to
# K-1 (7 at K=8). With Adam (bench/staleness.py, 3 seeds, both rates, README "Accuracy
# under staleness") its worst gap to synchronous Adam over the 10 settings (5 tasks, 2 rates)
# was -1.15 pp at K=4 and -1.32 at K=8, where with M=1 spectrain lost up to 7.0 pp at K=4 and
# 80.7 at K=8 (2BW: 15.7 at K=8). Momentum SGD has no entry yet: micro-batches help it with
# Nesterov's step (DEEPER), not run at K=4's second rate nor at K=2.
MICRO_BATCHES = {"adam": 4}


STAGES = "K"   # a DEEPER option's value that stands for the pipeline's number of stages

# method -> {family: (K, a method, its options)}: from K stages on, that method with those
# options (STAGES: K) held closer to synchronous training on every setting of the benchmark
# than the method as advised; the summary line says so (the choice is the user's). With
# momentum SGD at K=8 (3 seeds, both rates) spectrain with M=1 predicts up to 7 updates ahead
# and lost 3.3-78.0 pp; over K micro-batches with Nesterov's look-ahead (`spectrain+mb+nesterov`)
# it was closer on all 10 settings than that and than 2BW with Nesterov (the closest before):
# within 2 pp on 7 of the 10 (not shapes at the second rate, -15.0, nor counting, -32.0 and
# -2.6: seeds left its loss plateau or not) (README, "Accuracy under staleness"). With
# Adam the advised micro-batches (MICRO_BATCHES) held closer than 2BW (-0.8 to -15.7 pp at K=8).
DEEPER = {"spectrain": {"sgd": (8, "spectrain", {"micro_batches": STAGES,
                                                   "nesterov": True})}}


def deeper(method, family_name, num_stages, current=None):
  """What held closer than `method` with the optimizer family `family_name` at `num_stages`
  stages on the staleness benchmark (`DEEPER`), as Pipeline arguments ("method='2bw',
  nesterov=True"; the method left out when it is `method`, an option valued STAGES given as
  `num_stages`), or None, also when `current` ({option: value} in force) already has them."""
  K, other, options = DEEPER.get(method, {}).get(family_name, (None, None, None))
  if K is None or num_stages < K:
    return None
  values = {n: num_stages if v == STAGES else v for n, v in options.items()}
  if other == method and all((current or {}).get(n) == v for n, v in values.items()):
    return None
  return ", ".join(([] if other == method else [f"method={other!r}"])
                   + [f"{n}={v!r}" for n, v in values.items()])


def batch_norm_layers(model):
  """Names of `model`'s BatchNormalization layers, nested models' included."""
  found = []
  for layer in model.layers:
    if isinstance(layer, keras.layers.BatchNormalization):
      found.append(layer.name)
    if hasattr(layer, "layers"):
      found += batch_norm_layers(layer)
  return found


def micro_batches(method, optimizer, num_stages, asked, version_difference, batch_norm):
  """M that `MICRO_BATCHES` advises for `method` with `optimizer` at `num_stages` stages, or
  None (the method's own default): only where the user left `asked` (micro_batches) None and
  nothing they chose excludes it (`version_difference` "paper" counts one update per batch;
  `batch_norm`: BatchNormalization whose statistics micro-batches would change)."""
  K = MICRO_BATCHES.get(family(optimizer)) if method == "spectrain" else None
  if K is None or num_stages < K or asked is not None or batch_norm:
    return None
  return num_stages if version_difference in (None, "exact") else None


def family(optimizer):
  """"sgd" (momentum SGD, SpecTrain's optimizer), "adam" (Adam, AdamW) or None (others)."""
  if isinstance(optimizer, keras.optimizers.Adam):
    return "adam"
  if mitigations.momentum_of(optimizer) is not None:
    return "sgd"
  return None


def advised(method, optimizer, unset):
  """{option: value} for the options in `unset` (left None by the user): the advice for
  `method` and `optimizer`'s family, the plain defaults otherwise."""
  table = SPECTRAIN.get(family(optimizer), {}) if method == "spectrain" else {}
  return {name: table.get(name, ADVISABLE[name]) for name in unset}


def resolve(policy, micro_batches, optimizer, unset, delayed, given):
  """{option: value} for the options in `unset` under `policy` (`tfpipe.plan.policies`) with
  `micro_batches` and `optimizer`: the advice, each option only where it can act (`delayed`:
  some stage has a delay; an optimizer its rule is written for; a backward that reads the
  forward's weights for delay compensation; not beside an option in `given`, the values
  passed, that excludes it), else its plain value ("exact" version differences with
  micro-batches, whose updates "paper" does not count)."""
  values = advised(policy.method, optimizer, unset)
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
