"""Training EAGLE-3 draft heads by self-distillation (``polyspec train-draft``)."""
