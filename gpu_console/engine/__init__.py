"""The training engine: runs inside torchrun, the same code on every rank."""
