"""The host side of a sample (psutil): CPU, RAM, and every process of a run.

A run's processes are the pids the supervisor records in ``status.json`` (supervisor,
torchrun, workers) and all their children (data-loader workers, compile workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .. import proc_tree

# What a worker's environment says about where it runs; read once per process.
_WORKER_ENV = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


@dataclass(frozen=True)
class RunPids:
    supervisor: int | None = None
    torchrun: int | None = None
    workers: tuple[int, ...] = ()

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> RunPids:
        pids = status.get("pids") or {}
        return cls(
            _pid(pids.get("supervisor")),
            _pid(pids.get("torchrun")),
            tuple(p for p in (_pid(w) for w in pids.get("workers") or ()) if p is not None),
        )

    def roots(self) -> list[tuple[int, str]]:
        out = [(self.supervisor, "supervisor"), (self.torchrun, "torchrun")]
        out += [(w, "worker") for w in self.workers]
        return [(pid, role) for pid, role in out if pid is not None]


def _pid(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


def read_run_pids(run_dir: Path) -> RunPids:
    from ..runs import read_status

    return RunPids.from_status(read_status(run_dir))


class HostSampler:
    """Keeps one ``psutil.Process`` per pid: CPU % is measured between two calls on it."""

    def __init__(self) -> None:
        self.cores = psutil.cpu_count() or 1
        self.physical_cores = psutil.cpu_count(logical=False) or self.cores
        self._procs: dict[int, psutil.Process] = {}
        self._primed: set[int] = set()  # pids whose CPU % has a baseline
        self._env: dict[int, dict[str, str]] = {}
        psutil.cpu_percent(None)  # the first call only sets the baseline

    def sample(self, pids: RunPids | None = None) -> dict[str, Any]:
        vm = psutil.virtual_memory()
        return {
            "cpu_percent": psutil.cpu_percent(None),
            "cores": self.cores,
            "physical_cores": self.physical_cores,
            "load_1m": round(os.getloadavg()[0], 2),
            "ram_total": vm.total,
            "ram_used": vm.total - vm.available,
            "ram_available": vm.available,
            "processes": self._run_processes(pids) if pids else [],
        }

    def _process(self, pid: int) -> psutil.Process | None:
        p = self._procs.get(pid)
        if p is not None and p.is_running():
            return p
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            return None
        self._procs[pid] = p
        self._primed.discard(pid)
        self._env.pop(pid, None)
        return p

    def _run_processes(self, pids: RunPids) -> list[dict[str, Any]]:
        roles = dict(pids.roots())
        live = [p for p in map(self._process, roles) if p is not None]
        # The first live root's tree holds the rest: one walk of /proc, not one per root.
        try:
            children = proc_tree.children(live[0], True, self._procs) if live else []
        except psutil.Error:
            children = []
        for c in children:
            # Equal means the same pid *and* start time: not a recycled pid.
            if self._procs.get(c.pid) != c:
                self._procs[c.pid] = c
                self._primed.discard(c.pid)
                self._env.pop(c.pid, None)
            roles.setdefault(c.pid, "child")
        rows = [row for pid, role in roles.items() if (row := self._row(pid, role, pids))]
        for gone in set(self._procs) - {r["pid"] for r in rows}:
            self._procs.pop(gone, None)
            self._primed.discard(gone)
            self._env.pop(gone, None)
        return rows

    def _row(self, pid: int, role: str, pids: RunPids) -> dict[str, Any] | None:
        p = self._procs.get(pid)
        if p is None:
            return None
        try:
            with p.oneshot():
                rss = p.memory_info().rss
                # Gone: ended and not yet reaped (a zombie), or ending. A process releases its
                # memory before it becomes a zombie, and freeing a large heap takes long
                # enough for a tick to land there: its zero RSS is its exit, not a reading.
                if rss == 0 or p.status() == psutil.STATUS_ZOMBIE:
                    return None
                ppid = p.ppid()
                cpu = p.cpu_percent(None)
                row = {
                    "pid": pid,
                    "ppid": ppid,
                    "role": role,
                    "name": p.name(),
                    # A process's first reading has no interval to measure over.
                    "cpu_percent": cpu if pid in self._primed else None,
                    "rss": rss,
                }
        except psutil.Error:
            return None
        self._primed.add(pid)
        if role in ("worker", "child"):
            row["role"] = "worker" if _is_worker(pid, ppid, pids) else "child"
        if row["role"] == "worker":
            env = self._worker_env(p)
            row["rank"] = _int_or_none(env.get("RANK"))
            row["local_rank"] = _int_or_none(env.get("LOCAL_RANK"))
            row["cuda_visible_devices"] = env.get("CUDA_VISIBLE_DEVICES")
            row["cuda_device_order"] = env.get("CUDA_DEVICE_ORDER")
        return row

    def _worker_env(self, p: psutil.Process) -> dict[str, str]:
        env = self._env.get(p.pid)
        if env is None:
            try:
                full = p.environ()
            except psutil.Error:  # another user's process: its rank stays unknown
                full = {}
            env = self._env[p.pid] = {k: full[k] for k in _WORKER_ENV if k in full}
        return env


def _is_worker(pid: int, ppid: int, pids: RunPids) -> bool:
    """Workers are torchrun's children: its grandchildren (data-loader workers, forked with
    the same command line and environment) are listed in status.json too, but are not ranks."""
    if pids.torchrun is not None:
        return ppid == pids.torchrun
    return pid in pids.workers and ppid not in pids.workers


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def host_summary() -> dict[str, Any]:
    """A one-shot view for ``devices``: cores, RAM and CPU % over a short interval."""
    vm = psutil.virtual_memory()
    cores = psutil.cpu_count() or 1
    return {
        "cores": cores,
        "physical_cores": psutil.cpu_count(logical=False) or cores,
        "cpu_percent": psutil.cpu_percent(interval=0.1),
        "load_1m": round(os.getloadavg()[0], 2),
        "ram_total": vm.total,
        "ram_used": vm.total - vm.available,
        "ram_available": vm.available,
    }
