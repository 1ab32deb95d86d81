"""The optimizer: AdamW, with the implementation chosen for the device.

PyTorch's AdamW picks its own implementation only on GPUs (foreach); on CPU it falls back to
a Python loop over parameters, which for a small model costs more than the step's forward
pass. ``train.optimizer_impl = "auto"`` uses the fused kernel (all parameters in one
kernel) on CPU and CUDA alike, where this torch has it, else foreach. All implementations
compute the same update up to float rounding; each is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def resolve_impl(requested: str, device_type: str) -> str:
    """``auto`` → ``fused`` where this torch has a fused AdamW for the device, else foreach."""
    if requested != "auto":
        return requested
    try:  # private, but the list AdamW itself checks ``fused=True`` against
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        fused = device_type in _get_fused_kernels_supported_devices()
    except ImportError:
        fused = device_type == "cuda"
    return "fused" if fused else "foreach"


def adamw_kwargs(impl: str) -> dict[str, bool]:
    """AdamW's keyword for a resolved implementation: fused, foreach or for-loop."""
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


def build(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    impl: str,
    device_type: str,
) -> torch.optim.AdamW:
    kwargs = adamw_kwargs(resolve_impl(impl, device_type))
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)
