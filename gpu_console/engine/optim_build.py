"""The profile's optimizer (``train.optimizer``: AdamW, Adam or SGD), its kernel chosen for
the device. A task's ``configure_optimizers()`` replaces it (engine/optim_set.py).

PyTorch's optimizers pick their own implementation only on GPUs (foreach); on CPU they fall to
a Python loop over parameters, which for a small model costs more than the step's forward
pass. ``train.optimizer_impl = "auto"`` uses the fused kernel (all parameters in one
kernel) on CPU and CUDA alike, where this torch has it, else foreach. All implementations
compute the same update up to float rounding; each is deterministic.

Which parameters decay (``train.weight_decay_params``): ``matrices``, the convention of
nanoGPT and timm, decays the weight matrices of layers that multiply (≥ 2 dimensions) and
leaves biases, norm weights, embeddings and what the model names in its ``no_weight_decay()``
(timm's convention; the built-in transformer names its positional parameter) undecayed:
decaying them pulls scales and lookup rows towards zero without regularising anything.
``all`` decays every parameter. A task with a ``param_groups(model)`` method decides itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import torch_private

if TYPE_CHECKING:
    from ..profile import TrainConfig

# Modules whose parameters never decay under "matrices", whatever their shape.
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_NORMS = torch_private.norm_layer_types()


def resolve_impl(requested: str, device_type: str, fused_ok: bool = True) -> str:
    """``auto`` → ``fused`` where this torch has a fused AdamW for the device and the run's
    GradScaler lets it step (devices.fused_steps_ok), else foreach."""
    if requested != "auto":
        return requested
    fused = fused_ok and device_type in torch_private.fused_kernel_devices()
    return "fused" if fused else "foreach"


def adamw_kwargs(impl: str) -> dict[str, bool]:
    """The optimizer's keyword for a resolved implementation: fused, foreach or for-loop."""
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


class ParamGroupError(ValueError):
    """A task's ``param_groups`` that the optimizer cannot take; the message says why."""


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameter names that do not decay under ``matrices``.

    A module's ``no_weight_decay()`` names parameters relative to itself (timm's models
    define it at the top, so the names are the model's own).
    """
    names: set[str] = set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        keep = isinstance(module, _EMBEDDINGS + _NORMS)
        for name, q in module.named_parameters(recurse=False):
            if keep or q.ndim < 2:
                names.add(dot + name)
        if callable(getattr(module, "no_weight_decay", None)):
            names.update(dot + name for name in module.no_weight_decay())
    return names


def default_groups(model: nn.Module, weight_decay: float, which: str) -> list[dict[str, Any]]:
    """The trainable parameters in a decayed and a not-decayed group (``which = "all"``: one)."""
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    if which == "all":
        return [{"params": [q for _, q in named], "weight_decay": weight_decay}]
    skip = no_decay_names(model)
    decay = [q for n, q in named if n not in skip]
    rest = [q for n, q in named if n in skip]
    return [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0},
        )
        if g["params"]
    ]


def task_groups(
    task: object, model: nn.Module, scale_lr: Callable[[float], float]
) -> list[dict[str, Any]] | None:
    """The task's own groups, checked; a group's ``lr`` is scaled like ``train.lr``."""
    hook = getattr(task, "param_groups", None)
    if hook is None:
        return None
    groups = []
    for i, group in enumerate(hook(model)):
        if not isinstance(group, dict) or "params" not in group:
            raise ParamGroupError(
                f"task.param_groups: group {i} must be a dict with 'params' (got {group!r:.80})"
            )
        group = dict(group, params=list(group["params"]))
        if "lr" in group:
            group["lr"] = scale_lr(float(group["lr"]))
        groups.append(group)
    grouped = {id(q) for g in groups for q in g["params"]}
    missing = [n for n, q in model.named_parameters() if q.requires_grad and id(q) not in grouped]
    if missing:
        raise ParamGroupError(
            f"task.param_groups: {len(missing)} trainable parameters are in no group "
            f"(first: {missing[0]!r}); set requires_grad = False on those the model freezes"
        )
    return groups


@dataclass
class DecaySplit:
    """How many parameters decay: shown in the start event."""

    source: str  # "matrices", "all" or "task"
    decayed_tensors: int = 0
    decayed_params: int = 0
    other_tensors: int = 0
    other_params: int = 0

    @classmethod
    def of(cls, source: str, groups: list[dict[str, Any]], default_wd: float) -> DecaySplit:
        split = cls(source)
        for g in groups:
            decays = g.get("weight_decay", default_wd) > 0
            n, size = len(g["params"]), sum(q.numel() for q in g["params"])
            if decays:
                split.decayed_tensors += n
                split.decayed_params += size
            else:
                split.other_tensors += n
                split.other_params += size
        return split

    def fields(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "decayed": {"tensors": self.decayed_tensors, "params": self.decayed_params},
            "not_decayed": {"tensors": self.other_tensors, "params": self.other_params},
        }


def groups(
    task: object, model: nn.Module, train: TrainConfig, scale_lr: Callable[[float], float]
) -> tuple[list[dict], DecaySplit]:
    """The optimizer's parameter groups: the task's own, else by ``train.weight_decay_params``."""
    own = task_groups(task, model, scale_lr)
    source = "task" if own is not None else train.weight_decay_params
    chosen = own if own is not None else default_groups(model, train.weight_decay, source)
    return chosen, DecaySplit.of(source, chosen, train.weight_decay)


def load_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The checkpoint's optimizer state, or why its groups do not fit this run's."""
    theirs = [len(g["params"]) for g in state["param_groups"]]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != ours:
        raise ParamGroupError(
            f"the checkpoint's optimizer has parameter groups of {theirs} tensors, this run's "
            f"{ours}: train.weight_decay_params or the task's param_groups differ from the "
            "run that wrote it (a checkpoint from before the decay groups has one group: "
            'resume it with --set train.weight_decay_params="all")'
        )
    optimizer.load_state_dict(state)


def build(
    params: Iterable[torch.nn.Parameter] | list[dict[str, Any]],
    lr: float,
    weight_decay: float,
    impl: str,
    device_type: str,
) -> torch.optim.AdamW:
    kwargs: dict[str, Any] = adamw_kwargs(resolve_impl(impl, device_type))
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)


def build_profile(
    groups: list[dict[str, Any]], lr: float, train, device_type: str, fused_ok: bool = True
) -> torch.optim.Optimizer:
    """``train.optimizer`` with the profile's settings (AdamW's are :func:`build`'s exactly)."""
    kwargs = adamw_kwargs(resolve_impl(train.optimizer_impl, device_type, fused_ok))
    if train.optimizer == "sgd":
        return torch.optim.SGD(
            groups,
            lr=lr,
            momentum=train.momentum,
            nesterov=train.nesterov,
            weight_decay=train.weight_decay,
            **kwargs,
        )
    cls = torch.optim.Adam if train.optimizer == "adam" else torch.optim.AdamW
    betas = (float(train.betas[0]), float(train.betas[1]))
    return cls(groups, lr=lr, betas=betas, eps=train.eps, weight_decay=train.weight_decay, **kwargs)


def implementation(opt: torch.optim.Optimizer) -> str:
    """``default`` where the optimizer was left to choose (foreach on GPUs, else for-loop)."""
    d = opt.defaults
    if d.get("fused"):
        return "fused"
    return "default" if d.get("foreach") is None else "foreach" if d["foreach"] else "for-loop"
