"""One stage: a cut of the model, its program and where it runs.

  partition:     the model cut into K stages (layers, names or a balanced profile);
  program:       a stage's operations (`StageProgram`: forward (the last stage's with its
                 loss; inference), backward and its input and weight halves, update);
  weights:       where a task reads its weights (current, predicted, corrected, delayed,
                 kept, blended);
  updates:       the optimizer step with the stage's rule, gradient accumulation, whole-model
                 decisions;
  logs:          the last stage's loss and metrics, as Keras's train step reports them;
  tracing:       the stage's task functions, traced once per signature;
  keras_step:    what `compile` receives, resolved as Keras's train step does (`KerasStep`);
  assemble:      a Pipeline's stage programs and executor, built at `compile`;
  placement:     each stage's devices, checked against the method and the cluster;
  reduction:     a replicated stage: its call on each replica, its gradients summed;
  mirrors:       replicas' own copies of a stage's weights, kept equal by a ring all-reduce;
  layer_profile: each layer's measured forward and backward time.
"""
