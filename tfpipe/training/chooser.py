"""`Pipeline(method="auto")` as one object: `Chooser` holds the user's options, the probe
training first (`tfpipe.training.probe`), the choice (`tfpipe.training.auto`) and the
hand-over; `Pipeline` keeps it as `pipe.auto`, and the fit loop sees only a `watch` of its
batches and a hand-over at a window's end.
"""

import dataclasses
from typing import Any, Optional, Tuple

import tensorflow as tf

from tfpipe.plan import auto as auto_plan
from tfpipe.training import assemble
from tfpipe.training import auto as auto_lib, fit_data, options as options_lib, probe as probe_lib

__all__ = ["Chooser", "asked_for", "refuse_chosen_options"]


def asked_for(asked, candidate: auto_plan.Candidate):
  """The `Asked` options that run `candidate` (the user's others kept)."""
  options = dict(candidate.options)
  if options.pop("advice", False):
    return dataclasses.replace(asked, method=candidate.method, micro_batches=None,
                               advice=True, **options)
  return dataclasses.replace(asked, method=candidate.method,
                             micro_batches=candidate.micro_batches, **options)


def refuse_chosen_options(asked) -> Tuple[str, ...]:
  """The options `method="auto"` chooses that the user set (it refuses them)."""
  return tuple(n for n in ("micro_batches", "virtual_stages", "nesterov", "version_difference")
               if getattr(asked, n) is not None) + (("advice",) if asked.advice else ())


