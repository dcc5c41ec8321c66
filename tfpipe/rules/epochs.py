"""How many epochs an asynchronous method takes to the synchronous accuracy, measured: what
`method="auto"` counts against its speed.

EPOCHS[family][K][kind] = (epochs to the synchronous run's best validation accuracy less
0.5 pp, relative to the synchronous run's; runs that reached it; runs), from
`python bench/time_to_accuracy.py --parts=epochs --stages=2,4,8` over the staleness
benchmark's runs on the tasks chosen on (classes, teacher, shapes; seeds 0-2; each task's
first learning rate; batch 128; 15 epochs). Kinds: "spectrain" (M=1, the paper's rule),
"spectrain advised" (`advice=True`: `tfpipe.rules.advice`'s micro-batches and Nesterov's
step), "2bw". A synchronous schedule is 1 by construction (it equals Keras). A kind not here
was not measured at that depth for that optimizer.
"""

from typing import Dict, Optional, Tuple

__all__ = ["EPOCHS", "factor"]

EPOCHS: Dict[str, Dict[int, Dict[str, Tuple[Optional[float], int, int]]]] = {
    "sgd": {
        2: {"spectrain": (1.01, 5, 9), "spectrain advised": (0.92, 6, 9)},
        4: {"spectrain": (1.08, 1, 9), "spectrain advised": (0.89, 8, 9), "2bw": (None, 0, 9)},
        8: {"spectrain": (None, 0, 9), "spectrain advised": (0.88, 8, 9), "2bw": (None, 0, 9)},
    },
    "adam": {
        2: {"spectrain": (1.00, 7, 9), "spectrain advised": (0.94, 9, 9)},
        4: {"spectrain": (1.01, 6, 9), "spectrain advised": (0.81, 9, 9), "2bw": (1.24, 4, 9)},
        8: {"spectrain": (None, 0, 9), "spectrain advised": (0.78, 9, 9), "2bw": (1.06, 2, 9)},
    },
}


def factor(family: Optional[str], num_stages: int) -> Dict[str, Optional[float]]:
  """{kind: epochs relative to synchronous training} at `num_stages` stages for the optimizer
  `family` ("sgd", "adam"; `tfpipe.rules.advice.family`): None where some measured run did
  not reach the accuracy; a kind measured at no depth >= K is left out (unknown). Taken from
  the shallowest measured depth at or beyond K (staleness grows with depth)."""
  table = EPOCHS.get(family or "", {})
  depths = sorted(d for d in table if d >= num_stages)
  if not depths:
    return {}
  out: Dict[str, Optional[float]] = {}
  for kind, (ratio, reached, runs) in table[depths[0]].items():
    out[kind] = ratio if reached == runs else None
  return out
