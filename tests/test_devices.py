"""Devices: logical CPUs, resolution of device lists, remote device strings."""

import pytest

from tests.conftest import DEVICES
from tfpipe import devices


def test_logical_cpus_exist():
  assert len(DEVICES) == 4
  assert devices.create_logical_cpus(4) == DEVICES  # same request again: a no-op


def test_too_late_to_change_is_a_clear_error():
  with pytest.raises(RuntimeError, match="already initialised"):
    devices.create_logical_cpus(5)


def test_resolve():
  assert devices.resolve_devices(None, 2) == DEVICES[:2]
  assert devices.resolve_devices(["/cpu:1", "/cpu:0"], None) == ["/cpu:1", "/cpu:0"]
  # Remote device strings are kept as given: nothing assumes local.
  remote = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]
  assert devices.resolve_devices(remote, 2) == remote
  with pytest.raises(ValueError, match="give `devices`"):
    devices.resolve_devices(None, None)
  with pytest.raises(ValueError, match="`devices` must be a list of device strings"):
    devices.resolve_devices("/cpu:0", None)
