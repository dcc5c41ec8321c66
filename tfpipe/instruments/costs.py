"""Costs: a short profile of a compiled pipeline's stages, for the simulator to predict from.

`measure(pipe, x, y)` times each stage's tasks alone on its device at the method's
micro-batch size (its forward, its backward, the last stage's step, an update, a transfer
to the next device), traced the way the executor runs them (inline, optimised as an inlined
window is, or as calls of the stage's functions, a kept forward's gradient taken across its
call), with the forwards a backward recomputes where its forward ran in an earlier window,
the dispatch every task call pays whatever its size, and how many cores the stages' devices
share, and returns them as `tfpipe.plan.simulator.Costs` (seconds per mini-batch). `tfpipe.plan.simulator.simulate_method` then plays any schedule
out on them: `predict(costs, method, ...)` is the samples/s it predicts for a method on the
same stages without running it. The profile takes a few seconds (a trace per task); what
its updates change is put back (the weights from the model, the optimizers' steps and slots,
the accumulators), so a pipeline trains after it as before it.
"""

import concurrent.futures
import os
import time
from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfpipe import compat
from tfpipe.plan import policies, simulator

__all__ = ["measure", "predict", "shared_cores", "dispatch_seconds", "median_seconds",
           "start_seconds"]


def median_seconds(fn, repeats, untimed=2, quantile=0.5):
  """The median seconds of `repeats` calls of `fn` (its outputs read back), after `untimed`
  calls (by default one that traces it and one that warms it); `quantile`: that quantile
  of the calls' seconds instead."""
  for _ in range(untimed):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, fn())
    times.append(time.perf_counter() - start)
  return float(np.quantile(times, quantile))


# The works run at once are timed at the fastest quarter of TOGETHER_REPEATS calls (at
# least), after as many untimed: a graph's calls run either with both cores busy or in a
# slow op order, call by call, so the full profile takes the higher of two readings (the
# stages in one graph, and their graphs called at once from threads), since either only errs
# low (bench/results/history.md, the profile's cores).
TOGETHER_QUANTILE = 0.25
TOGETHER_REPEATS = 12


class _Runs:
  """`runs_per_call` runs of each `(body, inputs, device)` of `works` traced into one graph (the
  way a window traces a stage's tasks inline): the works run at once, each on its device.
  Each run takes its inputs scaled by its own factor, so no two runs are the same
  computation for the graph optimiser to merge; `chained`, each reads the run before it (a
  vanishing multiple of its outputs' mean), so no two runs of a work overlap (else they may,
  as a graph's micro-batches do). Traced when made; with `pool` (an executor), its first
  call (where TensorFlow optimises the graph and makes its kernels, outside Python's lock)
  starts there at once, alongside whatever Python traces next."""

  def __init__(self, works, runs_per_call=4, chained=True, pool=None, relaxed=False,
               light=None):
    self.runs_per_call = runs_per_call
    self.light = light   # None, or called as the executor calls an inlined window (its layout)

    @tf.function(autograph=False)   # as the executor traces (AutoGraph: a second a task)
    def runs(*flat):
      with compat.constant_exponents():   # as the compiled executor traces its windows
        return _runs(flat)

    def _runs(flat):
      outs, at = [], 0
      for body, inputs, device in works:
        # Traced once and called per run: the graph optimiser inlines the calls (the same
        # graph), the runs after the first add no trace (measured: a third of a profile).
        body = compat.own_function(body, autograph=False)
        xs, at, out = flat[at:at + len(inputs)], at + len(inputs), []
        with tf.device(device):
          for i in range(runs_per_call):
            last = [tf.reduce_mean(tf.cast(t, tf.float32)) for t in tf.nest.flatten(out)
                    if chained and t is not None and t.dtype.is_floating]
            factor = 1.0 + 1e-3 * i + (1e-30 * tf.add_n(last) if last else 0.0)
            out = body([x * tf.cast(factor, x.dtype) if x.dtype.is_floating else x
                        for x in xs])
            outs.append(out)   # every run's outputs, so none is pruned
      return outs
    flat = [x for _, inputs, _ in works for x in inputs]
    # `relaxed`: traced for inputs of any batch size (`use` then feeds other sizes, no trace).
    specs = [tf.TensorSpec([None] + list(x.shape[1:]) if relaxed and x.shape.rank else x.shape,
                           x.dtype) for x in flat]
    start = time.perf_counter()
    self._concrete = runs.get_concrete_function(*specs)
    self.trace_seconds = time.perf_counter() - start
    self.first_seconds = None   # its first call's (TensorFlow optimises the graph then)
    self.use(flat)
    self._first = pool.submit(self.first_call) if pool is not None else None
    self.call_seconds = None   # a call's median seconds, once timed

  def use(self, flat):
    """Calls run on the inputs `flat` from now on (of the traced shapes, any batch size when
    relaxed)."""
    self.inputs = flat

  def call(self):
    """One call of the traced runs on the inputs in use (with `light`, under the lighter
    Grappler the executor's inlined windows run under: `compat.light_calls`)."""
    if self.light is None:
      return self._concrete(*self.inputs)
    with compat.light_calls(layout=self.light):
      return self._concrete(*self.inputs)

  def first_call(self):
    """The first call, timed (`first_seconds`)."""
    start = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, self.call())
    self.first_seconds = time.perf_counter() - start

  def wait(self):
    """Until the first call started on the pool (if any) has ended."""
    if self._first is not None:
      self._first.result()

  def seconds(self, repeats, less=0.0, quantile=0.5, warm=1):
    """Per run: the median (or `quantile`) of `repeats` timed calls, less `less` (a call's
    dispatch) each, after its first call (timed apart: `first_seconds`) and `warm` calls."""
    self.wait()
    if self.first_seconds is None:
      self.first_call()
    self.call_seconds = median_seconds(self.call, repeats, untimed=warm, quantile=quantile)
    return max(self.call_seconds - less, 0.1 * self.call_seconds) / self.runs_per_call


