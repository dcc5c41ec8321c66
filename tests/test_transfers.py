"""tfpipe.instruments.transfers: a host's time split from its trace (pure: made-up events)."""

import math

import pytest

from tfpipe.instruments import transfers

START, DONE = "ExecutorState::ProcessAsync::Start", "ExecutorState::ProcessAsync::Done"


def op(kind, start, end, node="n"):
  return (kind, start, end, {"long_name": f"{node}:{kind}"})


def pending(kernel, start, end, node="r", step="1"):
  """An asynchronous kernel's start and callback events."""
  args = {"kernel_type": kernel, "name": node, "step_id": step}
  return [(START, start, start + 0.001, args), (DONE, end - 0.001, end, dict(args))]


def test_waiting_is_a_pending_transfer_outside_compute_and_compute_is_the_ops_union():
  events = ([op("MatMul", 0.0, 2.0), op("Relu", 1.0, 3.0)]       # compute 0..3 (overlapping)
            + pending("_Recv", 2.0, 6.0)                          # waiting 3..6
            + pending("CollectiveReduceV2", 5.0, 7.0, node="c")   # waiting 6..7 (5..6 counted)
            + [op("AddV2", 9.0, 10.0)])                           # compute; idle 7..9
  traced = transfers.shares(events)
  assert math.isclose(traced.seconds, 10.0)
  assert math.isclose(traced.compute, 4.0) and math.isclose(traced.waiting, 4.0)
  assert math.isclose(traced.other, 2.0) and math.isclose(traced.share("waiting"), 0.4)


def test_a_send_op_is_a_transfer_not_compute():
  traced = transfers.shares([op("MatMul", 0.0, 1.0), op("_Send", 1.0, 3.0)])
  assert math.isclose(traced.compute, 1.0) and math.isclose(traced.waiting, 2.0)


@pytest.mark.parametrize("events", [
    # A server's handling of a request spans the function it runs: no op.
    [(("Enqueue", 0.0, 6.0, {"long_name": "EagerService:Enqueue"}))],
    # An asynchronous kernel that moves nothing (a call, an iterator) is no transfer.
    pending("IteratorGetNext", 0.0, 6.0, node="it"),
])
def test_what_is_neither_an_op_nor_a_transfer_counts_as_idle_and_only_ops_span_the_trace(events):
  traced = transfers.shares(events + [op("MatMul", 1.0, 2.0), op("MatMul", 4.0, 5.0)])
  assert math.isclose(traced.compute, 2.0) and traced.waiting == 0.0
  assert math.isclose(traced.seconds, 4.0) and math.isclose(traced.other, 2.0)   # 1 s to 5 s
  assert transfers.shares(events) == transfers.Shares(0.0, 0.0, 0.0)   # no op: nothing traced


def test_a_loops_receives_of_one_node_pair_their_starts_and_callbacks_in_order():
  events = pending("_Recv", 0.0, 1.0) + pending("_Recv", 2.0, 3.0) + [op("MatMul", 3.0, 4.0)]
  traced = transfers.shares(events)
  assert math.isclose(traced.waiting, 2.0)   # not 0..3 as one wait
  assert math.isclose(traced.other, 1.0)


def test_an_empty_trace_has_no_time_and_a_trace_needs_seconds():
  assert transfers.shares([]) == transfers.Shares(0.0, 0.0, 0.0)
  with pytest.raises(ValueError, match="seconds > 0"):
    transfers.HostTrace({"h": "198.18.0.1:2222"}, seconds=0)


def test_describe_gives_each_hosts_shares():
  line = transfers.describe({("worker", 1): transfers.Shares(2.0, 0.5, 1.0),
                             ("ps", 0): transfers.Shares(1.0, 0.999, 0.001)})
  assert line.startswith("time on each host, traced over 2 s")
  assert line.index("ps/0 computing 100%, waiting on transfers 0.1%, idle 0%") < line.index(
      "worker/1 computing 25%, waiting on transfers 50%, idle 25%")


def test_a_worker_that_traces_nothing_waits_for_the_first_workers_word_before_any_op(
    tmp_path, monkeypatch):
  # --transfer_share with data parallelism: the other workers run no op (a collective) until
  # the first worker's trace has ended, which it says by making a file.
  import threading
  import time
  import types
  from trainers import instruments
  done = tmp_path / "trace_done"
  monkeypatch.setenv(instruments.TRACE_DONE_VARIABLE, str(done))
  waiter = types.SimpleNamespace(WAIT_MARGIN=0.0, WORD_WAIT=30.0)
  threading.Timer(0.3, done.touch).start()
  start = time.monotonic()
  instruments.Instruments._wait_for_trace(waiter, start)   # the trace's end passed
  assert done.exists()   # it waited for the word, past the trace's own end
  assert time.monotonic() - start < waiter.WORD_WAIT   # and went on at the word


def test_without_a_word_a_worker_waits_past_the_traces_end(monkeypatch):
  import time
  import types
  from trainers import instruments
  monkeypatch.delenv(instruments.TRACE_DONE_VARIABLE, raising=False)
  waiter = types.SimpleNamespace(WAIT_MARGIN=0.2)
  ends = time.monotonic() + 0.1
  instruments.Instruments._wait_for_trace(waiter, ends)
  assert time.monotonic() >= ends + waiter.WAIT_MARGIN
