"""``--devices`` specs: parsing (no hardware), the GPUs the environment grants, placement.

A shared node's NVML sees every GPU; the user may use only those the environment grants:
``CUDA_VISIBLE_DEVICES`` (indices or ``GPU-``/``MIG-`` UUIDs, read as CUDA reads it), else
SLURM's ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``. A run uses the grant ∩ ``--devices``, and its
ranks name their GPUs by UUID, so CUDA's own numbering (fastest first, unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) can never put a rank on someone else's GPU.

``--devices 2,3`` numbers GPUs as NVML, ``nvidia-smi`` and ``gpu-console devices`` do (PCI bus
order), whatever the mask: the numbers do not shift when the mask changes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# bf16 in hardware: Ampere and newer. torch.cuda.is_bf16_supported() also counts emulation,
# which runs but is slower than fp32: check, auto and --precision bf16 all use this rule.
BF16_MIN_CAPABILITY = (8, 0)


def bf16_native(capability: Sequence[int] | None) -> bool:
    return capability is not None and tuple(capability[:2]) >= BF16_MIN_CAPABILITY


# MIG: each local rank's own CUDA_VISIBLE_DEVICES, in LOCAL_RANK order (launch.worker_env sets
# it, engine/__main__.py applies it before CUDA starts).
RANK_DEVICES = "GPU_CONSOLE_RANK_DEVICES"

FP16_NEEDS_GPU = "fp16 needs a GPU (its GradScaler is CUDA-only)"

# FSDP's sharded GradScaler (fp16 on a GPU) hands the optimizer a found-inf flag of shape [1];
# the fused Adam/AdamW/SGD kernels subtract it in place from step counts of shape [], which
# torch refuses at the first step (torch 2.11 on an H200; the same on CPU with torch 2.13).
FUSED_UNDER_SHARDED_SCALER = (
    "the fused optimizer kernels cannot step under FSDP's fp16 GradScaler (torch's sharded scaler)"
)


def fused_steps_ok(strategy: str, precision: str, device_type: str) -> bool:
    """Whether a fused optimizer can step under this strategy and precision."""
    return not (strategy == "fsdp" and precision == "fp16" and device_type == "cuda")


def precision_refusals(
    device_type: str, gpus: Sequence[int], capabilities: dict[int, Sequence[int] | None]
) -> dict[str, str]:
    """Which precisions a placement cannot run, and why: the one rule the launch and the
    launch screen apply. ``capabilities``: NVML's compute capability by GPU index (a GPU it
    does not know is not refused: the launch cannot tell)."""
    if device_type != "cuda":
        return {"fp16": FP16_NEEDS_GPU}
    old = [
        f"GPU {i} is {cc[0]}.{cc[1]}"
        for i in gpus
        if (cc := capabilities.get(i)) is not None and not bf16_native(cc)
    ]
    if old:
        return {"bf16": f"bf16 needs compute capability ≥ 8.0 ({', '.join(old)})"}
    return {}


class DeviceSpecError(ValueError):
    """A device spec that is malformed or names devices this machine does not have."""


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "auto", "cuda" or "cpu"
    indices: tuple[int, ...] = ()  # GPU indices for "cuda"
    nproc: int | None = None  # CPU ranks for "cpu" (None: the default)


@dataclass(frozen=True)
class Placement:
    """Where a run's local ranks go: device type, rank count, and the ranks' CUDA mask.

    ``cuda_visible_devices`` names the GPUs by UUID where NVML gives one; ``gpus`` are their
    NVML indices (None for a MIG instance). ``note``: a line the user should read (why an
    ``auto`` run is on the CPU, which GPUs a grant gave it).

    MIG instances: CUDA shows a process one MIG instance only, so each rank gets its own
    (:attr:`per_rank`: the engine sets the rank's ``CUDA_VISIBLE_DEVICES`` to its entry of
    the list before CUDA starts), and NCCL does not run across them: gloo does.
    """

    device_type: str  # "cuda" or "cpu"
    nproc: int
    cuda_visible_devices: str | None = None
    gpus: tuple[int | None, ...] = ()
    note: str = ""

    @property
    def per_rank(self) -> bool:
        """One device per rank, named in its own mask: MIG instances."""
        tokens = (self.cuda_visible_devices or "").split(",")
        return self.device_type == "cuda" and any(t.upper().startswith("MIG-") for t in tokens)

    def cpu_threads_per_rank(self) -> int:
        """Each CPU rank's share of the usable cores: none idle, none oversubscribed.

        torchrun's own default is one thread per rank however many cores there are.
        """
        return max(1, usable_cores() // max(self.nproc, 1))

    def describe(self) -> str:
        if self.device_type == "cpu":
            return f"cpu × {self.nproc} ranks"
        if self.per_rank:
            return f"{self.nproc} MIG instance{'s' if self.nproc > 1 else ''} (a rank each)"
        names = ",".join("MIG" if i is None else str(i) for i in self.gpus)
        return f"GPU {names or self.cuda_visible_devices} ({self.nproc} ranks)"


@dataclass(frozen=True)
class GrantedGpu:
    index: int | None  # NVML's index; None for a MIG instance (NVML lists whole GPUs)
    token: str  # how the ranks' CUDA_VISIBLE_DEVICES names it: its UUID where known
    parent: int | None = None  # a MIG instance's GPU, where NVML lists it

    @property
    def gpu(self) -> int | None:
        """The whole GPU's NVML index (a MIG instance's parent)."""
        return self.index if self.index is not None else self.parent


@dataclass(frozen=True)
class Grant:
    """The GPUs the environment lets this user run on, in the order CUDA numbers them.

    ``source``: the variable that granted them (None: nothing restricts, every GPU NVML
    sees); ``problem``: why the grant cannot be read safely (then nothing is granted).
    """

    source: str | None
    value: str | None
    gpus: tuple[GrantedGpu, ...]
    problem: str = ""
    seen: int = 0  # GPUs NVML sees, granted or not
    note: str = ""  # how the grant was read, where the user should know (SLURM's numbering)

    @property
    def indices(self) -> set[int]:
        return {g.gpu for g in self.gpus if g.gpu is not None}

    def owns(self, index: int) -> bool:
        return index in self.indices

    def describe(self) -> str:
        if self.source is None:
            return "every GPU (nothing restricts them)"
        return f"{self.source}={self.value}"

    @classmethod
    def everything(cls, count: int) -> Grant:
        return cls(None, None, tuple(GrantedGpu(i, str(i)) for i in range(count)), seen=count)


def read_grant(gpus: Sequence[Mapping[str, Any]], env: Mapping[str, str] | None = None) -> Grant:
    """What ``env`` (default: this process's) grants of ``gpus`` (NVML's identities:
    ``index``, ``uuid``, ``name``, ``compute_capability``)."""
    env = os.environ if env is None else env
    by_index = {g["index"]: g for g in gpus}
    mig_parent = {u: g["index"] for g in gpus for u in g.get("mig") or ()}

    def token(index: int) -> str:
        uuid = by_index[index].get("uuid")
        return uuid if isinstance(uuid, str) and uuid else str(index)

    def whole(index: int) -> list[GrantedGpu]:
        """A GPU as CUDA shows it: itself, or its MIG instances (a GPU in MIG mode)."""
        instances = by_index[index].get("mig") or ()
        if instances:
            return [GrantedGpu(None, u, index) for u in instances]
        return [GrantedGpu(index, token(index))]

    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
            value = env.get(var)
            if value is not None:
                return _slurm_grant(var, value, sorted(by_index), whole)
        everything = tuple(g for i in sorted(by_index) for g in whole(i))
        return Grant(None, None, everything, seen=len(gpus))
    entries = [e.strip() for e in mask.split(",")] if mask.strip() else []
    uuids: dict[int, str] = {g["index"]: g["uuid"] for g in gpus if isinstance(g.get("uuid"), str)}
    granted: list[GrantedGpu] = []
    named: set[str] = set()
    for entry in entries:
        # CUDA's rule: the list ends at the first entry it cannot use.
        if entry.isdigit():
            if int(entry) not in by_index:
                break
            gpu = GrantedGpu(int(entry), token(int(entry)))
        elif entry.upper().startswith("GPU-"):
            hits = [i for i, u in uuids.items() if u.lower().startswith(entry.lower())]
            if len(hits) != 1:
                break
            gpu = GrantedGpu(hits[0], token(hits[0]))
        elif entry.upper().startswith("MIG-"):
            gpu = GrantedGpu(None, entry, mig_parent.get(entry))
        else:
            break
        if gpu.token in named:
            break
        named.add(gpu.token)
        granted.append(gpu)
    numeric = any(e.isdigit() for e in entries)
    kinds = {(g.get("name"), _cc(g.get("compute_capability"))) for g in gpus}
    pci_order = env.get("CUDA_DEVICE_ORDER", "").upper() == "PCI_BUS_ID"
    if numeric and not pci_order and len(kinds) > 1:
        # CUDA's default order is fastest first; only on a node of identical GPUs (where ties
        # go by PCI bus) is it NVML's. Guessing would risk another user's GPU.
        return Grant(
            "CUDA_VISIBLE_DEVICES",
            mask,
            (),
            f"CUDA_VISIBLE_DEVICES={mask} lists indices on a node of different GPUs without "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, so which GPUs it means cannot be told; set "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID or list GPU UUIDs",
            seen=len(gpus),
        )
    return Grant("CUDA_VISIBLE_DEVICES", mask, tuple(granted), seen=len(gpus))


def _slurm_grant(var: str, value: str, seen: list[int], whole) -> Grant:
    """SLURM's indices are the node's device numbers. Where the job's device cgroup hides the
    other GPUs, NVML numbers the job's own from 0 and the indices do not match: then NVML
    sees exactly as many GPUs as were granted, and all of them are the job's."""
    entries = [e.strip() for e in value.split(",") if e.strip()]
    wanted = [int(e) for e in entries if e.isdigit()]
    if all(i in seen for i in wanted):
        picked = [g for i in dict.fromkeys(wanted) for g in whole(i)]
        return Grant(var, value, tuple(picked), seen=len(seen))
    if len(wanted) == len(seen) == len(set(wanted)):
        note = (
            f"{var}={value} numbers the node's GPUs; NVML sees only the job's "
            f"{len(seen)} (a device cgroup), so all of them are yours"
        )
        picked = [g for i in seen for g in whole(i)]
        return Grant(var, value, tuple(picked), seen=len(seen), note=note)
    have = f"0..{len(seen) - 1}" if seen else "none"
    return Grant(
        var,
        value,
        (),
        f"{var}={value} names GPUs NVML does not see (it sees {len(seen)}: {have}), so which "
        "are yours cannot be told; set CUDA_VISIBLE_DEVICES to their UUIDs",
        seen=len(seen),
    )


