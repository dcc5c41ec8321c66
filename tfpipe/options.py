"""A Pipeline's training options, checked when it is built (`tfpipe.Pipeline`'s arguments).

Bad values are refused here with the option's name and value, before any
TensorFlow work; what the options mean is documented on `tfpipe.Pipeline`.
"""

import warnings

from tfpipe import advice, mitigations, runtime
from tfpipe.instruments import prediction_error as prediction_error_lib, trace
from tfpipe.plan import names, policies, tasks

__all__ = ["Options"]


class Options:
  """The method's weight policy and micro-batches, its mitigations, the executor and the
  instruments, as a `tfpipe.Pipeline` was asked for them."""

  def __init__(self, model, method="spectrain", spectrain_backward="reuse",
               version_difference=None, micro_batches=None, recompute=None, lockstep=False,
               record=False, trace_steps=None, trace_dir=None, prediction_error=None,
               executor=None, spike_compensation=None, delay_momentum=False,
               lr_rescheduling=None, discrepancy_decay=None, batch_statistics="warn",
               virtual_stages=None, nesterov=None, delay_compensation=None):
    self.policy = policies.policy_for(method, spectrain_backward, recompute, lockstep,
                                      virtual_stages)
    self.method = self.policy.method
    self._micro_batches_asked, self._batch_statistics = micro_batches, batch_statistics
    self.micro_batches = policies.micro_batches_for(self.policy, micro_batches)
    asked = {"version_difference": version_difference, "spike_compensation": spike_compensation,
             "nesterov": nesterov, "delay_compensation": delay_compensation}
    # Left None: advised for the optimizer at compile (`tfpipe.advice`); until then the plain
    # method's values.
    self._unset = [n for n, v in asked.items() if v is None]
    self.advised, self._advice_done, self._family = {}, False, None
    self._batch_norm = advice.batch_norm_layers(model)
    self._plain_micro_batches = self.micro_batches   # M when `tfpipe.advice` sets none
    values = dict(asked, **{n: advice.ADVISABLE[n] for n in self._unset})
    if "version_difference" in self._unset and self.policy.predicts and self.micro_batches > 1:
      values["version_difference"] = "exact"   # the one that counts micro-batch updates
    self._set_options(values["version_difference"], values["spike_compensation"],
                      delay_momentum, lr_rescheduling, discrepancy_decay, values["nesterov"],
                      values["delay_compensation"])
    self._check_batch_statistics(model, batch_statistics)
    self.trace_steps = trace.parse_steps(trace_steps)
    if self.trace_steps is not None and not trace_dir:
      raise ValueError(f"`trace_steps={trace_steps!r}` needs a `trace_dir` to write the trace to")
    self.trace_dir = trace_dir
    self.record = bool(record) or self.trace_steps is not None
    self.executor = names.lookup("executor", executor or "compiled", runtime.EXECUTORS)
    if prediction_error is True:
      prediction_error = prediction_error_lib.PredictionError()
    if prediction_error not in (None, False) and not isinstance(
        prediction_error, prediction_error_lib.PredictionError):
      raise ValueError("`prediction_error` must be True or a tfpipe.instruments.prediction_error."
                       f"PredictionError. Received: {prediction_error!r}")
    self.prediction_error = prediction_error or None

  def _set_options(self, version_difference, spike_compensation, delay_momentum,
                   lr_rescheduling, discrepancy_decay, nesterov, delay_compensation):
    self.version_difference = names.lookup(
        "version_difference", version_difference, policies.VERSION_DIFFERENCES)
    if self.policy.predicts and self.micro_batches > 1 and self.version_difference == "paper":
      raise ValueError(
          "version_difference='paper' counts one update per batch (seed 000 eq. 5-6); with "
          f"micro_batches={self.micro_batches} use version_difference='exact'")
    self._set_mitigations(spike_compensation, delay_momentum, lr_rescheduling, discrepancy_decay)
    self._set_updates(nesterov, delay_compensation)

  def advise(self, optimizer, num_stages, delayed):
    """Sets the options left None to what `tfpipe.advice` says for `optimizer` at `num_stages`
    stages (at compile), each only where it can act (`delayed`: some stage has a delay; an
    optimizer its rule is written for; not beside a user's option that excludes it)."""
    self._family = advice.family(optimizer)
    self.advised = ({"micro_batches": self.micro_batches}
                    if self.micro_batches != self._plain_micro_batches else {})
    if not self._unset:
      return
    given = {"spike_compensation": self.spike_compensation, "nesterov": self.nesterov,
             "version_difference": (None if "version_difference" in self._unset
                                    else self.version_difference)}
    values = advice.resolve(self.policy, self.micro_batches, num_stages, optimizer, self._unset,
                            delayed, given)
    current = {"version_difference": self.version_difference,
               "spike_compensation": self.spike_compensation, "nesterov": self.nesterov,
               "delay_compensation": self.delay_compensation}
    current.update(values)
    self._set_options(current["version_difference"], current["spike_compensation"],
                      self.delay_momentum, self._asked_rescheduling, self._asked_decay,
                      current["nesterov"], current["delay_compensation"])
    self.advised.update({n: v for n, v in values.items() if v != advice.ADVISABLE[n]})
    self._advice_done = True

  def advise_micro_batches(self, optimizer, num_stages):
    """M = K or 2K where `tfpipe.advice` says so for `optimizer` at `num_stages` stages and the user
    left `micro_batches` None, unless something the user chose excludes it (version_difference
    "paper", which counts one update per batch; BatchNormalization, whose statistics would
    change, unless batch_statistics="micro_batch"); else the plain default."""
    M = advice.micro_batches(
        self.method, optimizer, num_stages, self._micro_batches_asked,
        None if "version_difference" in self._unset else self.version_difference,
        self._batch_norm and self._batch_statistics != "micro_batch")
    self.micro_batches = M or self._plain_micro_batches

  def micro_batch_hint(self):
    """For errors about batches too small for M: where M was advised, how to opt out."""
    if not self.advised.get("micro_batches"):
      return ""
    return (f" (micro_batches={self.micro_batches} was advised for {self._family} by "
            "tfpipe.advice: pass micro_batches=1 to the Pipeline to train on whole batches)")

  def _set_mitigations(self, spike_compensation, delay_momentum, lr_rescheduling,
                       discrepancy_decay):
    self._asked_rescheduling, self._asked_decay = lr_rescheduling, discrepancy_decay
    for name, value in (("spike_compensation", spike_compensation),
                        ("delay_momentum", delay_momentum)):
      if value not in (True, False):
        raise ValueError(f"`{name}` must be True or False. Received: {name}={value!r}")
    self._default_rescheduling = lr_rescheduling is None and self.method == "pipemare"
    if lr_rescheduling is None:
      lr_rescheduling = mitigations.DEFAULT_LR_RESCHEDULING if self.method == "pipemare" else 0
    if (not isinstance(lr_rescheduling, int) or isinstance(lr_rescheduling, bool)
        or lr_rescheduling < 0):
      raise ValueError("`lr_rescheduling` must be a number of updates >= 0. Received: "
                       f"lr_rescheduling={lr_rescheduling!r}")
    if discrepancy_decay is not None and self.method != "pipemare":
      raise ValueError("`discrepancy_decay` is PipeMare's discrepancy correction (method="
                       f"'pipemare'). Received: method={self.method!r}")
    if discrepancy_decay is None:
      discrepancy_decay = mitigations.DEFAULT_DISCREPANCY_DECAY
    if (not isinstance(discrepancy_decay, (int, float)) or isinstance(discrepancy_decay, bool)
        or not 0 <= discrepancy_decay < 1):
      raise ValueError("`discrepancy_decay` must be in [0, 1). Received: "
                       f"discrepancy_decay={discrepancy_decay!r}")
    self.spike_compensation, self.delay_momentum = spike_compensation, delay_momentum
    self.lr_rescheduling, self.discrepancy_decay = lr_rescheduling, float(discrepancy_decay)

  def _set_updates(self, nesterov, delay_compensation):
    if nesterov not in (True, False):
      raise ValueError(f"`nesterov` must be True or False. Received: nesterov={nesterov!r}")
    if nesterov and self.spike_compensation:
      raise ValueError("`nesterov` and `spike_compensation` both rewrite the momentum step "
                       "(Nesterov's is spike compensation's at a delay of 1): choose one")
    if (not isinstance(delay_compensation, (int, float)) or isinstance(delay_compensation, bool)
        or not 0 <= delay_compensation < float("inf")):
      raise ValueError("`delay_compensation` is DC-ASGD's lambda, a number >= 0 (0: off). "
                       f"Received: delay_compensation={delay_compensation!r}")
    if delay_compensation and tasks.op(self.policy, "B").reads != "kept":
      raise ValueError(
          f"`delay_compensation` moves a gradient from the weights it was taken at to the "
          f"current ones, and method {self.method!r} takes it at the current weights (it "
          "recomputes): use a method whose backward reads its forward's weights (pipedream, "
          "2bw, spectrain, ddg)")
    self.nesterov, self.delay_compensation = nesterov, float(delay_compensation)

  def set_stages(self, model, num_stages):
    """Checks M against K once K is known ("2bw" takes its default M from it)."""
    M = policies.micro_batches_for(self.policy, self._micro_batches_asked, num_stages)
    if M != self.micro_batches:
      self.micro_batches = M
      self._check_batch_statistics(model, self._batch_statistics)
    self._plain_micro_batches = M

  def _check_batch_statistics(self, model, batch_statistics):
    """BatchNormalization with micro-batches normalises each micro-batch by its own statistics
    (as GPipe does), where Keras uses the mini-batch's: "warn" (default) says so, "refuse"
    refuses, "micro_batch" accepts it silently."""
    choice = names.lookup("batch_statistics", batch_statistics, ("warn", "refuse", "micro_batch"))
    found = advice.batch_norm_layers(model)
    if self.micro_batches == 1 or not found or choice == "micro_batch":
      return
    message = (f"BatchNormalization ({', '.join(found)}) with micro_batches={self.micro_batches} "
               "normalises per micro-batch (as GPipe does), not over the mini-batch as Keras "
               "does: training differs from Keras's. Pass batch_statistics='micro_batch' to "
               "accept it, or micro_batches=1")
    if choice == "refuse":
      raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=4)

  def update_options(self):
    """The options in force that change a stage's update: [(name, value)]."""
    return [(n, v) for n, v in (("spike_compensation", self.spike_compensation),
                                ("delay_momentum", self.delay_momentum),
                                ("lr_rescheduling", self.lr_rescheduling),
                                ("nesterov", self.nesterov),
                                ("delay_compensation", self.delay_compensation)) if v]

  def stage_rules(self, optimizer, num_stages):
    """Per stage: the delay D_k of the schedule and the `mitigations.StageRule` of its updates;
    refuses options that cannot act (no delay, an optimizer their rule is not written for)."""
    self.advise_micro_batches(optimizer, num_stages)
    delays = mitigations.delays_for(self.policy.schedule, num_stages, self.micro_batches,
                                    self.policy.virtual_stages)
    self.advise(optimizer, num_stages, any(delays))
    if self._default_rescheduling:   # pipemare's default: on where its rule is written
      try:
        mitigations.check_optimizer(optimizer, "lr_rescheduling")
        self.lr_rescheduling = mitigations.DEFAULT_LR_RESCHEDULING
      except ValueError:
        self.lr_rescheduling = 0
    chosen = [n for n, _ in self.update_options()]
    for name in chosen:
      if name != "delay_compensation":   # a gradient's correction: any optimizer
        mitigations.check_optimizer(optimizer, name)
    if chosen and not any(delays):
      raise ValueError(f"{chosen[0]} acts on delayed updates, and method {self.method!r} at "
                       f"{num_stages} stages delays none")
    decay = self.discrepancy_decay if self.method == "pipemare" else None
    return delays, [mitigations.StageRule(d, self.spike_compensation, self.lr_rescheduling, decay,
                                          self.nesterov, self.delay_compensation)
                    for d in delays]

  def describe(self, num_stages):
    """The summary's first line: method, stages, micro-batches and update options in force."""
    micro = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
    on = [n if v is True else f"{n}={v}" for n, v in self.update_options()]
    on += [f"discrepancy_decay={self.discrepancy_decay}"] if self.method == "pipemare" else []
    micro += f", {', '.join(on)}" if on else ""
    if self.advised:
      micro += (f" ({', '.join(sorted(self.advised))} advised for {self._family}: "
                "tfpipe.advice)")
    elif self._advice_done and self._family and self.method == "spectrain":
      micro += f" (no option advised for {self._family}: tfpipe.advice)"
    elif self._unset and self.method == "spectrain" and not self._advice_done:
      micro += " (options left unset: advised for the optimizer at compile)"
    return f"tfpipe.Pipeline: method={self.method}, {num_stages} stages{micro}"
