"""Bytes on the wire: what each host sent and received over its link, per training step.

`LinkTraffic(counters)` is a Keras callback around a function that reads the
links' byte counters ({host: (sent, received)}, e.g.
`tfpipe.cluster.EmulatedCluster.counters`): it reads them when training
begins and ends and at each step's end, so `per_step()` is what one
mini-batch moved in the last epoch's steady state, and `totals()` what the
whole `fit` moved (the weights sent out at its start and written back to the
client's model at its end, and at epoch ends where a callback reads them, included).
"""

import time

import keras

__all__ = ["LinkTraffic", "describe"]


class LinkTraffic(keras.callbacks.Callback):
  """Each host's bytes sent and received over `fit` (`totals`), and per step of the last epoch
  (`per_step`: the steady state, between its first and last step's ends, without what `fit`
  moves at its start and at an epoch's end; where the steps run asynchronously, from the
  epoch's start to its last step's end)."""
  reads_weights = False   # it reads no weights: the stages keep theirs until fit's end

  def __init__(self, counters, rate=None):
    """`rate`: the links' rate in bits/s, where known (each link's, both ways): `describe`
    then gives the busiest link's share of a step."""
    super().__init__()
    self._counters, self.rate = counters, rate
    self.start = self.end = None
    self.steps = 0              # steps over the whole fit
    self.epoch_steps = 0        # steps counted in `per_step`
    self._epoch = None          # (counters at the epoch's first step's end, its step)
    self._last = None           # (counters at the last step's end, its step)
    self._in_epoch = 0
    self._steady = None

  def on_train_begin(self, logs=None):
    self.start, self.steps = self._counters(), 0

  @property
  def asynchronous(self):
    """Whether the steps run on their own and report their ends as their results arrive
    (`tfpipe.ASGD`): a step's end then comes after its traffic, and a fast step's after the
    next ones', so its epoch is counted from its start, over all its steps."""
    return bool((self.params or {}).get("asynchronous_steps"))

  def on_epoch_begin(self, epoch, logs=None):
    self._in_epoch, self._epoch = 0, None
    if self.asynchronous:
      self._epoch = (self._counters(), 0, time.monotonic())

  def on_train_batch_end(self, batch, logs=None):
    self._in_epoch = max(self._in_epoch, batch + 1)   # windows of steps report their last
    now = (self._counters(), batch + 1, time.monotonic())
    if self._epoch is None:
      self._epoch = now
    self._last = now

  def on_epoch_end(self, epoch, logs=None):
    self.steps += self._in_epoch
    if self._epoch is not None and self._last[1] > self._epoch[1]:
      self._steady = (self._epoch, self._last)

  def on_train_end(self, logs=None):
    self.end = self._counters()

  @property
  def steady(self):
    """Whether `per_step` is the last epoch's steady state (it had more than one window)."""
    return self._steady is not None

  def totals(self):
    """{host: (bytes sent, bytes received)} over the whole `fit`."""
    return {host: (self.end[host][0] - self.start[host][0],
                   self.end[host][1] - self.start[host][1]) for host in self.end}

  def per_step(self):
    """{host: (bytes sent, bytes received)} per training step: of the last epoch's steps after
    its first (window), or, where it had one window only, of the whole fit."""
    steady = self._steady
    if steady is None:
      steps = self.epoch_steps = max(self.steps, 1)
      return {host: (sent / steps, received / steps)
              for host, (sent, received) in self.totals().items()}
    (first, a, _), (last, b, _) = steady
    steps = self.epoch_steps = b - a
    return {host: ((last[host][0] - first[host][0]) / steps,
                   (last[host][1] - first[host][1]) / steps) for host in last}


  def step_seconds(self):
    """Seconds per step of the last epoch's steady state, or None where it had one window."""
    if self._steady is None:
      return None
    (_, a, start), (_, b, end) = self._steady
    return (end - start) / (b - a)

  def busy(self):
    """The busiest link's busier direction: its bytes per step at `rate`, as a share of a
    steady step (near 1: the link bounds the run); None without a rate or a steady state."""
    seconds = self.step_seconds()
    if not self.rate or not seconds:
      return None
    return max(max(pair) for pair in self.per_step().values()) * 8 / self.rate / seconds


def _name(host):
  return host if isinstance(host, str) else f"{host[0]}/{host[1]}"


def describe(traffic):
  """One line: each host's MB sent / received per step, and the hosts' total sent."""
  per_step = traffic.per_step()
  hosts = sorted(per_step, key=lambda h: (isinstance(h, str), str(h)))
  each = ", ".join(f"{_name(h)} {per_step[h][0] / 1e6:.3g}/{per_step[h][1] / 1e6:.3g}"
                   for h in hosts)
  total = sum(sent for sent, _ in per_step.values())
  whole = sum(sent for sent, _ in traffic.totals().values())
  over = (f"over {traffic.epoch_steps} steps of the last epoch" if traffic.steady else
          "over the whole fit: its epochs ran as one window of steps each")
  if traffic.steady and traffic.asynchronous:
    over += ", counted from its start: its steps ran asynchronously"
  return (f"bytes on the links per step ({over}), "
          f"MB sent/received: {each}; {total / 1e6:.3g} MB sent in all; the whole fit "
          f"({traffic.steps} steps, the weights moved at its start and end included): "
          f"{whole / 1e6:.3g} MB" + _busy(traffic))


def _busy(traffic):
  busy = traffic.busy()
  if busy is None:
    return ""
  return (f"; the busiest link busy {100 * busy:.2g}% of a step (its bytes at "
          f"{traffic.rate / 1e6:g} Mbit/s; near 100%: the link bounds the run)")
