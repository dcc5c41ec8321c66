"""Several processes: TF servers that run stages (`tfpipe.cluster.connect`, `LocalCluster`).

  servers:  a cluster of TF servers (`connect`, `from_tf_config`), its liveness watch and
            the errors that name a lost task;
  local:    `LocalCluster`, servers in local processes started by one launcher;
  serving:  the server processes (`python -m tfpipe.cluster`) and that launcher;
  bind:     servers that listen only on the address their spec names;
  liveness: an RPC-level probe of a server, and a watchdog;
  emulated: TF servers on emulated hosts (`EmulatedCluster`), built by
  emulation (network namespaces, shaped links: `links`) and cgroups (memory, CPUs);
  impairment: a link's delay and loss (packet programs, `bpf`, and a `delay_line`);
  link_watch: names an emulated host whose connections retransmit.
"""

from tfpipe.cluster.local import LocalCluster, free_port, remove_leftover_files
from tfpipe.cluster.servers import (
    WorkerLost, ClusterUnreachable, connect, connected_spec, note_connected,
    client_address, route_address, CLIENT_JOB,
    from_tf_config, task_devices, check_devices, unreachable_tasks, describe_lost,
    describe_state, guard, watch, check_answering, set_liveness, LIVENESS, EXIT_LOST, reconnect,
    owner)

from tfpipe.cluster.emulated import EmulatedCluster
from tfpipe.cluster.emulation import EmulationUnavailable

__all__ = ["free_port", "WorkerLost", "ClusterUnreachable", "LocalCluster", "connect", "connected_spec", "note_connected", "from_tf_config", "task_devices", "check_devices", "unreachable_tasks", "describe_lost", "describe_state", "guard", "watch", "check_answering", "set_liveness", "LIVENESS", "EXIT_LOST", "reconnect", "owner", "remove_leftover_files", "client_address", "route_address", "CLIENT_JOB", "EmulatedCluster", "EmulationUnavailable"]
