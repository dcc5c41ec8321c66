"""A Pipeline's options: what the user asked (`Asked`), and what is in force (`Options`).

`Asked` holds `tfpipe.Pipeline`'s option arguments as given, None where left unset.
`checked` turns them into `Options` once the number of stages is known, refusing a bad value
with the option's name before any TensorFlow work; `resolved` gives the options in force
for the optimizer `compile` receives (with `advice=True`, `tfpipe.rules.advice` fills what
was left unset; otherwise the method's own rule, as its paper gives it) and each stage's
update rule. Both are frozen: a pipeline's options change only by being
resolved again, at its next `compile`. What the options mean is documented on
`tfpipe.Pipeline`; the method itself is only ever asked about through its weight policy.
"""

import dataclasses
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import keras

from tfpipe import runtime
from tfpipe.instruments import prediction_error as prediction_error_lib, trace
from tfpipe.plan import names, policies, tasks
from tfpipe.rules import advice, mitigations

__all__ = ["Asked", "Options", "policy_of", "checked", "resolved"]

# The options `tfpipe.rules.advice` may set where the user leaves them None.
_ADVISABLE = ("version_difference", "spike_compensation", "nesterov", "delay_compensation")


@dataclasses.dataclass(frozen=True)
class Asked:
  """`tfpipe.Pipeline`'s option arguments as the user gave them (None: left unset)."""
  method: str = "spectrain"
  spectrain_backward: str = "reuse"
  version_difference: Optional[str] = None
  micro_batches: Optional[int] = None
  recompute: Optional[bool] = None
  lockstep: bool = False
  record: bool = False
  trace_steps: Union[Tuple[int, int], str, None] = None
  trace_dir: Optional[str] = None
  prediction_error: Union[prediction_error_lib.PredictionError, bool, None] = None
  executor: Optional[str] = None
  spike_compensation: Optional[bool] = None
  delay_momentum: bool = False
  lr_rescheduling: Optional[int] = None
  discrepancy_decay: Optional[float] = None
  batch_statistics: str = "warn"
  virtual_stages: Optional[int] = None
  nesterov: Optional[bool] = None
  delay_compensation: Optional[float] = None
  advice: bool = False


@dataclasses.dataclass(frozen=True)
class Options:
  """The options in force: checked, defaults filled in, and after `compile` what
  `tfpipe.rules.advice` advised for its optimizer (`advised`, for optimizer `family`)."""
  policy: policies.WeightPolicy
  micro_batches: int
  version_difference: str
  spike_compensation: bool
  delay_momentum: bool
  lr_rescheduling: int
  discrepancy_decay: float
  nesterov: bool
  delay_compensation: float
  executor: str
  record: bool
  trace_steps: Optional[Tuple[int, int]]
  trace_dir: Optional[str]
  prediction_error: Optional[prediction_error_lib.PredictionError]
  unset: Tuple[str, ...] = ()   # the advisable options the user left None
  advised: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  family: Optional[str] = None   # the optimizer's family, once resolved at compile
  looked_up: bool = False   # whether advice was looked up (at compile, with options unset)
  advice: bool = False   # whether `tfpipe.rules.advice` may fill the options left unset
  optimizer: Optional[str] = None   # the optimizer in plain words, once resolved at compile

  @property
  def method(self) -> str:
    return self.policy.method

  def update_options(self) -> List[Tuple[str, Any]]:
    """The options in force that change a stage's update: [(name, value)]."""
    return [(n, v) for n, v in (("spike_compensation", self.spike_compensation),
                                ("delay_momentum", self.delay_momentum),
                                ("lr_rescheduling", self.lr_rescheduling),
                                ("nesterov", self.nesterov),
                                ("delay_compensation", self.delay_compensation)) if v]

  def micro_batch_hint(self) -> str:
    """For errors about batches too small for M: where M was advised, how to opt out."""
    if not self.advised.get("micro_batches"):
      return ""
    return (f" (micro_batches={self.micro_batches} was advised for {self.family} by "
            "tfpipe.rules.advice: pass micro_batches=1 to the Pipeline to train on whole batches)")

  def describe(self, num_stages: int, num_devices: Optional[int] = None,
               batch_size: Optional[int] = None) -> str:
    """The summary's first line, in plain words: the method and whether it updates as Keras
    does, stages, what one update takes (a mini-batch whole, or M micro-batches of
    `batch_size` / M samples), the optimizer (once compiled) and update options in force."""
    M = self.micro_batches
    if M == 1:
      micro = ", one update per mini-batch taken whole"
    else:
      size = (f" of {batch_size // M} samples" if batch_size and batch_size % M == 0 else
              f" (1/{M} of a mini-batch each)")
      micro = f", {M} micro-batches{size} per update"
    if self.optimizer:
      micro += f", {self.optimizer}"
    on = [n if v is True else f"{n}={v}" for n, v in self.update_options()]
    if self.policy.corrects:
      on.append(f"discrepancy_decay={self.discrepancy_decay}")
    micro += f", {', '.join(on)}" if on else ""
    if self.advised:
      micro += (f" ({', '.join(sorted(self.advised))} advised for {self.family}: "
                "tfpipe.rules.advice)")
    elif self.looked_up and self.family and self.policy.predicts:
      micro += f" (no option advised for {self.family}: tfpipe.rules.advice)"
    elif self.unset and self.policy.predicts and not self.looked_up and self.advice:
      micro += " (options left unset: advised for the optimizer at compile)"
    devices = f" on {num_devices} devices" if num_devices not in (None, num_stages) else ""
    kind = ("synchronous: the updates of Keras fit" if self.policy.method in
            policies.SYNCHRONOUS_METHODS else
            "asynchronous: stale updates, its weights will not equal Keras fit's")
    return f"method={self.method} ({kind}), {num_stages} stages{devices}{micro}"


