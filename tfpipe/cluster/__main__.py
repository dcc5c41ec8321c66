"""`python -m tfpipe.cluster --spec=... --job=... --task=...`: TF servers of a cluster
(`tfpipe.cluster.serving`)."""

import sys

from tfpipe.cluster import serving

serving.serve(sys.argv[1:])
