"""Config sections of the built-in tasks (the task's own keys in ``[task]``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..schema import opt


@dataclass
class MLPConfig:
    input_dim: int = opt(32, "features per sample", min=1)
    hidden_dim: int = opt(256, "width of each hidden layer", min=1)
    num_layers: int = opt(3, "linear layers, the output layer included", min=1)
    num_classes: int = opt(10, "clusters to tell apart", min=2)
    dropout: float = opt(0.0, "dropout after each hidden layer", min=0.0, max=0.9)
    batch_norm: bool = opt(False, "BatchNorm after each hidden layer (see sync_batchnorm)")
    train_samples: int = opt(32768, "synthetic training samples", min=1)
    eval_samples: int = opt(4096, "synthetic held-out samples", min=0)
    noise: float = opt(1.0, "spread of each cluster around its centre", min=0.0)
    separation: float = opt(0.5, "scale of the cluster centres; smaller is harder", gt=0.0)
    data_seed: int = opt(1234, "seed of the synthetic data set (the same on every rank)")


@dataclass
class TransformerConfig:
    vocab_size: int = opt(128, "token vocabulary", min=4)
    seq_len: int = opt(64, "tokens per sequence", min=2)
    d_model: int = opt(128, "model width", min=8)
    n_heads: int = opt(4, "attention heads (must divide d_model)", min=1)
    n_layers: int = opt(2, "encoder layers", min=1)
    ff_mult: int = opt(4, "feed-forward width as a multiple of d_model", min=1)
    num_classes: int = opt(4, "sequence classes", min=2)
    dropout: float = opt(0.1, "dropout in attention and feed-forward", min=0.0, max=0.9)
    train_samples: int = opt(16384, "synthetic training sequences", min=1)
    eval_samples: int = opt(2048, "synthetic held-out sequences", min=0)
    data_seed: int = opt(1234, "seed of the synthetic data set (the same on every rank)")

    def __post_init__(self) -> None:
        # Cross-field rule; reported through the profile loader like any other problem.
        if self.n_heads and self.d_model % self.n_heads:
            raise ValueError(
                f"task.n_heads: must divide task.d_model={self.d_model} (got {self.n_heads})"
            )
