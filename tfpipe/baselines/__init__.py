"""What a pipeline is measured against.

  keras:           `Single` (plain Keras on one device), `DataParallel` (`MirroredStrategy`)
                   and `create`, the trainer of any method by name;
  tensor_parallel: the grid of tensor-parallel Dense layers (`method="grid"`);
  asgd:            asynchronous SGD on the parameter servers of a cluster (`method="asgd"`);
  multi_worker:    Keras's `MultiWorkerMirroredStrategy` over worker processes;
  epochs:          the epoch loop of the baselines that run their own steps.
"""
