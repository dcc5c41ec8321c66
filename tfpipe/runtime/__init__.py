"""Executors: run a verified schedule on the stage programs.

`compiled` (the default): one `tf.function` per window of W mini-batches runs
every stage's tasks, so TensorFlow's executor overlaps the stages on their
devices. `threaded`: a worker thread per stage interprets the schedule task
by task (the reference, for debugging). Both run every action through one
interpreter and the same stage programs.

  interpreter:  what each action of a stage does (`run`), and how values move (`Moves`);
  threaded:     a thread per stage, values on bounded links (`links`);
  compiled:     a window of the schedule per traced call; its carry across calls;
  parked:       the carry made on TF servers, kept there in variables between calls;
  grouped:      an epoch's windows as the branches of one traced function (`groups`: how a
                carry fits every branch);
  loops:        windows that loop over mini-batches finished one by one;
  calls:        the feed of mini-batches and the clearer error of a compiled call;
  timeline:     task records from the TensorFlow profiler; iterators: the input's prefetch.
"""

from tfpipe.plan.records import TaskRecord
from tfpipe.runtime.compiled import CompiledRuntime
from tfpipe.runtime.links import Barrier, Channel, OutOfData, Stopped, spawn
from tfpipe.runtime.threaded import Runtime

EXECUTORS = ("compiled", "threaded")

__all__ = ["CompiledRuntime", "Runtime", "TaskRecord", "OutOfData", "Stopped", "Channel",
           "Barrier", "spawn", "EXECUTORS"]
