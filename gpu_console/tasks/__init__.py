"""Tasks: a model, its data and its loss. This module never imports torch.

Built-in tasks are named here with their config class (defined in :mod:`.configs`, which is
torch-free too) so the console can validate a profile without importing the model code.
A user's task is named by import path, ``"my_pkg.tasks:MyTask"``; see :mod:`.base`.
"""

from __future__ import annotations

from .configs import (
    Autoencoder3DConfig,
    CVRPConfig,
    HFConfig,
    LMConfig,
    MLPConfig,
    MoEConfig,
    MoEImageConfig,
    TransformerConfig,
)

BUILTIN: dict[str, tuple[str, type]] = {
    "mlp": ("gpu_console.tasks.mlp:MLPTask", MLPConfig),
    "transformer": ("gpu_console.tasks.transformer:TransformerTask", TransformerConfig),
    "autoencoder3d": (
        "gpu_console.tasks.autoencoder3d:Autoencoder3DTask",
        Autoencoder3DConfig,
    ),
    "lm": ("gpu_console.tasks.lm:LMTask", LMConfig),
    "cvrp": ("gpu_console.tasks.cvrp:CVRPTask", CVRPConfig),
    "hf": ("gpu_console.tasks.hf:HFTask", HFConfig),
    "moe": ("gpu_console.tasks.moe:MoETask", MoEConfig),
    "moe_mnist": ("gpu_console.tasks.moe_mnist:MoEImageTask", MoEImageConfig),
}

# Built-in tasks that name their blocks (``blocks``) for activation checkpointing.
WITH_BLOCKS = frozenset({"transformer", "lm", "moe", "autoencoder3d"})


def is_import_path(kind: str) -> bool:
    module, sep, attr = kind.partition(":")
    return bool(sep) and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()


def import_target(kind: str) -> str:
    """The ``module:attr`` that implements task ``kind``."""
    return BUILTIN[kind][0] if kind in BUILTIN else kind
