"""Links priced (`tfpipe.plan.network`), layouts of H hosts ranked by them
(`tfpipe.plan.layouts`), the simulator's gradient sums and feed, and `choose_layout`."""

import math

import keras
import pytest

import tfpipe
from tfpipe.plan import layouts, network, policies, simulator
from tests import helpers


def test_a_transfer_costs_its_latency_and_its_bytes_over_the_rate():
  link = network.Link(rate=1e6, latency=0.002)
  assert network.transfer_seconds(5e5, link) == pytest.approx(0.502)
  assert network.transfer_seconds(0, link) == 0.0


@pytest.mark.parametrize("R, ring, central", [(1, 0.0, 0.0), (2, 2 * (0.001 + 0.5), 2 * 1.001),
                                              (4, 6 * (0.001 + 0.25), 6 * 1.001)])
def test_a_ring_sends_2_R_1_chunks_of_n_over_R_and_a_reduction_to_one_2_R_1_copies(
    R, ring, central):
  link = network.Link(rate=1e6, latency=0.001)
  assert network.ring_seconds(1e6, R, link) == pytest.approx(ring)
  assert network.reduction_seconds(1e6, R, link, "reduce_to_one_device") == pytest.approx(central)


@pytest.mark.parametrize("call, message", [
    (lambda: network.Link(0.0), "rate must be > 0"),
    (lambda: network.Link(1.0, -1.0), "latency must be >= 0"),
    (lambda: network.ring_seconds(1.0, 0, network.Link(1.0)), "replicas must be an integer"),
    (lambda: network.reduction_seconds(1.0, 2, network.Link(1.0), "nccl"), "unknown gradient"),
    (lambda: network.slowest([]), "no links"),
    (lambda: layouts.layouts(0, 8, 4), "hosts must be"),
    (lambda: layouts.layouts(4, 3, 1), "no layout of 4 hosts"),
    (lambda: _model_costs(sizes=(8,)).seconds(0, 8, 16), "no profile of layers 0..7"),
])
def test_bad_link_and_layout_arguments_are_refused_naming_the_value(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_the_slowest_link_has_the_least_rate_and_the_largest_latency():
  assert network.slowest([network.Link(5.0, 0.1), network.Link(2.0, 0.01)]) == network.Link(
      2.0, 0.1)
  assert network.slowest([network.Link(5.0, 0.1, 3.0), network.Link(2.0, 0.01, 1.5),
                          network.Link(4.0)]) == network.Link(2.0, 0.1, 1.5)


def test_a_ring_moves_at_the_duplex_rate_and_a_pipelines_transfer_at_the_one_way_rate():
  # Each host of a ring sends to one neighbour while it receives from the other.
  link = network.Link(rate=1e6, latency=0.001, duplex_rate=5e5)
  assert network.ring_seconds(1e6, 2, link) == pytest.approx(2 * (0.001 + 1.0))
  assert network.transfer_seconds(5e5, link) == pytest.approx(0.501)
  assert network.reduction_seconds(1e6, 2, link, "reduce_to_one_device") == pytest.approx(
      2 * 1.001)   # one way at a time through replica 0's link
  assert "4 Mbit/s each way both at once" in link.describe()
  with pytest.raises(ValueError, match="duplex rate must be > 0"):
    network.Link(1.0, 0.0, 0.0)


def test_a_ring_moves_at_its_measured_ring_rate_where_the_probe_took_one():
  link = network.Link(rate=1e6, latency=0.001, duplex_rate=5e5, ring_rate=2.5e5)
  # 4 hosts summing 1 MB: 6 chunks of 250 kB each, at the ring's rate.
  assert network.ring_seconds(1e6, 4, link) == pytest.approx(6 * (0.001 + 1.0))
  assert network.transfer_seconds(5e5, link) == pytest.approx(0.501)   # a pipeline's: one way
  assert "2 Mbit/s in a ring all-reduce" in link.describe()
  assert network.slowest([link, network.Link(2e6, 0.0, 1e6, 1e6)]).ring_rate == 2.5e5
  with pytest.raises(ValueError, match="ring rate must be > 0"):
    network.Link(1.0, 0.0, None, -1.0)


def test_layouts_are_every_r_by_k_the_batch_and_the_layers_allow():
  found = layouts.layouts(4, 256, 10)
  assert [(l.data_parallel, l.num_stages, l.micro_batches) for l in found] == [
      (1, 4, 8), (2, 2, 4), (4, 1, 1)]
  # A batch of 6 splits over 1 and 2 replicas, not 4; 3 layers allow K <= 3.
  assert [(l.data_parallel, l.num_stages) for l in layouts.layouts(4, 6, 3)] == [(2, 2)]
  assert layouts.stages(found[1], 10, 256) == [(0, 5, 32), (5, 10, 32)]
  assert [l.name for l in found] == ["1f1b K=4 M=8", "1f1b K=2 M=4 x data parallel R=2",
                                     "data parallel R=4"]


def test_a_gradient_sum_holds_the_device_after_its_update():
  base = simulator.Costs([0.1], [0.2], update=0.05)
  summed = simulator.Costs([0.1], [0.2], update=0.05, reduce=[0.4])
  schedule = policies.build_schedule(policies.policy_for("1f1b", "reuse", None, False, None),
                                     1, 4, 1)
  assert simulator.simulate(schedule, base).step_time == pytest.approx(0.35)
  timeline = simulator.simulate(schedule, summed)
  assert timeline.step_time == pytest.approx(0.75)
  assert timeline.busy == pytest.approx([4 * 0.35])   # waiting on a link is not computing


def test_a_feed_slower_than_the_compute_bounds_the_step():
  schedule = policies.build_schedule(policies.policy_for("1f1b", "reuse", None, False, None),
                                     2, 16, 2)
  fast = simulator.simulate(schedule, simulator.Costs([0.1, 0.1], [0.1, 0.1], feed=0.01))
  slow = simulator.simulate(schedule, simulator.Costs([0.1, 0.1], [0.1, 0.1], feed=1.0))
  assert slow.step_time == pytest.approx(1.0, rel=0.05)
  assert fast.step_time < 0.5


@pytest.mark.parametrize("field, value, message", [
    ("reduce", [0.1], "one reduce time per stage"), ("reduce", [-1.0, 0.0], ">= 0"),
    ("feed", -0.5, ">= 0")])
def test_bad_reduce_and_feed_times_are_refused(field, value, message):
  with pytest.raises(ValueError, match=message):
    simulator.Costs([0.1, 0.1], [0.1, 0.1], **{field: value})


def _model_costs(layers=8, seconds=0.01, weights=4e6, activations=4e3, sizes=(16, 32, 64, 128)):
  """Layers whose compute is linear in the batch (`seconds` each at a batch of 128), every
  span of them profiled at each of `sizes`."""
  spans = [(i, j, b) for i in range(layers) for j in range(i + 1, layers + 1) for b in sizes]
  forward = {(i, j, b): (j - i) * seconds * b / 128 for i, j, b in spans}
  return layouts.ModelCosts(forward, {k: 2 * t for k, t in forward.items()}, [weights] * layers,
                            [activations] * (layers - 1), feed_bytes=100.0,
                            update_per_byte=1e-10)


@pytest.mark.parametrize("rate, chosen", [(1e12, "data parallel R=2"), (1e7, "1f1b K=2 M=4")])
def test_data_parallel_is_chosen_where_links_are_fast_and_a_pipeline_where_slow(rate, chosen):
  costs, link = _model_costs(), network.Link(rate, 1e-4)
  rows = layouts.rank([layouts.predict(l, costs, 128, link, link)
                       for l in layouts.layouts(2, 128, costs.layers)])
  assert rows[0].layout.name == chosen
  for r in rows:
    assert 0.0 <= r.link_share <= 1.0
  lines = layouts.report_lines(rows, link)
  assert lines[2].startswith(chosen) and lines[2].endswith("chosen")


def test_with_free_links_data_parallel_runs_at_the_compute_of_half_the_batch():
  costs = _model_costs()
  row = layouts.predict(layouts.Layout(2, 1), costs, 128, None)
  compute = sum(costs.seconds(0, 8, 64)) + costs.update_per_byte * sum(costs.weights)
  assert row.samples_per_second == pytest.approx(128 / compute, rel=0.01)
  assert row.link_share == 0.0
  # Its busiest host sends 2 (R-1)/R of the weights by a ring, R-1 copies to one device.
  assert row.sent == pytest.approx(sum(costs.weights))
  central = layouts.predict(layouts.Layout(4, 1), _model_costs(sizes=(32,)), 128, None,
                            how="reduce_to_one_device")
  assert central.sent == pytest.approx(3 * sum(costs.weights))


def test_layouts_within_the_tie_rank_fewer_replicas_first():
  rows = [layouts.Row(layouts.Layout(2, 1), 100.0, 0.0, 0.0),
          layouts.Row(layouts.Layout(1, 2, 4), 99.5, 0.0, 0.0),
          layouts.Row(layouts.Layout(1, 2, 2), 50.0, 0.0, 0.0)]
  assert [r.layout.num_stages for r in layouts.rank(rows)] == [2, 1, 2]


@pytest.fixture(scope="module")
def two_devices():
  return tfpipe.default_devices()[:2]


def test_choose_layout_profiles_the_model_and_its_choice_trains(two_devices):
  model = helpers.sequential_mlp(width=64, depth=4, inputs=16)
  slow = network.Link(1e4, 1e-3)   # 10 kB/s: the weights cannot cross each step
  choice = tfpipe.choose_layout(model, two_devices, 32, link=slow, client_link=slow)
  assert choice.layout.num_stages == 2 and choice.layout.data_parallel == 1
  assert [r.layout.name for r in choice.rows][1] == "data parallel R=2"
  assert choice.lines[0].startswith("layouts over 2 hosts")
  options = choice.pipeline_options()
  assert options["devices"] == two_devices and options["data_parallel"] == 1
  assert "cross_device_ops" not in options
  data_parallel = choice.pipeline_options(choice.rows[1].layout)
  assert (data_parallel["data_parallel"], data_parallel["cross_device_ops"]) == (2, "ring")
  pipe = tfpipe.Pipeline(model, **options)
  pipe.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy())
  x, y = helpers.as_arrays(helpers.batches(2, batch_size=32, inputs=16))
  history = pipe.fit(x, y, batch_size=32, verbose=0)
  assert math.isfinite(history.history["loss"][-1])


