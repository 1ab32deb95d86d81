"""Per-rank memory: the CUDA allocator's view on GPU, the process's on CPU."""

from __future__ import annotations

import os
import resource

import torch


def memory_sample(device: torch.device) -> list[int]:
    """[allocated, reserved, peak] bytes of this rank, then on a GPU [the allocator's retries,
    the device's memory in use by every process, its total] (zeros on CPU)."""
    if device.type == "cuda":
        # A retry: an allocation that failed, then succeeded once the allocator had freed its
        # cache and synchronised (torchtitan counts them too): memory nearly full.
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        free, total = torch.cuda.mem_get_info(device)
        return [
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
            retries,
            total - free,
            total,
        ]
    rss = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return [rss, rss, max(peak, rss), 0, 0, 0]


# /proc/self/statm kept open, with the pid it was opened by: "self" is resolved at open, so a
# forked child (a data worker) opens its own.
_statm: tuple[int, int] | None = None


def _rss_bytes() -> int:
    """The resident set: the second field of ``/proc/self/statm``, in pages. The file stays
    open (a ``pread`` at offset 0 reads it afresh): opening it at every log step cost ten
    times as much on a cold cache as the read itself (issue 26)."""
    global _statm
    try:
        if _statm is None or _statm[0] != os.getpid():
            _statm = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0