def policy_of(asked: Asked) -> policies.WeightPolicy:
  """The weight policy `asked` names (its method, backward, recompute, lockstep and V)."""
  return policies.policy_for(asked.method, asked.spectrain_backward, asked.recompute,
                             asked.lockstep, asked.virtual_stages)


def checked(asked: Asked, model: keras.Model, num_stages: int) -> Options:
  """`asked` checked for `model` at `num_stages` stages, with the plain method's values where
  options were left unset (until `resolved` at compile)."""
  policy = policy_of(asked)
  if asked.advice not in (True, False):
    raise ValueError(f"`advice` must be True or False. Received: advice={asked.advice!r}")
  M = policies.micro_batches_for(policy, asked.micro_batches, num_stages)
  unset = tuple(n for n in _ADVISABLE if getattr(asked, n) is None)
  values = _plain(asked, unset, policy, M)
  _check_batch_statistics(model, asked.batch_statistics, M)
  trace_steps = trace.parse_steps(asked.trace_steps)
  if trace_steps is not None and not asked.trace_dir:
    raise ValueError(f"`trace_steps={asked.trace_steps!r}` needs a `trace_dir` to write the "
                     "trace to")
  recorder = asked.prediction_error
  if recorder is True:
    recorder = prediction_error_lib.PredictionError()
  if recorder not in (None, False) and not isinstance(
      recorder, prediction_error_lib.PredictionError):
    raise ValueError("`prediction_error` must be True or a tfpipe.instruments.prediction_error."
                     f"PredictionError. Received: {asked.prediction_error!r}")
  return Options(policy=policy, micro_batches=M, executor=names.lookup(
      "executor", asked.executor or "compiled", runtime.EXECUTORS),
                 record=bool(asked.record) or trace_steps is not None, trace_steps=trace_steps,
                 trace_dir=asked.trace_dir, prediction_error=recorder or None, unset=unset,
                 advice=asked.advice,
                 **_rules(policy, M, asked, values))


def resolved(options: Options, asked: Asked, model: keras.Model, optimizer: Any,
             num_stages: int) -> Tuple[Options, List[int], List[mitigations.StageRule]]:
  """The options in force for `optimizer` (what was left unset advised for it, each only
  where it can act), each stage's delay D_k and the `mitigations.StageRule` of its updates;
  refuses options that cannot act (no delay, an optimizer their rule is not written for)."""
  policy = options.policy
  plain = policies.micro_batches_for(policy, asked.micro_batches, num_stages)
  M = plain if not asked.advice else advice.micro_batches(
      policy, optimizer, num_stages, asked.micro_batches,
      None if "version_difference" in options.unset else options.version_difference,
      bool(advice.batch_norm_layers(model)) and asked.batch_statistics != "micro_batch") or plain
  delays = mitigations.delays_for(policy.schedule, num_stages, M, policy.virtual_stages)
  family = advice.family(optimizer)
  advised: Dict[str, Any] = {"micro_batches": M} if M != plain else {}
  values = _plain(asked, options.unset, policy, M)
  if options.unset and asked.advice:
    given = {"spike_compensation": values["spike_compensation"],
             "nesterov": values["nesterov"], "version_difference": asked.version_difference}
    chosen = advice.resolve(policy, M, num_stages, optimizer, list(options.unset),
                            any(delays), given)
    values.update(chosen)
    advised.update({n: v for n, v in chosen.items() if v != advice.ADVISABLE[n]})
  rules = _rules(policy, M, asked, values)
  if asked.lr_rescheduling is None and policy.corrects:   # pipemare's default: where written
    try:
      mitigations.check_optimizer(optimizer, "lr_rescheduling")
      rules["lr_rescheduling"] = mitigations.DEFAULT_LR_RESCHEDULING
    except ValueError:
      rules["lr_rescheduling"] = 0
  looked_up = options.looked_up or (bool(options.unset) and asked.advice)
  options = dataclasses.replace(options, micro_batches=M, advised=advised, family=family,
                                looked_up=looked_up, optimizer=advice.in_words(optimizer),
                                **rules)
  on = [n for n, _ in options.update_options()]
  for name in on:
    if name != "delay_compensation":   # a gradient's correction: any optimizer
      mitigations.check_optimizer(optimizer, name)
  if on and not any(delays):
    raise ValueError(f"{on[0]} acts on delayed updates, and method {policy.method!r} at "
                     f"{num_stages} stages delays none")
  decay = options.discrepancy_decay if policy.corrects else None
  return options, delays, [
      mitigations.StageRule(d, options.spike_compensation, options.lr_rescheduling, decay,
                            options.nesterov, options.delay_compensation) for d in delays]


