"""Where trials go: the granted devices cut into slots of one trial's devices each.

GPUs: a trial of ``g`` GPUs takes ``g`` of the granted ones (``--devices``, the grant), never
one another trial holds. CPU: a trial of ``cpu:k`` takes ``k`` of the cores this process may
run on, and its processes are pinned to them (the driver's affinity while it starts the trial),
so two trials never share a core and each rank's threads match its cores. No torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..devices import Placement, usable_cores
from .spec import cpu_ranks


@dataclass(frozen=True)
class Slot:
    index: int
    devices: str  # the trial's --devices: "cpu:2", "0,1"
    cores: tuple[int, ...] = ()  # the CPU cores a CPU trial is pinned to

    @classmethod
    def from_dict(cls, d: dict) -> Slot:
        return cls(d["index"], d["devices"], tuple(d["cores"]))

    def as_dict(self) -> dict:
        return {"index": self.index, "devices": self.devices, "cores": list(self.cores)}

    def describe(self) -> str:
        return self.devices if self.devices.startswith("cpu") else f"GPU {self.devices}"


def cut(pool: Placement, trial_devices: str) -> tuple[list[Slot], str]:
    """The slots, or ``[]`` and why a trial does not fit the pool (blamed on
    ``sweep.trial_devices`` by the caller)."""
    ranks = cpu_ranks(trial_devices)
    if pool.device_type == "cpu":
        if ranks is None:
            return [], (
                f"a trial of {trial_devices} GPU(s), but the sweep's devices are "
                f"{pool.nproc} CPU ranks (no GPU granted); use cpu:N"
            )
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = cores[: pool.nproc] if len(cores) >= pool.nproc else []
        n = pool.nproc // ranks
        if n == 0:
            return [], f"a trial needs {ranks} CPU ranks, the sweep has {pool.nproc}"
        return [
            Slot(i, f"cpu:{ranks}", tuple(cores[i * ranks : (i + 1) * ranks]) if cores else ())
            for i in range(n)
        ], ""
    gpus = [g for g in pool.gpus if g is not None]
    if ranks is not None:
        return [], (
            f"a trial of {trial_devices}, but the sweep's devices are GPUs "
            f"{','.join(map(str, gpus))}; give a GPU count, or --devices cpu:N"
        )
    per = int(trial_devices)
    n = len(gpus) // per
    if n == 0:
        return [], f"a trial needs {per} GPUs, the sweep is granted {len(gpus)}"
    return [Slot(i, ",".join(str(g) for g in gpus[i * per : (i + 1) * per])) for i in range(n)], ""


def cores_note(slots: list[Slot]) -> str:
    """Said when CPU trials share the machine with more cores than they were given."""
    used = sum(len(s.cores) for s in slots)
    if slots and slots[0].cores and used < usable_cores():
        return f"sweep: {len(slots)} trials at a time on {used} of {usable_cores()} cores"
    return ""
