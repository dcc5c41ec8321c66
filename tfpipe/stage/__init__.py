"""One stage: a cut of the model and its program (what `tfpipe.runtime`'s executors run,
through `tfpipe.runtime.protocol.StageProtocol`).

  partition:     the model cut into K stages (layers, names or a balanced profile);
  program:       a stage's operations (`StageProgram`: forward (the last stage's with its
                 loss; inference), backward and its input and weight halves, update);
  bodies:        its task bodies (the stage call, gradients, the last stage's step);
  residuals:     what a called forward keeps and a compiled window carries;
  kept:          `Kept` (what a forward keeps), `Backward`, the gradient arithmetic;
  weights:       where a task reads its weights (current, predicted, corrected, delayed,
                 kept, blended);
  updates:       the optimizer step with the stage's rule, gradient accumulation, whole-model
                 decisions;
  logs:          the last stage's loss and metrics, as Keras's train step reports them;
  tracing:       the stage's task functions, traced once per signature;
  keras_step:    what `compile` receives, resolved as Keras's train step does (`KerasStep`);
  reduction:     a replicated stage: its call on each replica, its gradients summed;
  mirrors:       replicas' own copies of a stage's weights, kept equal by a ring all-reduce.
"""
