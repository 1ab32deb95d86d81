"""The gradient all-reduce through shared memory, for CPU ranks on one machine.

gloo's all-reduce takes about 3 ms of a 4.5 ms quickstart step here, whatever the size of the
tensor: each call crosses three threads and a TCP loop on every rank. Without it, the same
loop runs about 2.5 times as many steps per second. Ranks on one machine can instead add
their parts through a shared buffer: each rank copies its part into its own slot and raises
its flag, waits for every flag, then adds the slots in rank order. That is a copy and a few
additions per element. ``benchmarks/overhead.py`` measures the result.

The protocol, per round of at most :data:`CHUNK` floats per rank:

- A round has a sequence number ``seq``; the slots alternate by its parity. A rank writes
  round ``seq + 2`` into the slots of round ``seq`` only after every flag reached
  ``seq + 1``, that is after every rank has finished reading round ``seq`` (each reads
  round ``seq`` before it writes ``seq + 1``).
- Every rank adds the same slots in the same order, so every rank gets the same bits.
  With two ranks that is ``a + b``, gloo's own result.
- The flags are aligned 8-byte integers, each written by one rank only. x86-64 keeps stores
  in order, as other cores see them (TSO), so a raised flag means its slot is written. Other
  machines need fences that Python cannot issue, so they keep gloo (:func:`unavailable`).

A rank that ends while the others wait for it (a crash) is noticed from its pid within a
fraction of a second, as gloo notices a closed socket; a rank alive but never arriving is
reported after ``timeout_s``, like a collective's timeout.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import sys
import time
import uuid

import torch
import torch.distributed as dist

CHUNK = 1 << 18  # floats per rank per round: 1 MiB
SHM = "/dev/shm"
SPINS = 2000  # checks with a yield between them before the wait starts to sleep
LOOK_EVERY_S = 0.2  # how often a waiting rank checks that the ranks it waits for still run


def region_bytes(world: int) -> int:
    return 2 * world * CHUNK * 4 + 8 * world * 2  # the slots, then a flag and a pid per rank


def unavailable(device_type: str, world: int, local_world: int) -> str | None:
    """Why these ranks cannot reduce through shared memory; None when they can."""
    return _ranks_reason(device_type, world, local_world) or _shm_reason(world)


def _ranks_reason(device_type: str, world: int, local_world: int) -> str | None:
    """What rules it out whoever asks: the same answer on every rank."""
    if device_type != "cpu":
        return "the ranks are not on CPU"
    if world < 2:
        return "one rank has nothing to reduce"
    if world != local_world:
        return "the ranks are on more than one machine"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "it needs Linux on x86-64 (its memory ordering)"
    return None


def _shm_reason(world: int) -> str | None:
    """What /dev/shm rules out now: asked on rank 0 only, which tells the others."""
    if not os.access(SHM, os.W_OK):
        return f"{SHM} is not writable"
    st = os.statvfs(SHM)
    free, need = st.f_bavail * st.f_frsize, region_bytes(world)
    if free < 2 * need:
        return f"{SHM} has {free // 2**20} MiB free, {2 * need // 2**20} MiB needed"
    return None


class SharedReduce:
    """One shared region for this group's ranks; :meth:`all_reduce` sums float32 tensors."""

    def __init__(self, rank: int, world: int, timeout_s: float, mm: mmap.mmap):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.timeout_key = "distributed.collective_timeout_s"  # what set timeout_s (timeouts.py)
        self._mm = mm
        n = 2 * world * CHUNK
        self._slots = torch.frombuffer(mm, dtype=torch.float32, count=n).view(2, world, CHUNK)
        self._flags = memoryview(mm)[4 * n : 4 * n + 8 * world].cast("q")
        self._pids = memoryview(mm)[4 * n + 8 * world : 4 * n + 16 * world].cast("q")
        self._pids[rank] = os.getpid()  # every rank's is in before create()'s last collective
        self.seq = 0

    @classmethod
    def create(cls, d, timeout_s: float, label: str) -> tuple[SharedReduce | None, str | None]:
        """Collective: the region for the ranks of ``d``, or None and why not.

        Rank 0 decides and creates the file (mode 0600); every rank maps it; rank 0 unlinks it
        once all have, so nothing is left in /dev/shm even if the run is killed later. Every
        rank returns the same answer. Where the ranks themselves rule it out (GPUs, several
        machines), every rank knows so alone: no collective, none that NCCL would refuse.
        """
        reason = _ranks_reason(d.device.type, d.world_size, d.local_world_size)
        if reason is not None:
            return None, reason
        path = None
        if d.rank == 0 and (reason := _shm_reason(d.world_size)) is None:
            path = os.path.join(SHM, f"gpu-console-{label}-{uuid.uuid4().hex[:12]}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, region_bytes(d.world_size))
                finally:
                    os.close(fd)
            except OSError as e:
                path, reason = None, f"cannot create {path}: {e.strerror}"
        shared = [path, reason]
        dist.broadcast_object_list(shared, src=0)
        path, reason = shared
        mm = None
        if path is not None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, region_bytes(d.world_size))
                finally:
                    os.close(fd)
            except OSError as e:
                reason = f"rank {d.rank} cannot map {path}: {e.strerror}"
        reducer = cls(d.rank, d.world_size, timeout_s, mm) if mm is not None else None
        # Every rank learns whether every rank mapped it, before rank 0 removes the name.
        failed = torch.tensor([0 if mm is not None else 1], dtype=torch.int64)
        dist.all_reduce(failed)
        if d.rank == 0 and path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if failed.item():
            return None, reason or "a rank could not map the shared region"
        return reducer, None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the float32 tensor ``x``, in a new tensor (x is unchanged)."""
        flat = x.reshape(-1)
        out = torch.empty_like(flat)
        for start in range(0, flat.numel(), CHUNK):
            part = flat[start : start + CHUNK]
            m = part.numel()
            self.seq += 1
            slots = self._slots[self.seq % 2]
            slots[self.rank, :m].copy_(part)
            self._flags[self.rank] = self.seq
            self._wait(self.seq)
            res = out[start : start + m]
            res.copy_(slots[0, :m])
            for j in range(1, self.world):
                res.add_(slots[j, :m])
        return out.view_as(x)

    def _wait(self, seq: int) -> None:
        flags = self._flags
        spins = 0
        deadline = None
        next_look = 0.0
        pause = 20e-6
        while min(flags) < seq:
            spins += 1
            if spins < SPINS:
                os.sched_yield()
                continue
            # A peer that is slow for a while (rank 0 writing a checkpoint, an eval) should
            # not cost a spinning core: sleep, a little longer each time, up to 1 ms.
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                late = [r for r in range(self.world) if flags[r] < seq]
                raise RuntimeError(
                    f"shared-memory all-reduce: rank(s) {late} did not arrive within "
                    f"{self.timeout_s:g} s ({self.timeout_key})"
                )
            if now >= next_look:
                # gloo notices a dead peer from its closed socket; here, from its pid. Without
                # this a rank would wait for torchrun's SIGKILL after a peer crashed.
                next_look = now + LOOK_EVERY_S
                for r in range(self.world):
                    if flags[r] < seq and not _alive(self._pids[r]):
                        raise RuntimeError(
                            f"shared-memory all-reduce: rank {r} (pid {self._pids[r]}) ended "
                            f"while rank {self.rank} waited for it"
                        )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, not a zombie (torchrun reaps a dead rank late)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
