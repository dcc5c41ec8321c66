"""Where a Pipeline's stages run (`tfpipe.training.placement`), checked before any TensorFlow
work."""

import pytest

import tfpipe
from tests.conftest import DEVICES
from tfpipe.plan import policies
from tfpipe.training import placement


def _policy(method, virtual_stages=None):
  return policies.policy_for(method, "reuse", None, False, virtual_stages)


def test_stages_replicas_and_virtual_stages_are_placed_device_by_device():
  plain = placement.place(None, 3, _policy("1f1b"))
  assert plain == ([[d] for d in DEVICES[:3]], {}, 1)
  hybrid = placement.place(DEVICES[:3], 2, _policy("spectrain"), {0: 2})
  assert hybrid.stage_devices == [DEVICES[:2], [DEVICES[2]]] and hybrid.stage_replicas == {0: 2}
  # zbv: device d holds stages d and 2K-1-d; with 2 replicas each stage has one per replica.
  zbv = placement.place(DEVICES[:4], None, _policy("zbv"), data_parallel=2)
  first, second = [DEVICES[0], DEVICES[2]], [DEVICES[1], DEVICES[3]]
  assert zbv.stage_devices == [first, second, second, first] and zbv.data_parallel == 2
  interleaved = placement.place(None, 2, _policy("interleaved", 2))
  assert interleaved.stage_devices == [[DEVICES[0]], [DEVICES[1]]] * 2


def test_keras_auto_jit_compile_needs_one_gpu_per_stage():
  gpus = placement.Placement([["/gpu:0"], ["/gpu:1"]], {}, 1)
  assert placement.default_jit_compile(gpus)
  assert not placement.default_jit_compile(gpus._replace(data_parallel=2))
  assert not placement.default_jit_compile(placement.Placement([[DEVICES[0]]], {}, 1))


def test_remote_devices_need_a_connected_cluster(monkeypatch):
  monkeypatch.setattr(placement.cluster, "connected_spec", lambda: None)   # whatever ran before
  remote = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]
  assert tfpipe.devices.remote([[DEVICES[0]], remote]) == remote
  with pytest.raises(ValueError, match="'/job:worker/task:0/device:CPU:0' is remote: connect"):
    placement.place(remote, None, _policy("spectrain"))
