"""``moe_mnist``: an image classifier whose hidden layers are mixtures of experts.

Each image is flattened (MNIST's 28×28 = 784 pixels, or the 8×8 digits' 64) and projected
to ``d_model`` features; each of ``n_layers`` layers is a LayerNorm, then the ``moe`` task's
own :class:`~gpu_console.tasks.moe.MoE` (its top-k router, capacity, Switch's balancing loss,
and its expert parallelism: ``expert_parallel = true`` spreads the experts over the ranks
and each sample's row travels to its experts with ``all_to_all``), added back to its input;
a LayerNorm and a linear head give the ten classes' logits. A sample is one token of the
router: an expert's capacity counts samples of the rank's batch.

Data: ``data_dir`` names a directory of MNIST's IDX files (read by :mod:`.idx`; the t10k
files are the eval set). Empty: scikit-learn's 8×8 digits (``load_digits``, shipped inside
scikit-learn: offline), 1,797 images split by a permutation seeded with ``data_seed``: the
first ``round(eval_fraction × 1797)`` of it are the eval set, the rest the training set (the
same on every rank and every run with that seed). Pixels are scaled to [0, 1].

Train metrics at each log step: ``ce``, ``aux_loss``, ``accuracy``, ``dropped`` (the share of
assignments past capacity) and ``expert_load/<e>`` (each expert's share of the assignments,
averaged over the layers). The eval: ``loss`` (the cross-entropy alone), ``accuracy``,
``dropped``, ``expert_load/<e>``, and the expert activations per class:
``expert_class/<c>/<e>``, the share of class ``c``'s assignments that went to expert ``e``
(each class's shares sum to 1; every layer's top-k choices, before capacity), from
``routed/<c>/<e>``, the share of all eval assignments that are class ``c``'s going to ``e``.

A warning (a ``log`` event of level ``warning``) when the mean dropped share of each log
interval stays above ``drop_warn_share`` for ``drop_warn_logs`` consecutive log steps; once
per such streak (a log step at or below the threshold ends it).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .base import TaskOutput, TensorSet, at_least_fp32
from .configs import DIGITS, MoEImageConfig, digits_held_out
from .moe import MoE, spread_for, spread_names
from .text_data import text_path

CLASSES = 10


def features_of(c: MoEImageConfig) -> int:
    """Pixels per image: MNIST's 28×28 with a data directory, else the digits' 8×8."""
    return 28 * 28 if c.data_dir else 8 * 8


class ImageMoE(nn.Module):
    def __init__(self, c: MoEImageConfig, spread=None):
        super().__init__()
        self.inp = nn.Linear(features_of(c), c.d_model)
        self.norms = nn.ModuleList(nn.LayerNorm(c.d_model) for _ in range(c.n_layers))
        self.layers = nn.ModuleList(MoE(c.d_model, c, spread) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, CLASSES)

    def forward(self, x: torch.Tensor):
        """(batch, pixels...) → (logits, aux loss, each expert's share, the share dropped:
        averaged over the layers; every layer's top-k experts of each sample)."""
        h = F.gelu(self.inp(x.flatten(1)))
        for norm, moe in zip(self.norms, self.layers, strict=True):
            h = h + moe(norm(h))
        layers = [cast(MoE, m) for m in self.layers]
        stats = [m.stats for m in layers]
        aux, load, dropped = (torch.stack(s).mean(0) for s in zip(*stats, strict=True))
        routed = torch.cat([cast(torch.Tensor, m.routed) for m in layers], dim=1)
        return self.head(self.ln(h)), aux, load, dropped, routed


def load_digits_split(c: MoEImageConfig):
    """The 8×8 digits' (train, eval) tensors: a permutation seeded with ``data_seed``, its
    first ``round(eval_fraction × 1797)`` held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(digits.target, dtype=torch.long)
    assert len(x) == DIGITS
    order = torch.randperm(DIGITS, generator=torch.Generator().manual_seed(c.data_seed))
    held = order[: digits_held_out(c.eval_fraction)]
    kept = order[len(held) :]
    return (x[kept], y[kept]), (x[held], y[held])


def load_mnist_split(folder: Path, split: str):
    from .idx import read_mnist

    dims, images, labels = read_mnist(folder, split)
    x = torch.frombuffer(bytearray(images), dtype=torch.uint8).view(dims[0], -1).float() / 255.0
    y = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    return x, y


class MoEImageTask:
    Config = MoEImageConfig

    def __init__(self, config: MoEImageConfig):
        self.cfg = config
        self._drop_sum: torch.Tensor | float = 0.0
        self._drop_steps = 0
        self._streak = 0

    def build_model(self) -> nn.Module:
        """As ``moe``'s: under ``expert_parallel`` on several ranks each rank holds its share
        of the experts (the values the whole model gives them)."""
        return ImageMoE(self.cfg, spread_for(self.cfg))

    def expert_parameters(self, model: nn.Module) -> list[str]:
        """As ``moe``'s: the experts' parameters under expert parallelism (the engine's
        ``expert`` strategy), else none."""
        return spread_names(self.cfg, getattr(self, "ctx", None), model)

    def flops_per_sample(self) -> float:
        """The input projection, each layer's router and ``top_k`` experts, the head: 2 per
        multiply-add, 3× with the backward."""
        c = self.cfg
        d, ff = c.d_model, c.ff_mult * c.d_model
        layer = 2 * d * c.num_experts + c.top_k * 4 * d * ff
        return float(3 * (2 * features_of(c) * d + c.n_layers * layer + 2 * d * CLASSES))

    def build_datasets(self):
        c = self.cfg
        if not c.data_dir:
            train, evals = load_digits_split(c)
        else:
            folder = text_path(c.data_dir)
            train, evals = load_mnist_split(folder, "train"), load_mnist_split(folder, "test")
        return TensorSet(*train), TensorSet(*evals)

    def compute(self, model: nn.Module, batch) -> TaskOutput:
        x, y = batch
        logits, aux, load, dropped, routed = model(x)
        ce = F.cross_entropy(at_least_fp32(logits), y)
        accuracy = (logits.argmax(-1) == y).float().mean()
        metrics = {"accuracy": accuracy, "dropped": dropped}
        metrics.update((f"expert_load/{i}", share) for i, share in enumerate(load))
        if model.training:
            metrics.update(ce=ce.detach(), aux_loss=aux.detach())
            loss = ce + self.cfg.aux_loss_coef * aux
            return TaskOutput(loss=loss, samples=len(y), metrics=metrics)
        # Each sample's assignments as shares (k × layers of them), summed per class over
        # the batch: the eval averages them into shares of every eval assignment.
        shares = F.one_hot(routed, self.cfg.num_experts).float().mean(1)  # (batch, experts)
        joint = F.one_hot(y, CLASSES).float().t() @ shares / len(y)  # (classes, experts)
        for c in range(CLASSES):
            metrics.update((f"routed/{c}/{e}", v) for e, v in enumerate(joint[c]))
        return TaskOutput(loss=ce, samples=len(y), metrics=metrics)

    def on_eval_end(self, model: nn.Module, metrics, ctx) -> dict[str, float]:
        """The expert activations per class: each class's assignments as shares over the
        experts (a class the eval set lacks: none)."""
        out: dict[str, float] = {}
        for c in range(CLASSES):
            row = [metrics.get(f"routed/{c}/{e}", 0.0) for e in range(self.cfg.num_experts)]
            total = sum(row)
            if total > 0:
                out.update((f"expert_class/{c}/{e}", v / total) for e, v in enumerate(row))
        return out

    def on_step_end(self, model: nn.Module, output: TaskOutput, ctx) -> None:
        """The dropped-share warning: the mean over each log interval, agreed over the ranks
        at the log step (one small all-reduce), counted in consecutive log steps above
        ``drop_warn_share``."""
        c = self.cfg
        dropped = output.metrics.get("dropped")
        if not c.drop_warn_logs or dropped is None:
            return
        self._drop_sum = self._drop_sum + dropped.detach().double()
        self._drop_steps += 1
        every = ctx.profile.train.log_every
        if not every or ctx.step % every:
            return
        f64 = {"dtype": torch.float64, "device": ctx.device}
        total = torch.as_tensor(self._drop_sum, **f64).reshape(())
        both = torch.stack([total, torch.tensor(float(self._drop_steps), **f64)])
        if ctx.world_size > 1 and dist.is_initialized():
            dist.all_reduce(both)
        share = float(both[0] / both[1].clamp(min=1))
        self._drop_sum, self._drop_steps = 0.0, 0
        self._streak = self._streak + 1 if share > c.drop_warn_share else 0
        if self._streak == c.drop_warn_logs and ctx.rank == 0:
            ctx.log(
                f"{share:.1%} of the expert assignments dropped past capacity at step "
                f"{ctx.step}: above task.drop_warn_share = {c.drop_warn_share:g} for "
                f"{c.drop_warn_logs} consecutive log steps (raise task.capacity_factor or "
                "task.aux_loss_coef)",
                level="warning",
            )
