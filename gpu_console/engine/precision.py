"""Mixed precision: which dtype a run uses, its autocast context, and its GradScaler."""

from __future__ import annotations

import contextlib

import torch

from ..devices import bf16_native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    pass


def resolve(requested: str, device_type: str, capability: tuple[int, int] | None) -> str:
    """``auto`` → bf16 on CUDA ≥ 8.0, fp16 on older GPUs, fp32 on CPU.

    On CPU, autocast costs more than it saves for the small models a CPU trains; ask for
    bf16 explicitly where the CPU has native bf16 (AMX/AVX512-BF16) and the model is large.
    """
    if device_type == "cuda":
        bf16_ok = bf16_native(capability)  # the rule launch and check apply too
        if requested == "auto":
            return "bf16" if bf16_ok else "fp16"
        if requested == "bf16" and not bf16_ok:
            has = f"{capability[0]}.{capability[1]}" if capability else "an unknown capability"
            raise PrecisionError(
                f"train.precision: bf16 needs compute capability 8.0 or newer; this GPU has "
                f"{has} (got 'bf16')"
            )
        return requested
    if requested == "auto":
        return "fp32"
    return requested


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def make_scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """fp16 on CUDA needs loss scaling; bf16 has fp32's range and needs none."""
    if precision == "fp16" and device_type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None
