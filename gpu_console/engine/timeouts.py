"""The two timeouts of a run's collectives: start-up's, then training's.

Until every rank has finished its first training step, a collective waits up to
``distributed.startup_timeout_s``: the process group's creation, the build's collectives
while another rank compiles, searches a batch size or loads a checkpoint, and the first
step's own (a first compile runs inside it). From then on ``distributed.collective_timeout_s``:
a hung step fails the run within it, and a slow first compile no longer does.

The switch, once: a barrier under the start-up timeout (every rank has finished its first
step), then the default group's timeout (``torch_private.set_group_timeout``) and the
shared-memory reduce's wait (shared_reduce.py). A torch that cannot change the group's keeps
the start-up timeout for the whole run, both of them, and says so in one warning.

Left as they are, on purpose: the checkpoint write group (hours: ranks wait there for rank 0's
write, ``checkpoint.write_group``), the failure agreement group (seconds,
failure_checkpoint.py), and a task's own groups (a task names their timeout, else torch's
default).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..profile import DistributedConfig
from . import torch_private


class PhaseTimeouts:
    def __init__(self, cfg: DistributedConfig, shared: Any = None) -> None:
        self.startup_s = cfg.startup_timeout_s
        self.collective_s = cfg.collective_timeout_s
        self.shared = shared  # the shared-memory reduce (CPU ranks on one machine), or None
        self.pending = self.startup_s != self.collective_s
        if shared is not None:  # its waits are collectives too: the same two phases
            shared.timeout_s, shared.timeout_key = self.startup_s, "distributed.startup_timeout_s"

    def start_fields(self) -> dict[str, Any]:
        return {"timeouts": {"startup_s": self.startup_s, "collective_s": self.collective_s}}

    def first_step_done(self, log) -> None:
        """Every rank, after each step; acts once, after the first (a collective then)."""
        if not self.pending:
            return
        self.pending = False
        if not dist.is_available() or not dist.is_initialized():
            return
        dist.barrier()  # every rank's first step is done: nothing of start-up is left
        why_not = torch_private.set_group_timeout(self.collective_s)
        if why_not is not None:
            log(
                "warning",
                f"distributed.collective_timeout_s = {self.collective_s:g} s cannot be set "
                f"after the first step ({why_not}): collectives keep "
                f"distributed.startup_timeout_s = {self.startup_s:g} s for the whole run",
            )
            return
        if self.shared is not None:
            self.shared.timeout_s = self.collective_s
            self.shared.timeout_key = "distributed.collective_timeout_s"
