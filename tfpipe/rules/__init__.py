"""Weight and update rules in TensorFlow: what each method computes on a stage's weights.

  mitigations: the staleness answers (DC-ASGD, spike compensation, weight blends, ...);
  prediction:  optimizer-dependent weight prediction (PipeOptim, XPipe);
  optimizers:  the `SpecTrain` Keras optimizer (usable in plain `model.fit`);
  joint:       whole-model decisions once per mini-batch (global-norm clipping, loss scaling,
               weights shared across stages);
  advice:      the options `method="spectrain"` takes where the user leaves them unset;
  reference:   each method's slow reference rule (one device, a plain Python loop).
"""