def test_choose_layout_refuses_what_it_cannot_lay_out(two_devices):
  model = helpers.sequential_mlp(width=8, depth=2, inputs=4)
  with pytest.raises(ValueError, match="2 or more distinct devices"):
    tfpipe.choose_layout(model, two_devices[:1], 8)
  with pytest.raises(ValueError, match="synchronous schedule"):
    tfpipe.choose_layout(model, two_devices, 8, method="spectrain")
  with pytest.raises(ValueError, match="batch_size must be"):
    tfpipe.choose_layout(model, two_devices, 0)


def test_a_probe_between_two_devices_gives_a_rate_a_latency_and_a_duplex_rate(two_devices):
  from tfpipe.cluster import probe
  link = probe.probe(two_devices[0], two_devices[1], seconds=0.01, max_bytes=4 << 20,
                     repeats=1)
  assert link.rate > 0 and link.latency >= 0 and 0 < link.duplex_rate <= link.rate
  assert link.ring_rate > 0   # the ring all-reduce itself, timed
  assert probe.probe(two_devices[0], two_devices[1], seconds=0.01, max_bytes=4 << 20,
                     repeats=1, ring=False).ring_rate is None
  one_way = probe.client_links(two_devices[1:], client=two_devices[0], seconds=0.01,
                               max_bytes=4 << 20, repeats=1)[0]
  assert one_way.rate > 0 and one_way.duplex_rate is None   # what feeds a host: one way
  with pytest.raises(ValueError, match="both are"):
    probe.probe(two_devices[0], two_devices[0])
