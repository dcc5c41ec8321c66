"""One stage: a cut of the model, its program and where it runs.

  partition:     the model cut into K stages (layers, names or a balanced profile);
  program:       a stage's forward, backward and update (`StageProgram`);
  keras_step:    what `compile` receives, resolved as Keras's train step does (`KerasStep`);
  assemble:      a Pipeline's stage programs and executor, built at `compile`;
  placement:     each stage's devices, checked against the method and the cluster;
  reduction:     how a replicated stage's gradients come together;
  layer_profile: each layer's measured forward and backward time.
"""
