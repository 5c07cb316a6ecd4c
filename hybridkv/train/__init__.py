"""The training stack: optimizers, QAT, losses, loop, recipes."""
