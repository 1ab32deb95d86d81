"""``mlp``: a classifier on synthetic Gaussian clusters (the quickstart task)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import MLPConfig


def make_clusters(cfg: MLPConfig, n: int, generator: torch.Generator, centres: torch.Tensor):
    labels = torch.randint(0, cfg.num_classes, (n,), generator=generator)
    noise = torch.randn(n, cfg.input_dim, generator=generator) * cfg.noise
    return centres[labels] + noise, labels


class MLPTask:
    Config = MLPConfig

    def __init__(self, config: MLPConfig):
        self.cfg = config

    def build_model(self) -> nn.Module:
        c = self.cfg
        layers: list[nn.Module] = []
        width = c.input_dim
        for _ in range(c.num_layers - 1):
            layers.append(nn.Linear(width, c.hidden_dim))
            if c.batch_norm:
                layers.append(nn.BatchNorm1d(c.hidden_dim))
            layers.append(nn.GELU())
            if c.dropout:
                layers.append(nn.Dropout(c.dropout))
            width = c.hidden_dim
        layers.append(nn.Linear(width, c.num_classes))
        return nn.Sequential(*layers)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sample: 2 per multiply-add in each Linear forward, twice that
        backward (input and weight gradients), less the first layer's input gradient, which
        the data does not need. Biases, GELU, BatchNorm and the loss are not counted (nor
        does FlopCounterMode count them)."""
        c = self.cfg
        widths = [c.input_dim] + [c.hidden_dim] * (c.num_layers - 1) + [c.num_classes]
        macs = [a * b for a, b in zip(widths, widths[1:], strict=False)]
        return float(6 * sum(macs) - 2 * macs[0])

    def build_datasets(self):
        c = self.cfg
        g = torch.Generator().manual_seed(c.data_seed)
        # Overlapping clusters: learnable, but it takes the whole run to get most of it.
        centres = torch.randn(c.num_classes, c.input_dim, generator=g) * c.separation
        train = TensorSet(*make_clusters(c, c.train_samples, g, centres))
        evals = TensorSet(*make_clusters(c, c.eval_samples, g, centres)) if c.eval_samples else None
        return train, evals

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(at_least_fp32(logits), y)
        accuracy = (logits.argmax(-1) == y).float().mean()
        return TaskOutput(loss=loss, samples=len(y), metrics={"accuracy": accuracy})
