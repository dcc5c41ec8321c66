"""The one place tfpipe reaches into Keras and TensorFlow: `access` (the private internals
it reads) and `tuning` (how it tunes TensorFlow's graphs, process-wide). Callers read both
through this package (`compat.functional_graph`, `compat.light_calls`)."""

from tfpipe.compat.tuning import *  # noqa: F401,F403
from tfpipe.compat.access import *  # noqa: F401,F403  (its `missing` names tuning's too)
from tfpipe.compat import access, tuning

__all__ = list(access.__all__) + [n for n in tuning.__all__ if n != "missing"]
