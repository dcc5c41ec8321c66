"""The Keras face: `Pipeline`'s `compile` / `fit` / `evaluate` / `predict` and what they take.

  pipeline:      `Pipeline`, the Keras-like model of a pipelined method;
  options:       its options, resolved once at `compile`;
  assemble:      its stage programs and executor, built at `compile`;
  placement:     each stage's devices, checked against the method and the cluster;
  footprint:     each stage's memory, predicted before training;
  layer_profile: each layer's measured forward and backward time;
  chooser:       `method="auto"` as one object (`probe`: its probe; `auto`: its choice);
  fitting:       a fit's set-up; `evaluate` and `predict`;
  fit_loop:      the epoch loop (callbacks, History, progress);
  fit_data:      `fit`'s arguments checked and made into datasets;
  data:          Keras's input forms as batched datasets;
  input_checks:  bad input refused before any work, in one line;
  checkpoint:    `BackupAndRestore` for a pipeline, `restore_keras` for the Keras model;
  layout_state:  training state keyed by the model (a checkpoint resumes in any layout);
  learning_rate: one learning rate that drives every stage's optimizer;
  layouts:       data parallel, pipeline or both on H hosts, chosen by the links.
"""
