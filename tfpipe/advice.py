"""The options `method="spectrain"` takes where the user leaves them unset (None), per
optimizer: the SpecTrain variant whose worst gap to synchronous training held best over
`bench/staleness.py`'s tasks (README, "Accuracy under staleness"). A value the user passes
is always kept; the summary line names what was advised.

ADVISABLE lists the options this can set, with the value they take for other methods and
optimizers (the plain method's).
"""

import keras

from tfpipe import mitigations

__all__ = ["ADVISABLE", "SPECTRAIN", "family", "advised"]

ADVISABLE = {"version_difference": "paper", "spike_compensation": False, "nesterov": False,
             "delay_compensation": 0.0}

# family -> {option: value}; options not named keep their ADVISABLE value.
SPECTRAIN = {
    "sgd": {},
    "adam": {},
}


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
