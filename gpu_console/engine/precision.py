"""Mixed precision: which dtype a run uses, its autocast context, and its GradScaler."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

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
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


def make_scaler(
    precision: str, device_type: str, init_scale: float = 65536.0
) -> torch.amp.GradScaler | None:
    """fp16 on CUDA needs loss scaling (from ``train.loss_scale_init``); bf16 has fp32's
    range and needs none."""
    if precision == "fp16" and device_type == "cuda":
        return torch.amp.GradScaler("cuda", init_scale=init_scale)
    return None


# train.precision = "fp64": the model's and the batches' floating tensors in float64, no
# autocast, and the step table in float64, so a loss is reported as the task computed it.


def cast_model(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The model in float64 under fp64 (its floating parameters and buffers); else as built."""
    return model.to(torch.float64) if precision == "fp64" else model


def collate_in(precision: str, collate: Any) -> Any:
    """A loader's collate (None: torch's default) that, under fp64, gives its batches'
    floating tensors in float64 (integers, labels and masks kept); else ``collate``."""
    if precision != "fp64":
        return collate
    from torch.utils.data import default_collate

    return functools.partial(_fp64_batch, collate or default_collate)  # picklable: workers


def _fp64_batch(collate: Any, samples: Any) -> Any:
    return _tree_map(collate(samples), _double)


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def table_dtype(precision: str) -> torch.dtype:
    """The step table's dtype (exchange.py): float64 under fp64, else float32."""
    return torch.float64 if precision == "fp64" else torch.float32


def _tree_map(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)((k, _tree_map(v, fn)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_tree_map(v, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_tree_map(v, fn) for v in x)
    return x
