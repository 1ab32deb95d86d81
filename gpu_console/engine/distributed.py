"""Process group, device, CPU placement and DDP, from torchrun's environment."""

from __future__ import annotations

import inspect
import os
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..devices import RANK_DEVICES
from ..profile import DistributedConfig, HardwareConfig
from .signals import die_with_parent  # noqa: F401 - its old home; it lives in signals now


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    # Whether init created the process group, and so the run's end destroys it: a group the
    # engine was handed (tests/harness.py) stays its owner's.
    owned: bool = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def cpu_cores_for(local_rank: int, local_world_size: int) -> list[int]:
    """This rank's share of the cores the node gives us, contiguous and disjoint."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < local_world_size:
        return cores
    per = len(cores) // local_world_size
    return cores[local_rank * per : (local_rank + 1) * per]


def place_cpu(local_rank: int, local_world_size: int, pin: bool) -> list[int] | None:
    """Pin a CPU rank to its own cores with as many threads; measured in benchmarks/."""
    if not pin:
        return None
    cores = cpu_cores_for(local_rank, local_world_size)
    if len(cores) >= 1 and len(os.sched_getaffinity(0)) >= local_world_size:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        return cores
    return None


def init(cfg: DistributedConfig, hw: HardwareConfig, device_type: str) -> Dist:
    """The process group from torchrun's environment, or the one this process already has.

    CPU placement (:func:`place_cpu`) is the process's, set by the entry point
    (engine/__main__.py) before this: a process that hosts the engine in a group of its own
    keeps its cores and threads."""
    given = dist.is_initialized()
    if given:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank if given else 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world if given else 1))
    # MIG: this rank sees its own instance alone (engine/__main__.py set its mask).
    own_device = bool(os.environ.get(RANK_DEVICES))
    if device_type == "cuda":
        device = torch.device("cuda", 0 if own_device else local_rank)
        torch.cuda.set_device(device)
        if hw.memory_fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(hw.memory_fraction, device)
        torch.backends.cudnn.benchmark = hw.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = hw.tf32
        torch.backends.cudnn.allow_tf32 = hw.tf32
    else:
        device = torch.device("cpu")
    if given:
        return Dist(rank, world, local_rank, local_world, device, dist.get_backend(), owned=False)
    backend = cfg.backend
    if backend == "auto":  # NCCL does not run across MIG instances (launch.py refuses it)
        mig = own_device and local_world > 1
        backend = "nccl" if device_type == "cuda" and not mig else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device_type == "cuda" else {}
    if rank != 0:
        wait_for_store(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    # Start-up's timeout until every rank's first step; then the collectives' (timeouts.py).
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.startup_timeout_s), **kwargs)
    return Dist(rank, world, local_rank, local_world, device, backend)


def place_process(cfg: DistributedConfig, device_type: str) -> list[int] | None:
    """A CPU rank's cores and threads (:func:`place_cpu`) from torchrun's environment: once
    per process, by the entry point that torchrun starts, before the process group."""
    if device_type != "cpu":
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return place_cpu(local_rank, local_world, cfg.cpu_affinity)


STORE_WAIT_S = 10.0
STORE_PROBE_S = 0.01


def wait_for_store(host: str | None, port: str | None) -> None:
    """Until rank 0's TCPStore accepts connections (at most :data:`STORE_WAIT_S`).

    With the agent's store not shared (launch.py says why), rank 0 hosts the process group's
    store. A rank that gets to ``init_process_group`` first is refused, and the store client
    retries only after a backoff: up to 0.7 s of every rank's start, seen here. A refused probe
    costs nothing, so this one retries every 10 ms; then the client connects at once. Should
    the probe never get through, the client's own retries and timeout decide, as before.
    """
    if not host or not port or not port.isdigit():
        return
    deadline = time.monotonic() + STORE_WAIT_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(STORE_PROBE_S)


def nodes_of_run(run_dir: Path, d: Dist) -> list[dict]:
    """Collective. Every node's place in the run, from each node's first rank: its node
    (torchrun's group rank), host, run directory and global rank, ordered by node."""
    mine = None
    if d.local_rank == 0:
        mine = {
            "node": int(os.environ.get("GROUP_RANK", 0)),
            "host": socket.gethostname(),
            "run_dir": str(Path(run_dir).resolve()),
            "rank": d.rank,
        }
    every: list[dict | None] = [None] * d.world_size
    dist.all_gather_object(every, mine)
    return sorted((p for p in every if p), key=lambda p: p["node"])


def ddp_kwargs(cfg: DistributedConfig) -> dict:
    """Every ``[distributed]`` knob that DDP's constructor takes, in this torch's words."""
    return {
        "static_graph": cfg.static_graph,
        "bucket_cap_mb": cfg.bucket_cap_mb,
        "find_unused_parameters": cfg.find_unused_parameters,
        "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
        **buffer_sync_kwargs(cfg.broadcast_buffers, _ddp_parameters()),
    }


def _ddp_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(DDP.__init__).parameters)


def buffer_sync_kwargs(sync: bool, accepted: frozenset[str]) -> dict:
    """``distributed.broadcast_buffers`` as the DDP constructor of this torch takes it.

    The key means what DDP's ``broadcast_buffers`` always meant: buffers are broadcast from
    rank 0 when DDP is built and before each forward, or (false) neither. torch 2.13 deprecates
    ``broadcast_buffers`` (a FutureWarning on every rank) for ``forward_sync_buffers``, which
    covers the forward only (buffers are then always synced at init). So: ``true`` is
    ``forward_sync_buffers=True`` there (the same behaviour); ``false`` takes
    ``init_sync_buffers=False`` where a torch has it, and until then stays the old keyword,
    which torch's own deprecation message says to keep using for that case.
    """
    if "forward_sync_buffers" not in accepted:
        return {"broadcast_buffers": sync}
    if sync:
        return {"forward_sync_buffers": True}
    if "init_sync_buffers" in accepted:
        return {"forward_sync_buffers": False, "init_sync_buffers": False}
    return {"broadcast_buffers": False}


def sync_batchnorm(setting: bool | str, device_type: str, world_size: int) -> bool:
    """Whether BatchNorm layers become SyncBatchNorm: ``distributed.sync_batchnorm`` true, or
    ``auto`` on several CUDA ranks (PyTorch has no CPU SyncBatchNorm: the launch refuses
    ``true`` there, ``auto`` leaves BatchNorm plain; one rank has nothing to sync)."""
    if setting == "auto":
        return device_type == "cuda" and world_size > 1
    return bool(setting)


def convert_batchnorm(
    model: nn.Module, cfg: DistributedConfig, device_type: str, world_size: int
) -> nn.Module:
    """BatchNorm → SyncBatchNorm where :func:`sync_batchnorm` says so (a model without
    BatchNorm is left as it is)."""
    if sync_batchnorm(cfg.sync_batchnorm, device_type, world_size):
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def wrap(model: nn.Module, cfg: DistributedConfig, d: Dist) -> DDP:
    model = convert_batchnorm(model, cfg, d.device.type, d.world_size)
    device_ids = [d.device.index] if d.device.type == "cuda" else None
    kwargs = ddp_kwargs(cfg)
    with warnings.catch_warnings():
        if "broadcast_buffers" in kwargs and not kwargs["broadcast_buffers"]:
            # Asked for no buffer sync at all, which only the deprecated keyword says on a
            # torch without init_sync_buffers (buffer_sync_kwargs): its notice is not news.
            warnings.filterwarnings(
                "ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning
            )
        return DDP(model, device_ids=device_ids, **kwargs)


def cuda_capability() -> tuple[int, int] | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()
    return None
