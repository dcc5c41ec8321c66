"""`python -m tfpipe.cluster --spec=... --job=... --task=...`: TF servers of a cluster
(`tfpipe.cluster.servers`)."""

import sys

from tfpipe.cluster import servers

servers.serve(sys.argv[1:])