def _plain(asked, unset, policy, M):
  """The advisable options as asked, the plain method's values where `unset`: "exact"
  version differences with micro-batches (the ones that count their updates)."""
  values = {n: getattr(asked, n) for n in _ADVISABLE}
  values.update(advice.plain(policy, unset, M))
  return values


def _rules(policy, M, asked, values):
  """The update options checked: {name: value} for `Options`."""
  version_difference = names.lookup("version_difference", values["version_difference"],
                                    policies.VERSION_DIFFERENCES)
  if policy.predicts and M > 1 and version_difference == "paper":
    raise ValueError(
        "version_difference='paper' counts one update per batch (the SpecTrain paper eq. 5-6); "
        f"with micro_batches={M} use version_difference='exact'")
  spike, delay_momentum = values["spike_compensation"], asked.delay_momentum
  for name, value in (("spike_compensation", spike), ("delay_momentum", delay_momentum)):
    if value not in (True, False):
      raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
  rescheduling = asked.lr_rescheduling
  if rescheduling is None:
    rescheduling = mitigations.DEFAULT_LR_RESCHEDULING if policy.corrects else 0
  if not isinstance(rescheduling, int) or isinstance(rescheduling, bool) or rescheduling < 0:
    raise ValueError("`lr_rescheduling` must be a number of updates >= 0. Received: "
                     f"lr_rescheduling={rescheduling!r}")
  decay = asked.discrepancy_decay
  if decay is not None and not policy.corrects:
    raise ValueError("`discrepancy_decay` is PipeMare's discrepancy correction (method="
                     f"'pipemare'). Received: method={policy.method!r}")
  if decay is None:
    decay = mitigations.DEFAULT_DISCREPANCY_DECAY
  if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0 <= decay < 1:
    raise ValueError(f"`discrepancy_decay` must be in [0, 1). Received: discrepancy_decay={decay!r}")
  nesterov, compensation = values["nesterov"], values["delay_compensation"]
  if nesterov not in (True, False):
    raise ValueError(f"`nesterov` must be True or False. Received: nesterov={nesterov!r}")
  if nesterov and spike:
    raise ValueError("`nesterov` and `spike_compensation` both rewrite the momentum step "
                     "(Nesterov's is spike compensation's at a delay of 1): choose one")
  if (not isinstance(compensation, (int, float)) or isinstance(compensation, bool)
      or not 0 <= compensation < float("inf")):
    raise ValueError("`delay_compensation` is DC-ASGD's lambda, a number >= 0 (0: off). "
                     f"Received: delay_compensation={compensation!r}")
  if compensation and tasks.op(policy, "B").reads != "kept":
    raise ValueError(
        f"`delay_compensation` moves a gradient from the weights it was taken at to the "
        f"current ones, and method {policy.method!r} takes it at the current weights (it "
        "recomputes): use a method whose backward reads its forward's weights (pipedream, "
        "2bw, spectrain, ddg)")
  return {"version_difference": version_difference, "spike_compensation": spike,
          "delay_momentum": delay_momentum, "lr_rescheduling": rescheduling,
          "discrepancy_decay": float(decay), "nesterov": nesterov,
          "delay_compensation": float(compensation)}


def _check_batch_statistics(model, batch_statistics, M):
  """BatchNormalization with micro-batches normalises each micro-batch by its own statistics
  (as GPipe does), where Keras uses the mini-batch's: "warn" (default) says so, "refuse"
  refuses, "micro_batch" accepts it silently."""
  choice = names.lookup("batch_statistics", batch_statistics, ("warn", "refuse", "micro_batch"))
  found = advice.batch_norm_layers(model)
  if M == 1 or not found or choice == "micro_batch":
    return
  message = (f"BatchNormalization ({', '.join(found)}) with micro_batches={M} normalises per "
             "micro-batch (as GPipe does), not over the mini-batch as Keras does: training "
             "differs from Keras's. Pass batch_statistics='micro_batch' to accept it, or "
             "micro_batches=1")
  if choice == "refuse":
    raise ValueError(message)
  warnings.warn(message, UserWarning, stacklevel=5)
