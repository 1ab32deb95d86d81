"""A warning before a GPU runs out of memory, from the numbers every log step's rows carry.

Two signs, each a ``log`` warning event (headless prints it, the run screen lists it):

- a GPU's memory in use (by every process on it, as ``cudaMemGetInfo`` counts) reaches
  ``hardware.memory_warn_fraction`` of its total: said once, and again only after it fell
  5 points below;
- the CUDA caching allocator retried allocations (``num_alloc_retries``: an allocation that
  failed, then fit once the allocator had freed its cache and synchronised, a stall each
  time; torchtitan counts them too): said at the first, then each time the count doubled.

Rank 0 judges every rank's row; the ranks that cross together are one line. CPU rows carry
zeros: nothing to judge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..format import human_bytes
from .exchange import Row

REARM = 0.05  # below the threshold by this much, a GPU may be said nearly full again


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class MemoryWatch:
    def __init__(self, fraction: float, warn: Callable[[str], None]):
        self.fraction = fraction  # 0: the nearly-full warning is off
        self.warn = warn
        self.full: set[int] = set()  # ranks said nearly full and not fallen back since
        self.retries: dict[int, int] = {}  # each rank's count at its last retry warning

    def check(self, step: int, rows: Sequence[Row]) -> None:
        full, retried = [], []
        for rank, r in enumerate(rows):
            if r.device_total <= 0:
                continue
            used = r.device_used / r.device_total
            if self.fraction and used >= self.fraction and rank not in self.full:
                self.full.add(rank)
                full.append((rank, used, r.device_total))
            elif rank in self.full and used < self.fraction - REARM:
                self.full.discard(rank)
            said = self.retries.get(rank, 0)
            if r.alloc_retries > said and r.alloc_retries >= 2 * said:
                self.retries[rank] = r.alloc_retries
                retried.append((rank, r.alloc_retries))
        if full:
            worst = max(full, key=lambda f: f[1])
            self.warn(
                f"GPU memory nearly full at step {step}: {_ranks([f[0] for f in full])} "
                f"{worst[1]:.1%} of {human_bytes(worst[2])} in use "
                f"(hardware.memory_warn_fraction = {self.fraction:g}); next the allocator "
                "retries, then a rank runs out: a smaller data.batch_size, "
                "train.activation_checkpointing or bf16 make room"
            )
        if retried:
            counts = ", ".join(f"{n:,}" for _, n in retried)
            self.warn(
                f"the CUDA caching allocator retried allocations by step {step} "
                f"({_ranks([r for r, _ in retried])}: {counts} in all): each freed its cache "
                "and waited for the GPU, a slower step; memory is nearly full or fragmented "
                "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller batch helps)"
            )
