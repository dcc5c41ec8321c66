"""Executors: run a verified schedule on the stage programs.

`compiled` (the default): one `tf.function` per window of W mini-batches runs
every stage's tasks, so TensorFlow's executor overlaps the stages on their
devices. `threaded`: a worker thread per stage interprets the schedule task
by task (the reference, for debugging). Both run the same stage programs.
"""

from tfpipe.plan.records import TaskRecord
from tfpipe.runtime.compiled import CompiledRuntime
from tfpipe.runtime.links import Barrier, Channel, OutOfData, Stopped, spawn
from tfpipe.runtime.threaded import Runtime

EXECUTORS = ("compiled", "threaded")

__all__ = ["CompiledRuntime", "Runtime", "TaskRecord", "OutOfData", "Stopped", "Channel",
           "Barrier", "spawn", "EXECUTORS"]
