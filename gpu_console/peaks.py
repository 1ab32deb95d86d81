"""Peak dense FLOP/s of NVIDIA GPUs, by the name NVML and CUDA report, for MFU (no torch).

MFU (model FLOPs utilisation) is the model's FLOPs per second over what the GPUs could do
at their peak: ``flops_per_sample × samples_per_s / (peak × GPUs)``. The peaks are the
vendor's datasheet numbers for **dense** math (never the "with sparsity" figures, which are
twice as large), per precision of the matmuls:

- ``bf16`` / ``fp16``: tensor cores with FP32 accumulation, which is what autocast uses (on
  GeForce cards that is half the FP16-accumulate rate the marketing quotes);
- ``tf32``: fp32 runs whose matmuls may use TF32 (``hardware.tf32 = true``, the default);
- ``fp32``: plain FP32 (CUDA cores).

An unknown GPU gets no peak and the console says "MFU not shown" with the name it did not
know: a wrong peak would be worse than none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class Peak:
    gpu: str  # the table's name for the model, e.g. "H100 SXM"
    precision: str  # "bf16", "fp16", "tf32" or "fp32"
    flops: float  # dense FLOP/s of one GPU
    source: str  # where the number comes from

    def describe(self) -> str:
        return f"{self.gpu} {self.precision} dense {self.flops / TERA:,.1f} TFLOP/s ({self.source})"


class UnknownPeak(LookupError):
    """No peak for this device and precision; the message says why (shown as is)."""


# (name, patterns the normalised device name must match in full, TFLOP/s dense by
# precision, source). Normalised: lower case, no "nvidia"/"geforce", "-" as a space.
_TABLE: list[tuple[str, tuple[str, ...], dict[str, float], str]] = [
    (
        "H100 SXM",
        (r"h100( sxm5?)?( \d+gb)?( hbm3e?)?", r"gh200( \d+gb)?"),
        {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
        "NVIDIA H100 datasheet, SXM",
    ),
    (
        "H100 PCIe",
        (r"h100( \d+gb)? pcie( \d+gb)?",),
        {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
        "NVIDIA H100 datasheet, PCIe",
    ),
    (
        "H100 NVL",
        (r"h100 nvl",),
        {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
        "NVIDIA H100 datasheet, NVL",
    ),
    (
        "H200",
        (r"h200( sxm\w*)?( \d+gb)?( hbm3e)?",),
        {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
        "NVIDIA H200 datasheet, SXM",
    ),
    (
        "H200 NVL",
        (r"h200 nvl",),
        {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
        "NVIDIA H200 datasheet, NVL",
    ),
    (
        "A100",
        (r"a100( sxm4| pcie)?( \d+gb)?( pcie)?",),
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
        "NVIDIA A100 datasheet (SXM and PCIe, 40 and 80 GB alike)",
    ),
    (
        "L40S",
        (r"l40s",),
        {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
        "NVIDIA L40S datasheet",
    ),
    (
        "L4",
        (r"l4",),
        {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
        "NVIDIA L4 datasheet",
    ),
    (
        "A10",
        (r"a10",),
        {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
        "NVIDIA A10 datasheet",
    ),
    (
        "RTX 4090",
        (r"rtx 4090",),
        {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
        "NVIDIA Ada whitepaper, FP32 accumulate",
    ),
    (
        "RTX 3090",
        (r"rtx 3090",),
        {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
        "NVIDIA Ampere GA102 whitepaper, FP32 accumulate",
    ),
]

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def normalise(name: str) -> str:
    n = name.lower().replace("-", " ").replace("_", " ")
    n = re.sub(r"\b(nvidia|geforce|tesla)\b", " ", n)
    return " ".join(n.split())


def matmul_precision(precision: str, tf32: bool) -> str:
    """The precision the run's matmuls use: fp32 runs use TF32 where it is allowed."""
    return "tf32" if precision == "fp32" and tf32 else precision


def peak_for(device_name: str, precision: str) -> Peak:
    """The dense peak of one GPU named ``device_name`` (as NVML/CUDA name it) at
    ``precision`` (see :func:`matmul_precision`); :class:`UnknownPeak` says why not."""
    if precision not in PRECISIONS:
        raise UnknownPeak(f"no peak for precision {precision!r}: MFU not shown")
    key = normalise(device_name)
    for gpu, patterns, tflops, source in _TABLE:
        if any(re.fullmatch(p, key) for p in patterns):
            return Peak(gpu, precision, tflops[precision] * TERA, source)
    raise UnknownPeak(f"unknown GPU {device_name!r}: MFU not shown")


def mfu(flops_per_sample: float | None, samples_per_s: float | None, peak_total: float | None):
    """Model FLOPs utilisation in [0, 1] (None when any part is unknown)."""
    if not flops_per_sample or samples_per_s is None or not peak_total:
        return None
    return flops_per_sample * samples_per_s / peak_total
