"""Logical CPU devices are created once, before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfpipe  # noqa: E402

DEVICES = tfpipe.create_logical_cpus(4)
