"""`hyperdraft train-draft`: EAGLE-3 heads trained on the target's own answers (self-distillation)."""
