"""Bytes on the wire: what each host sent and received over its link, per training step.

`LinkTraffic(counters)` is a Keras callback around a function that reads the
links' byte counters ({host: (sent, received)}, e.g.
`tfpipe.cluster.EmulatedCluster.counters`): it reads them when training
begins and ends and counts the steps between, so `per_step()` is what one
mini-batch moved, weights written back to the client's model included.
"""

import keras

__all__ = ["LinkTraffic", "describe"]


class LinkTraffic(keras.callbacks.Callback):
  """Each host's bytes sent and received per training step, over `fit`."""

  def __init__(self, counters):
    super().__init__()
    self._counters = counters
    self.start = self.end = None
    self.steps = 0
    self._in_epoch = 0

  def on_train_begin(self, logs=None):
    self.start, self.steps = self._counters(), 0

  def on_epoch_begin(self, epoch, logs=None):
    self._in_epoch = 0

  def on_train_batch_end(self, batch, logs=None):
    self._in_epoch = max(self._in_epoch, batch + 1)   # windows of steps report their last

  def on_epoch_end(self, epoch, logs=None):
    self.steps += self._in_epoch

  def on_train_end(self, logs=None):
    self.end = self._counters()

  def totals(self):
    """{host: (bytes sent, bytes received)} over the whole `fit`."""
    return {host: (self.end[host][0] - self.start[host][0],
                   self.end[host][1] - self.start[host][1]) for host in self.end}

  def per_step(self):
    """{host: (bytes sent, bytes received)} per training step."""
    steps = max(self.steps, 1)
    return {host: (sent / steps, received / steps)
            for host, (sent, received) in self.totals().items()}


def _name(host):
  return host if isinstance(host, str) else f"{host[0]}/{host[1]}"


def describe(traffic):
  """One line: each host's MB sent / received per step, and the hosts' total sent."""
  per_step = traffic.per_step()
  hosts = sorted(per_step, key=lambda h: (isinstance(h, str), str(h)))
  each = ", ".join(f"{_name(h)} {per_step[h][0] / 1e6:.3g}/{per_step[h][1] / 1e6:.3g}"
                   for h in hosts)
  total = sum(sent for sent, _ in per_step.values())
  return (f"bytes on the links per step ({traffic.steps} steps), MB sent/received: {each}; "
          f"{total / 1e6:.3g} MB sent in all")
