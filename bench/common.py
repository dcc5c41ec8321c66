"""The flags most benchmarks share: the shape of the model they train (an MLP of --depth
layers of --width units on --input_dim features), its batches, its micro-batches, and where
their tables go. Each benchmark gives its own defaults:

  common.define(width=512, depth=8, batch_size=64, results_dir=results_io.RESULTS)
"""

import inspect
import sys

from absl import flags

__all__ = ["define", "HELP"]

HELP = {
    "width": "units per layer",
    "depth": "hidden layers",
    "input_dim": "input features",
    "batch_size": "samples (or sequences) per mini-batch",
    "batches": "mini-batches per epoch",
    "micro_batches": "M, micro-batches per mini-batch",
    "results_dir": "where the tables go",
}


def define(**defaults):
  """Defines the flags named (keys of HELP) with these defaults: integers, but --results_dir,
  a folder. They belong to the calling benchmark, so its --help lists them."""
  module = inspect.currentframe().f_back.f_globals["__name__"]
  module = sys.argv[0] if module == "__main__" else module   # as absl names the main module
  for name, default in defaults.items():
    if name not in HELP:
      raise ValueError(f"no shared flag {name!r}; shared: {', '.join(HELP)}")
    define_flag = flags.DEFINE_string if name == "results_dir" else flags.DEFINE_integer
    define_flag(name, default, HELP[name], module_name=module)