class Chooser:
  """`method="auto"` as one object: the user's options (`asked`, the method left to it), the
  probe training first (`probe`), the choice (`chosen`) and its hand-over of the pipeline's
  options and executor. `Pipeline` builds the probe's pipeline (`probe_options`) and calls
  `before_fit` at each fit's start and `after_fit` at its end; between them the fit loop
  times the probe through `watch()` and hands the rest of the fit over at its verdict."""

  def __init__(self, asked: options_lib.Asked):
    refused = refuse_chosen_options(asked)
    if refused:
      raise ValueError(f"method='auto' chooses {', '.join(refused)}: leave "
                       f"{'it' if len(refused) == 1 else 'them'} unset, or name a method")
    self.asked = asked
    self.chosen: Optional[auto_lib.Choice] = None
    self.probe: Optional[probe_lib.Probe] = None
    self.verbose: Any = 0   # the fit's verbosity (what a hand-over prints)

  @property
  def probe_options(self) -> options_lib.Asked:
    """The options the pipeline is built with until the choice: `PROBE`'s."""
    return dataclasses.replace(self.asked, **probe_lib.PROBE)

  @property
  def choosing(self) -> bool:
    """Whether the choice is yet to be made (at the first fit)."""
    return self.chosen is None

  def before_fit(self, pipe, x, y, batch_size, steps, sample_weight, class_weight, verbose,
                 epochs: int) -> None:
    """At a fit's start, before the first choice: where the probe trains first
    (`trains_first`) sets up its timing (`Probe`, read by the fit loop through `watch`); else
    profiles the first batch, chooses, and hands `pipe` over to the choice on the probe's
    stage programs where their tasks and updates are the choice's (`assemble.adopt`: every
    synchronous schedule that keeps 1f1b's table rows, at any M): no second compile, and the
    accumulators and the update the profile traced (on one stage) are training's; else
    builds them again, compiled as the user compiled. Measured (`bench/time_to_accuracy.py`'s
    12-layer transformer, "counting", K=4, pairs of processes): the first epoch after the
    profile 4.54-4.87 s compiled again, 4.02-4.19 s on the probe's programs. (Training's
    windows calling the forwards the profile traced, for a batch of any size, started 0.2 s
    sooner still but ran their epochs 2-12% slower than forwards traced for the
    micro-batch: not kept.)"""
    self.verbose = verbose
    if not self.choosing:
      return
    dataset, num_batches = fit_data.dataset(pipe, x, y, batch_size, steps,
                                            sample_weight=sample_weight,
                                            class_weight=class_weight)
    first = next(iter(dataset))
    features, labels = first[0], first[1]
    size = int(tf.nest.flatten(features)[0].shape[0])
    last = fit_data.last_batch(pipe, x, batch_size, steps)
    if probe_lib.trains_first(pipe, size, last):
      self.probe = probe_lib.Probe(features, labels, size, last)
      if verbose != 0:
        M = probe_lib.PROBE["micro_batches"]
        print(f"method='auto' trains its probe, {probe_lib.PROBE['method']} M={M} (micro-"
              f"batches of {size // M}), from the first batch and times it; it profiles the "
              "candidates only where the rest of the fit can pay for it")
      return
    self.chosen = auto_lib.choose(pipe, features, labels, size, num_batches or 16,
                                  max(epochs, 1))
    self._hand_over(pipe)
    if verbose != 0:
      print(self.chosen.summary())

  def watch(self) -> Optional["Chooser"]:
    """What the fit loop times while the probe trains first (None otherwise): its hooks
    `epoch_begins`, `result`, `due` and `hand_over`."""
    return self if self.probe is not None else None

  def epoch_begins(self, num_batches: int, window: int) -> None:
    """An epoch of `num_batches` mini-batches starts, in the executor's windows of `window`."""
    if self.probe is not None:
      self.probe.epoch_begins(num_batches, window)

  def result(self, b: int, rest: int) -> bool:
    """Mini-batch b of the epoch finished, `rest` left in the fit: True where the epoch stops
    here for the profile (`Probe.result`)."""
    return (self.probe is not None and self.probe.verdict is None
            and self.probe.result(b, rest))

  @property
  def due(self) -> bool:
    """Whether the probe has its verdict and the hand-over is due."""
    return self.probe is not None and self.probe.verdict is not None

  def hand_over(self, pipe, trained: int, rest: int, num_batches: int = 16) -> Tuple[bool, bool]:
    """At the probe's verdict (`trained` mini-batches into the fit, `rest` left): keeps the probe,
    or profiles (`tfpipe.training.auto.choose`, the rest of the fit weighed) and hands the rest
    to the choice on the probe's stage programs (`assemble.adopt`: the same tasks, so the same
    updates as Keras's from here on, the optimizers' state kept; the new executor continues the
    old one's counts). Returns (whether the executor changed, whether the epoch goes on from
    where it stopped for the profile)."""
    probe = self.probe
    self.probe = None
    if probe.verdict != "profile":
      self.chosen = auto_lib.kept_probe(probe, max(rest // max(num_batches, 1), 1))
    else:
      epochs = max(-(-rest // max(num_batches, 1)), 1)
      for program in pipe.programs:   # the weights so far: what the profile puts back
        program.write_to_model()
      chosen = auto_lib.choose(pipe, probe.features, probe.labels, probe.batch_size,
                               num_batches, epochs, samples=rest * probe.batch_size,
                               trained=probe_lib.probe_candidate(), last_batch=probe.last_batch)
      self.chosen = dataclasses.replace(chosen, after=trained)
    if self.verbose != 0:
      print(self.chosen.summary())
    changed = self._hand_over(pipe, before=pipe.runtime)
    return changed, probe.verdict == "profile"

  def after_fit(self, pipe, num_batches: int) -> None:
    """At a fit's end: the probe, still training first without a verdict, is kept."""
    if self.probe is not None:
      self.hand_over(pipe, 0, 0, num_batches)

  def _hand_over(self, pipe, before=None) -> bool:
    """`pipe` takes the choice's options; its executor runs them on the probe's stage
    programs where their tasks are the choice's (`assemble.adopt`), else (before training
    only) it is compiled again. `before`: the executor that trained so far, whose counts the
    new one continues (the same policy and M: kept). Returns whether the executor changed."""
    pipe.asked = asked_for(self.asked, self.chosen.candidate)
    checked = options_lib.checked(pipe.asked, pipe.model, pipe.num_stages)
    options, _, rules = options_lib.resolved(checked, pipe.asked, pipe.model,
                                             pipe.inner_optimizer, pipe.num_stages)
    if (before is not None and options.policy == pipe.options.policy
        and options.micro_batches == pipe.micro_batches):
      return False
    if assemble.adopt(pipe.programs, options.policy, rules):
      pipe.options = options
      pipe.runtime = assemble.executor(pipe, pipe.programs, pipe.AUTO_WINDOW)
      if before is not None:
        pipe.runtime.take_over(before)
      return True
    if before is not None:
      raise AssertionError(f"{self.chosen.name} cannot take over the probe's stage programs")
    pipe.options = checked
    pipe.recompile()
    return True