def _cc(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if isinstance(value, (list, tuple)) else None


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


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a job's cgroup or taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_ranks(spec: DeviceSpec, oversubscribe: bool, cores: int | None = None) -> None:
    """Refuse ``cpu:N`` above the usable cores unless oversubscribing is asked for: each rank
    is a process with the whole model and its data, so a typo (``cpu:999``) would start 999
    of them and bring the machine down."""
    if spec.kind != "cpu" or spec.nproc is None or oversubscribe:
        return
    cores = usable_cores() if cores is None else cores
    if spec.nproc > cores:
        raise DeviceSpecError(
            f"{spec.nproc} CPU ranks on {cores} usable cores; use cpu:{cores} or fewer, or set "
            "hardware.oversubscribe = true to run more ranks than cores on purpose"
        )


def default_cpu_ranks() -> int:
    """Two ranks by default: enough to exercise DDP, and one per core on small machines."""
    return max(1, min(2, usable_cores()))


def _cuda(gpus: Sequence[GrantedGpu], note: str = "") -> Placement:
    placement = Placement(
        "cuda", len(gpus), ",".join(g.token for g in gpus), tuple(g.index for g in gpus), note
    )
    if placement.per_rank and len(gpus) > 1:
        mig = f"{len(gpus)} MIG instances, a rank each; gloo between them (NCCL does not run "
        mig += "across MIG instances)"
        note = f"{note}; {mig}" if note else f"--devices: {mig}"
        placement = dataclasses.replace(placement, note=note)
    return placement


def _granted_note(grant: Grant) -> str:
    """``--devices auto`` under a grant says which GPUs it took, and from what."""
    if grant.source is None:
        return ""
    gpus = sorted(grant.indices)
    which = f"GPU {', '.join(map(str, gpus))}" if gpus else "the granted MIG instances"
    said = f"--devices auto: {which}, as {grant.source} grants"
    return f"{said} ({grant.note})" if grant.note else said


def place(
    spec: DeviceSpec,
    grant: Grant | int,
    no_gpu_reason: str = "",
    cuda_problem: str = "",
) -> Placement:
    """Resolve a spec against the granted GPUs; raise DeviceSpecError if impossible.

    ``grant``: the granted GPUs (an int: that many GPUs, nothing restricting them);
    ``cuda_problem``: why the ranks' torch cannot use a GPU at all ("" when it can).
    """
    if isinstance(grant, int):
        grant = Grant.everything(grant)
    if spec.kind == "cpu":
        return Placement("cpu", spec.nproc or default_cpu_ranks())
    if spec.kind == "auto":
        if grant.problem:
            raise DeviceSpecError(grant.problem)
        if grant.gpus and cuda_problem:
            note = f"--devices auto: on the CPU, {cuda_problem}"
            return Placement("cpu", default_cpu_ranks(), note=note)
        if grant.gpus:
            return _cuda(grant.gpus, _granted_note(grant))
        return Placement("cpu", default_cpu_ranks())
    if not grant.seen:
        why = f": {no_gpu_reason}" if no_gpu_reason else ""
        raise DeviceSpecError(f"no GPU is visible{why}; use cpu or cpu:N")
    if grant.problem:
        raise DeviceSpecError(grant.problem)
    if grant.gpus and not grant.indices:
        raise DeviceSpecError(
            f"{grant.describe()} grants MIG instances, which have no GPU index; use auto"
        )
    by_index: dict[int | None, list[GrantedGpu]] = {}
    for g in grant.gpus:
        by_index.setdefault(g.gpu, []).append(g)
    if grant.source is None:
        count = len(grant.gpus)
        missing = [i for i in spec.indices if i not in by_index]
        if missing:
            raise DeviceSpecError(
                f"GPU {', '.join(map(str, missing))} does not exist (this machine has {count}: "
                f"0..{count - 1})"
            )
    else:
        theirs = [i for i in spec.indices if i not in by_index]
        if theirs:
            yours = ",".join(str(i) for i in sorted(grant.indices)) or "none"
            raise DeviceSpecError(
                f"GPU {', '.join(map(str, theirs))} is not yours: {grant.describe()} grants "
                f"GPU {yours}"
            )
    if cuda_problem:
        raise DeviceSpecError(f"{cuda_problem}; use cpu or cpu:N")
    return _cuda([g for i in spec.indices for g in by_index[i]])
