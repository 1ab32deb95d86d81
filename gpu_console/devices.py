"""``--devices`` specs: parsing (no hardware) and resolution against what is visible."""

from __future__ import annotations

import os
from dataclasses import dataclass


class DeviceSpecError(ValueError):
    """A device spec that is malformed or names devices this machine does not have."""


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "auto", "cuda" or "cpu"
    indices: tuple[int, ...] = ()  # GPU indices for "cuda"
    nproc: int | None = None  # CPU ranks for "cpu" (None: the default)


@dataclass(frozen=True)
class Placement:
    """Where a run's local ranks go: device type, rank count, and the CUDA mask."""

    device_type: str  # "cuda" or "cpu"
    nproc: int
    cuda_visible_devices: str | None = None

    def cpu_threads_per_rank(self) -> int:
        """Each CPU rank's share of the usable cores: none idle, none oversubscribed.

        torchrun's own default is one thread per rank however many cores there are.
        """
        return max(1, len(os.sched_getaffinity(0)) // max(self.nproc, 1))

    def describe(self) -> str:
        if self.device_type == "cpu":
            return f"cpu × {self.nproc} ranks"
        return f"GPU {self.cuda_visible_devices} ({self.nproc} ranks)"


def parse_devices(text: str) -> DeviceSpec:
    text = text.strip().lower()
    if text == "auto":
        return DeviceSpec("auto")
    if text == "cpu":
        return DeviceSpec("cpu")
    if text.startswith("cpu:"):
        n = text[4:]
        if not n.isdigit() or int(n) < 1:
            raise DeviceSpecError(f"expected cpu:N with N ≥ 1 (got {text!r})")
        return DeviceSpec("cpu", nproc=int(n))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise DeviceSpecError(f"expected auto, cpu, cpu:N or GPU indices like 0,1 (got {text!r})")
    indices = tuple(int(p) for p in parts)
    if len(set(indices)) != len(indices):
        raise DeviceSpecError(f"a GPU is listed twice (got {text!r})")
    return DeviceSpec("cuda", indices=indices)


def default_cpu_ranks() -> int:
    """Two ranks by default: enough to exercise DDP, and one per core on small machines."""
    return max(1, min(2, len(os.sched_getaffinity(0))))


def place(spec: DeviceSpec, gpu_count: int, no_gpu_reason: str = "") -> Placement:
    """Resolve a spec against the GPUs NVML sees; raise DeviceSpecError if impossible."""
    if spec.kind == "cpu":
        return Placement("cpu", spec.nproc or default_cpu_ranks())
    if spec.kind == "auto":
        if gpu_count > 0:
            return Placement("cuda", gpu_count, ",".join(str(i) for i in range(gpu_count)))
        return Placement("cpu", default_cpu_ranks())
    if gpu_count == 0:
        why = f": {no_gpu_reason}" if no_gpu_reason else ""
        raise DeviceSpecError(f"no GPU is visible{why}; use cpu or cpu:N")
    missing = [i for i in spec.indices if i >= gpu_count]
    if missing:
        raise DeviceSpecError(
            f"GPU {', '.join(map(str, missing))} does not exist (this machine has {gpu_count}: "
            f"0..{gpu_count - 1})"
        )
    return Placement("cuda", len(spec.indices), ",".join(map(str, spec.indices)))