def _in_graph(works, repeats, runs_per_call=4, chained=True, less=0.0):
  """Seconds per run of `_Runs(works, runs_per_call, chained)`, its calls' fastest quarter
  (`TOGETHER_QUANTILE`): what the tasks compute at once, without a call."""
  repeats = max(repeats, TOGETHER_REPEATS)
  return _Runs(works, runs_per_call, chained).seconds(repeats, less, TOGETHER_QUANTILE, repeats)


def _at_once(runs, repeats):
  """The seconds the timed `_Runs` take called at once, each from a thread of its own (no
  trace: each call runs on its device, and TensorFlow runs calls from several threads side
  by side), the calls' fastest quarter (`TOGETHER_QUANTILE`); against the sum of their
  `call_seconds`, how much of their work the cores do at once."""
  def read(made):
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, made.call())
  together = []
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    for _ in range(max(repeats, TOGETHER_REPEATS)):
      start = time.perf_counter()
      list(pool.map(read, runs))
      together.append(time.perf_counter() - start)
  return float(np.quantile(together, TOGETHER_QUANTILE))


def shared_cores(devices) -> Optional[int]:
  """How many of `devices` can compute at once when every one is a logical CPU of this
  process: the cores this process may use over the intra-op threads an op takes, at most
  one per device; None for other devices (each computes on its own)."""
  specs = [tf.DeviceSpec.from_string(d) for d in devices]
  if any(s.device_type != "CPU" or s.job not in (None, "localhost") for s in specs):
    return None
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  threads = tf.config.threading.get_intra_op_parallelism_threads() or cores
  return max(1, min((cores or 1) // threads, len(set(devices))))


def dispatch_seconds(device, repeats=50) -> float:
  """Seconds a call of a traced function costs on `device` when it computes nothing."""
  with tf.device(device):
    value = tf.zeros([1])
  call = tf.function(lambda t: t + 1.0, autograph=False)
  with tf.device(device):
    return median_seconds(lambda: call(value), repeats)


def _outputs(program, xs, n, traced):
  """Stage `program`'s outputs on `xs` (micro-batches of `n` samples), the next stage's
  inputs: with `traced`, the first rows of the outputs kept from a larger micro-batch where
  every output has one row per sample (the stages' forwards are per sample; the values only
  feed timed runs), else the stage's inference run now, eagerly, and kept: no trace (a
  profile traced each stage's forward and weight read for these values, 10-15% of the
  profile of an MLP at K=4)."""
  key = ("outputs", program.index)
  if traced is not None and key in traced:
    rows, kept = traced[key]
    if rows >= n and all(t.shape.rank and t.shape[0] == rows for t in kept):
      return [t[:n] for t in kept]
  ys = program.task("infer", inline=True)(xs)
  if traced is not None:
    traced[key] = (n, ys)
  return ys


def measure(pipe, x, y, micro_batches: Optional[int] = None, inline: Optional[bool] = None,
            repeats: int = 5, num_batches: int = 16, runs_per_call: int = 4,
            quick: bool = False, update: Optional[float] = None,
            cores: Optional[float] = None, method: Optional[str] = None,
            stages: Optional[Sequence[int]] = None,
            traced: Optional[dict] = None) -> simulator.Costs:
  """Each stage's costs per mini-batch on `pipe` (compiled) with the mini-batch `x`, `y` (arrays,
  tensors or a dict of them; a mini-batch of the size `fit` will take), measured at the micro-batch
  size of `micro_batches` (default: the method's M). `inline`: whether the executor traces the
  tasks into its graphs (None: as `pipe`'s executor would for its method over `num_batches`
  mini-batches); else the tasks are timed as calls of the stage's traced functions and each pays a
  call besides (`dispatch_seconds`). A stage's backward is its forward and backward less its
  forward, plus the share of its forward it recomputes when that forward ran in an earlier window
  (the executor's `crossing`); the last stage's step is split as 1/3 forward, 2/3 backward (the
  simulator runs the two as one step there). Where the devices share the cores (`shared_cores`),
  the stages' work is also run all at once: `Costs.cores` is the work alone over the time together
  (at most the cores; not quick, the higher of the stages run in one graph and their graphs called
  from threads). `repeats` timed calls of `runs_per_call` runs each, per task. `quick` (a trace per
  stage rather than three): a forward is taken as a third of forward and backward, and moving a
  tensor between two logical CPUs as free; `update`: an update's seconds, known (else timed, with
  micro-batches); `cores`: `Costs.cores`, known (else measured); `method`: the method whose epoch
  decides `inline` and the recomputed forwards (default: `pipe`'s; the tasks timed are `pipe`'s).
  Quick, every task is traced before any is timed, each graph's first call (its optimisation)
  running on a thread beside the next trace; each timed call's dispatch is taken off its seconds;
  and the stages' work together is timed by calling their traced runs at once, each from its own
  thread (no trace more). `stages`: the stages timed (default: all); the others' times are 0, and
  neither the cores nor the transfers are timed then. `traced` (a dict, quick only): the tasks
  traced for a batch of any size and kept there, so a later call at another micro-batch size traces
  none (each stage's tasks traced once for every M; with accumulators at M = 1 too, whose update is
  then timed apart: a backward's seconds hold the accumulation, not the update); and each stage's
  outputs, whose first rows feed the next stage at a smaller micro-batch. Quick, the update is
  timed on one stage, the one of the median weights."""
  if getattr(pipe, "programs", None) is None:
    raise RuntimeError("call `compile(optimizer, loss)` before measuring the costs")
  M = micro_batches or pipe.micro_batches
  xs, labels, n = _micro_batch(pipe, x, y, M)
  if method is None:
    schedule = policies.build_schedule(pipe.policy, pipe.num_stages, num_batches, M)
    diffs = policies.version_differences(pipe.policy, schedule,
                                         pipe.options.version_difference)
  else:
    schedule, diffs = policies.epoch(method, pipe.num_stages, num_batches, M)
  if inline is None:
    inline = pipe.runtime.inlines(schedule, diffs, num_batches)
  crossing = pipe.runtime.crossing(schedule, diffs, num_batches)
  if traced is not None and not quick:
    raise ValueError("`traced` keeps a quick profile's tasks: pass quick=True with it")
  per_task, less = _dispatch(pipe, quick, traced, inline, repeats)
  timed = set(range(pipe.num_stages) if stages is None else stages)
  for program in pipe.programs[:max(timed) + 1]:
    # With accumulators (M > 1) a backward adds its gradients and an update applies them;
    # without, the backward updates (and the update costs nothing apart).
    if M > 1 or traced is not None:   # built at the first fit otherwise
      program.updates.build_accumulators()
  # What the profile's updates change, put back after it (with the weights, from the model).
  before = [v.numpy() for v in _updated_state(pipe)]
  profile = _Profile(pipe, inline, quick, traced, runs_per_call, labels, M)
  try:
    profile.trace(xs, n, timed, update is None, stages is None)
    seconds = profile.seconds(repeats, less)
  finally:
    profile.close()
  forward, backward, transfer, updates = _split(profile.pending, seconds, crossing, M,
                                                pipe.num_stages)
  most = shared_cores(pipe.devices)
  if cores is None and most is not None and stages is None:
    cores = _cores(profile, seconds, most, repeats, runs_per_call)
  for program in pipe.programs:   # undo the profile's updates
    program.load_from_model()
  for v, value in zip(_updated_state(pipe), before):
    v.assign(value)
  if update is None:
    update = float(np.median(updates)) if updates else 0.0
  # A split backward's halves (zero-bubble B and W): traced into the compiled executor's
  # windows (without XLA) B takes both gradients, from the tape or the residuals, and W
  # applies them (`StageProgram.forward`'s `split`), so B holds the whole backward.
  whole = pipe.runtime.windowed and not pipe.jit_compile
  return simulator.Costs(forward, backward, transfer, update, input_share=1.0 if whole else 0.5,
                         per_task=per_task, cores=cores, ordered=not inline)


def _cores(profile, seconds, most, repeats, runs_per_call):
  """How much of the stages' work the `most` cores they share do at once: quick, their runs
  called at once from threads; else the higher of that and the stages in one graph (each
  reading errs low only: TOGETHER_QUANTILE's comment)."""
  stage_runs = [t.get("step", t.get("fb")) for _, t in profile.pending]
  ratio = sum(r.call_seconds for r in stage_runs) / _at_once(stage_runs, repeats)
  if not profile.quick:
    alone = sum(t.get("step", t.get("fb")) for t in seconds)
    ratio = max(ratio, alone / _in_graph(profile.works, repeats, runs_per_call, chained=False))
  return min(float(most), max(1.0, ratio))


def _micro_batch(pipe, x, y, M):
  """(inputs, (labels, None), n): the first micro-batch (n samples) of the mini-batch `x`,
  `y` at M micro-batches."""
  if isinstance(x, dict):   # the model's inputs in its order, as `fit` feeds them
    x = [x[name] for name in (t.name for t in pipe.model.inputs)]
  flat = tf.nest.flatten(x)
  n = int(np.shape(flat[0])[0]) // M
  if n < 1:
    raise ValueError(f"a mini-batch of {int(np.shape(flat[0])[0])} samples cannot be cut "
                     f"into {M} micro-batches")
  xs = [tf.convert_to_tensor(t[:n]) for t in flat]
  labels = (tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[:n], y), None)
  return xs, labels, n


def _dispatch(pipe, quick, traced, inline, repeats):
  """(what a task call pays besides its work, what is taken off each timed call): quick,
  one call's dispatch (kept in `traced`) for both; else the least call on a stage's device,
  and nothing taken off."""
  if quick:
    kept = traced if traced is not None else {}
    if "dispatch" not in kept:
      kept["dispatch"] = dispatch_seconds(pipe.programs[0].device, repeats=20)
    dispatch = kept["dispatch"]
    return (0.0 if inline else dispatch), dispatch
  return (0.0 if inline else min(dispatch_seconds(p.device) for p in pipe.programs)), 0.0


class _Profile:
  """`measure`'s tasks: traced first (quick: each graph's first call on a thread beside the
  next trace), then timed. `pending`: per stage timed, (program, {task: its `_Runs`});
  `works`: each stage's work (body, inputs, device)."""

  def __init__(self, pipe, inline, quick, traced, runs_per_call, labels, M):
    self.pipe, self.inline, self.quick, self.traced = pipe, inline, quick, traced
    self.runs_per_call, self.labels = runs_per_call, labels
    self.scale = tf.constant(1.0 / M, tf.float64)
    self.pool = concurrent.futures.ThreadPoolExecutor(1) if quick else None
    self.pending, self.works = [], []
    # Inlined tasks run in a window's graph, optimised as the executor's inlined windows are.
    self.light = (any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in pipe.devices)
                  if inline else None)

  def start(self, key, body, inputs, device):
    """The runs of task `key` (traced now, or kept in `traced` and fed `inputs`)."""
    if self.traced is None:
      return _Runs([(body, inputs, device)], self.runs_per_call, pool=self.pool,
                   light=self.light)
    key = (key, self.inline)
    if key in self.traced:   # traced for any batch size: fed this one
      self.traced[key].use(inputs)
    else:
      self.traced[key] = _Runs([(body, inputs, device)], self.runs_per_call, pool=self.pool,
                               relaxed=True, light=self.light)
    return self.traced[key]

  def trace(self, xs, n, timed, time_update, moves):
    """Traces the tasks of the stages `timed` on the micro-batch `xs` (n samples), each
    stage's inputs the outputs of the one before: the update (where `time_update`) on one
    stage (quick: the timed stage of the median weights; else every timed stage), and the
    moves to the next stage where `moves`."""
    pipe = self.pipe
    updated = timed
    if self.quick:
      by_size = sorted(timed, key=lambda k: sum(int(np.prod(v.shape))
                                                for v in pipe.programs[k].trainable))
      updated = {by_size[len(by_size) // 2]}
    for program in pipe.programs[:max(timed) + 1]:
      if program.index not in timed:
        xs = _outputs(program, xs, n, self.traced)
        continue
      tasks, xs = self._stage_tasks(program, xs, n, moves)
      accumulate = program.updates.accumulators is not None
      if accumulate and time_update and program.index in updated:
        tasks["update"] = self.start((program.index, "update"),
                                     lambda inputs, program=program: _inlined_update(program),
                                     [], program.device)
      self.pending.append((program, tasks))

  def _stage_tasks(self, program, xs, n, moves):
    """({task: runs} of `program` on its inputs `xs`, the next stage's inputs). The labels
    and the gradients' scale are inputs (not captured): a task traced for any batch size is
    fed other micro-batches."""
    pipe, inline, labels, tasks = self.pipe, self.inline, self.labels, {}
    accumulate = program.updates.accumulators is not None
    # A prediction reads its stage's version difference under 1F1B (K-1-k).
    s = pipe.num_stages - 1 - program.index if pipe.policy.predicts else 0
    device = program.device
    if program.is_last:
      def step(inputs, program=program, n=len(xs)):
        own = (tf.nest.pack_sequence_as(labels[0], inputs[n + 1:]), None)
        with program.inlined(inline):
          kept = program.forward(inputs[:n], labels=own)[1]
          return program.backward([kept], None, 0, inputs[n], accumulate).dxs
      inputs = xs + [self.scale] + tf.nest.flatten(labels[0])
      tasks["step"] = self.start((program.index, "step"), step, inputs, device)
      self.works.append((step, inputs, device))
      return tasks, xs
    ys = _outputs(program, xs, n, self.traced)

    def forward_backward(inputs, program=program, s=s):
      with program.inlined(inline):
        outputs, kept = program.forward(inputs[:-1], s)
        return program.backward([kept], [tf.ones_like(t) for t in outputs], s, inputs[-1],
                                accumulate).dxs
    tasks["fb"] = self.start((program.index, "fb"), forward_backward, xs + [self.scale], device)
    self.works.append((forward_backward, xs + [self.scale], device))
    if not self.quick:
      tasks["f"] = self.start((program.index, "f"), lambda inputs, program=program, s=s:
                              _inlined_forward(program, inputs, s, inline), xs, device)
    following = pipe.programs[program.index + 1].device

    def move(inputs, following=following):
      with tf.device(following):
        return [tf.identity(t) for t in inputs]
    if not (self.quick and shared_cores([device, following]) is not None) and moves:
      tasks["move"] = self.start((program.index, "move"), move, ys, device)
    return tasks, ys

  def seconds(self, repeats, less):
    """Per stage timed, {task: seconds a run}, once no first call still runs on the pool."""
    for _, tasks in self.pending:
      for t in tasks.values():
        t.wait()
    return [{task: t.seconds(repeats, less) for task, t in tasks.items()}
            for _, tasks in self.pending]

  def close(self):
    if self.pool is not None:
      self.pool.shutdown()


def _split(pending, seconds, crossing, M, K):
  """(forward, backward, transfer per stage, the updates timed) of a mini-batch from each
  stage's timed tasks: the last stage's step 1/3 forward, 2/3 backward; a backward is its
  forward and backward less its forward, plus the share of its forward it recomputes
  (`crossing`)."""
  forward, backward = [0.0] * K, [0.0] * K
  transfer, updates = [0.0] * (K - 1), []
  for (program, _), times in zip(pending, seconds):
    k = program.index
    if "step" in times:
      forward[k], backward[k] = times["step"] * M / 3, 2 * times["step"] * M / 3
    else:
      fb = times["fb"]
      f = times.get("f", fb / 3)
      # A kept forward that ran in an earlier window is recomputed by its backward. A forward
      # timed alone as long as with its backward is noise (tiny stages under load): the
      # backward then takes a tenth of both, as a timed call keeps a tenth of its seconds.
      again = crossing[k] if program.ops["F"].keeps == "tape" else 0.0
      forward[k], backward[k] = f * M, (max(fb - f, 0.1 * fb) + again * f) * M
      transfer[k] = times.get("move", 0.0) * M
    if "update" in times:
      updates.append(times["update"])
  return forward, backward, transfer, updates


def _updated_state(pipe):
  """What updates change on `pipe`'s stages besides the weights (`Updates.state`), the
  whole-model decision they share, once, and the running loss and metrics (a profile in the
  middle of an epoch, `method="auto"` taking over from its probe, leaves the epoch's logs as
  they were)."""
  joint = pipe.programs[0].updates.joint
  step = pipe.step
  metrics = list(step.loss_tracker.variables) + [v for m in step.loss.metrics
                                                 for v in m.variables]
  if step.metrics is not None:
    metrics += list(step.metrics.variables)
  metrics += [v for p in pipe.programs if p.reg_tracker is not None
              for v in p.reg_tracker.variables]
  return ([v for p in pipe.programs for v in p.updates.state()]
          + (joint.state() if joint is not None else []) + metrics)


def start_seconds(traced: dict, inline: bool, num_stages: int) -> List[float]:
  """Per stage, the seconds its forward and backward (the last stage's step) took to trace
  and to run the first time (where TensorFlow optimises the graph and makes its kernels), in
  the quick profile that kept its tasks in `traced` with tasks `inline` or not: what a copy
  of the stage's tasks costs a window's start-up (`tfpipe.training.auto`). Every task
  `measure` keeps there has been timed, its first call with it."""
  runs = [traced.get(((k, "fb"), inline)) or traced[((k, "step"), inline)]
          for k in range(num_stages)]
  return [r.trace_seconds + r.first_seconds for r in runs]


def predict(costs: simulator.Costs, method: str, batch_size: int, micro_batches: int,
            num_batches: int = 32, virtual_stages: Optional[int] = None) -> float:
  """Samples/s the simulator predicts for `method` with `micro_batches` on `costs`
  (`measure`'s, taken at that micro-batch size) over `num_batches` mini-batches of
  `batch_size` (`virtual_stages`: V for "interleaved" and "zbv", the costs then per stage)."""
  policy = policies.policy_for(method, virtual_stages=virtual_stages)
  timeline = simulator.simulate_method(method, costs, num_batches, micro_batches=micro_batches,
                                       recompute=policy.recompute,
                                       virtual_stages=virtual_stages)
  return timeline.samples_per_second(batch_size)


def _inlined_forward(program, inputs, s, inline):
  """`program`'s forward outputs on `inputs`, its tasks traced `inline` or as calls."""
  with program.inlined(inline):
    return program.forward(inputs, s)[0]


def _inlined_update(program):
  """`program`'s update, traced inline."""
  with program.inlined(True):
    return program.update()
