"""Which rank is which process on which GPU, and NVML's view of its memory.

CUDA numbers GPUs fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; NVML numbers them
by PCI bus. An index alone can point at the wrong GPU, so ranks are matched to GPUs by UUID:
first from NVML's per-GPU process lists (exact, by pid), else from the worker's own
``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK`` when the order makes that unambiguous.

NVML's per-process "used" memory includes what PyTorch's allocator does not see (the CUDA
context, cuBLAS/cuDNN workspaces, NCCL buffers), so it is put beside the allocator's
``reserved`` from the engine's ``step`` events: the difference is memory a person would
otherwise hunt for.

Everything here works on plain JSON samples (as written to ``telemetry.jsonl``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def nvml_memory_by_pid(sample: dict[str, Any], pids: Iterable[int]) -> dict[int, list[dict]]:
    """pid → the GPUs it holds memory on, from the sample's NVML compute-process lists.

    Each entry is ``{"gpu": index, "uuid": ..., "used_memory": bytes or None}``. A rank that
    also appears on another GPU has a stray CUDA context there (a classic ``cuda:0`` bug).
    """
    wanted = set(pids)
    out: dict[int, list[dict]] = {}
    for gpu in sample.get("gpus") or ():
        for proc in gpu.get("processes") or ():
            if proc.get("pid") in wanted:
                out.setdefault(proc["pid"], []).append(
                    {
                        "gpu": gpu.get("index"),
                        "uuid": gpu.get("uuid"),
                        "used_memory": proc.get("used_memory"),
                    }
                )
    return out


def visible_uuids(
    cuda_visible_devices: str | None, device_order: str | None, gpus: list[dict[str, Any]]
) -> list[str] | None:
    """CUDA index → UUID, as a list; None when CUDA's numbering cannot be known from here."""
    by_index = {g.get("index"): g.get("uuid") for g in gpus}
    all_uuids = [g.get("uuid") for g in sorted(gpus, key=lambda g: g.get("index", 0))]
    if cuda_visible_devices is None:
        entries = [str(i) for i in range(len(gpus))]
    else:
        entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    pci_order = (device_order or "").upper() == "PCI_BUS_ID"
    out: list[str] = []
    for entry in entries:
        if entry.isdigit():
            # Without PCI_BUS_ID, CUDA's indices follow speed, not NVML's bus order.
            if not pci_order and len(gpus) > 1:
                return None
            uuid = by_index.get(int(entry))
        elif entry.startswith("GPU-"):
            matches = [u for u in all_uuids if isinstance(u, str) and u.startswith(entry)]
            uuid = matches[0] if len(matches) == 1 else None
        else:  # MIG instances and anything else: not a whole GPU NVML lists by index
            return None
        if not isinstance(uuid, str):
            return None
        out.append(uuid)
    return out


def rank_gpus(sample: dict[str, Any]) -> list[dict[str, Any]]:
    """For each worker of the run in ``sample``: its rank, pid, GPU and NVML memory.

    ``source`` says how the GPU was found: ``"nvml"`` (the process list), ``"env"``
    (CUDA_VISIBLE_DEVICES and LOCAL_RANK) or ``None`` (not on a GPU, or unknown).
    """
    gpus = sample.get("gpus") or []
    workers = [p for p in (sample.get("host") or {}).get("processes", ()) if p["role"] == "worker"]
    held = nvml_memory_by_pid(sample, (w["pid"] for w in workers))
    index_of = {g.get("uuid"): g.get("index") for g in gpus}
    rows = []
    for w in sorted(workers, key=lambda w: (w.get("rank") is None, w.get("rank"), w["pid"])):
        on = held.get(w["pid"], [])
        uuid = source = None
        if on:
            # The GPU it holds most memory on is its own; others are stray contexts.
            main = max(on, key=lambda e: e["used_memory"] or 0)
            uuid, source = main["uuid"], "nvml"
        elif gpus and w.get("local_rank") is not None:
            mapping = visible_uuids(w.get("cuda_visible_devices"), w.get("cuda_device_order"), gpus)
            if mapping is not None and w["local_rank"] < len(mapping):
                uuid, source = mapping[w["local_rank"]], "env"
        used = [e["used_memory"] for e in on if e["uuid"] == uuid]
        rows.append(
            {
                "rank": w.get("rank"),
                "pid": w["pid"],
                "gpu": index_of.get(uuid) if uuid else None,
                "uuid": uuid,
                "source": source,
                "nvml_used": used[0] if used else None,
                "stray": [e for e in on if e["uuid"] != uuid],
            }
        )
    return rows
