"""Per-rank memory: the CUDA allocator's view on GPU, the process's on CPU."""

from __future__ import annotations

import resource

import torch


def memory_sample(device: torch.device) -> list[int]:
    """[allocated, reserved, peak] bytes of this rank."""
    if device.type == "cuda":
        return [
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
        ]
    rss = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return [rss, rss, max(peak, rss)]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0
