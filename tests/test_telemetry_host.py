"""The host side of a sample, measured with psutil on real processes started here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from conftest import pid_alive, wait_for

from gpu_console.telemetry.host import HostSampler, RunPids, host_summary, read_run_pids

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)


class Tree:
    """A process with one child, both ``sleep``: a stand-in for a run's process tree."""

    def __init__(self, env: dict[str, str] | None = None):
        # exec: the shell becomes the parent sleep, and the backgrounded sleep its child.
        self.proc = subprocess.Popen(
            ["sh", "-c", "sleep 300 & exec sleep 301"],
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.child = wait_for(self._child, 30, "the child sleep")

    def _child(self) -> int | None:
        try:
            kids = psutil.Process(self.pid).children()
            # Both must have exec'd sleep: a moment after the fork the child is still a shell.
            names = [psutil.Process(self.pid).name(), *(k.name() for k in kids)]
        except psutil.Error:
            return None
        return kids[0].pid if kids and all("sleep" in n for n in names) else None

    def end(self) -> None:
        for pid in (self.child, self.pid):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        if self.child:
            wait_for(lambda: not pid_alive(self.child), 30, "the child to go")


@pytest.fixture
def trees():
    started: list[Tree] = []

    def start(**env: str) -> Tree:
        tree = Tree(env)
        started.append(tree)
        return tree

    yield start
    for tree in started:
        tree.end()


LAUNCHER = """
import json, os, subprocess, sys, time
for rank, extra in enumerate(json.loads(sys.argv[1])):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), **extra)
    # A worker with a child of its own, as a data-loader worker is (same environment).
    subprocess.Popen(["sh", "-c", "sleep 300 & exec sleep 301"], env=env)
time.sleep(300)
"""


class Launcher:
    """A stand-in for torchrun: workers with RANK set, each with a data-loader-like child."""

    def __init__(self, ranks: int, **env: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, json.dumps([env] * ranks)], start_new_session=True
        )
        self.pid = self.proc.pid
        self.workers: list[int] = []
        self.loaders: list[int] = []
        wait_for(lambda: self._find(ranks), 60, "the workers and their children")

    def _find(self, ranks: int) -> bool:
        try:
            workers = psutil.Process(self.pid).children()
            ready = [w for w in workers if w.name() == "sleep" and w.children()]
        except psutil.Error:
            return False
        if len(ready) < ranks:
            return False
        ready.sort(key=lambda w: int(w.environ()["RANK"]))
        self.workers = [w.pid for w in ready]
        self.loaders = [w.children()[0].pid for w in ready]
        return True

    def end(self) -> None:
        for pid in [*self.loaders, *self.workers, self.pid]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for pid in [*self.loaders, *self.workers]:
            wait_for(lambda pid=pid: not pid_alive(pid), 30, f"pid {pid} to go")


@pytest.fixture
def launchers():
    started: list[Launcher] = []

    def start(ranks: int, **env: str) -> Launcher:
        launcher = Launcher(ranks, **env)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.end()


def test_ranks_are_torchruns_children_not_their_data_loaders(launchers):
    run = launchers(2)
    # The supervisor lists every process with the engine's command line, loaders included.
    pids = RunPids(torchrun=run.pid, workers=tuple(run.workers + run.loaders))
    rows = {p["pid"]: p for p in HostSampler().sample(pids)["processes"]}
    assert set(rows) == {run.pid, *run.workers, *run.loaders}
    assert [rows[w]["role"] for w in run.workers] == ["worker", "worker"]
    assert [rows[w]["rank"] for w in run.workers] == [0, 1]
    assert all(rows[c]["role"] == "child" and "rank" not in rows[c] for c in run.loaders)
    # Without torchrun's pid (it died first), a listed pid whose parent is listed is a child.
    pids = RunPids(workers=tuple(run.workers + run.loaders))
    rows = {p["pid"]: p for p in HostSampler().sample(pids)["processes"]}
    assert {rows[w]["role"] for w in run.workers} == {"worker"}
    assert {rows[c]["role"] for c in run.loaders} == {"child"}


def test_run_pids_from_status_ignore_garbage(tmp_path):
    (tmp_path / "status.json").write_text(
        json.dumps({"pids": {"supervisor": 12, "torchrun": "x", "workers": [3, -1, None, 4]}})
    )
    assert read_run_pids(tmp_path) == RunPids(12, None, (3, 4))
    assert read_run_pids(tmp_path / "missing") == RunPids()
    assert RunPids(1, 2, (3,)).roots() == [(1, "supervisor"), (2, "torchrun"), (3, "worker")]


def test_host_numbers_without_a_run():
    sample = HostSampler().sample()
    assert sample["cores"] >= 1 and sample["physical_cores"] >= 1
    assert 0 < sample["ram_used"] < sample["ram_total"]
    assert sample["ram_available"] > 0
    assert 0.0 <= sample["cpu_percent"] <= 100.0
    assert sample["processes"] == []
    summary = host_summary()
    assert summary["ram_total"] == sample["ram_total"] and summary["cores"] == sample["cores"]


def test_a_run_tree_with_roles_cpu_and_rss(trees):
    tree = trees()
    host = HostSampler()
    first = {p["pid"]: p for p in host.sample(RunPids(supervisor=tree.pid))["processes"]}
    assert set(first) == {tree.pid, tree.child}
    assert first[tree.pid]["role"] == "supervisor"
    assert first[tree.child]["role"] == "child"
    assert first[tree.child]["ppid"] == tree.pid
    # A first sighting has nothing to measure CPU over: unknown, not a made-up 0 %.
    assert first[tree.pid]["cpu_percent"] is None
    assert all(p["rss"] > 0 and p["name"] == "sleep" for p in first.values())

    second = {p["pid"]: p for p in host.sample(RunPids(supervisor=tree.pid))["processes"]}
    assert all(isinstance(p["cpu_percent"], float) for p in second.values())


def test_workers_carry_their_rank_and_cuda_environment(trees):
    tree = trees(
        RANK="3", LOCAL_RANK="1", CUDA_VISIBLE_DEVICES="2,0", CUDA_DEVICE_ORDER="PCI_BUS_ID"
    )
    rows = {p["pid"]: p for p in HostSampler().sample(RunPids(torchrun=tree.pid))["processes"]}
    assert rows[tree.pid]["role"] == "torchrun"
    worker = rows[tree.child]  # torchrun's children are the workers, listed or not
    assert worker["role"] == "worker"
    assert (worker["rank"], worker["local_rank"]) == (3, 1)
    assert worker["cuda_visible_devices"] == "2,0"
    assert worker["cuda_device_order"] == "PCI_BUS_ID"


def test_processes_that_end_leave_the_sample(trees):
    tree, other = trees(), trees()
    host = HostSampler()
    pids = RunPids(supervisor=tree.pid, workers=(other.pid,))
    assert {p["pid"] for p in host.sample(pids)["processes"]} == {
        tree.pid,
        tree.child,
        other.pid,
    }
    other.end()
    os.kill(tree.child, signal.SIGKILL)
    wait_for(lambda: not pid_alive(tree.child), 30, "the child to go")
    assert {p["pid"] for p in host.sample(pids)["processes"]} == {tree.pid}
    tree.end()
    assert host.sample(pids)["processes"] == []


def test_a_process_that_is_ending_is_gone_not_a_zero_rss_reading():
    # A process drops its memory map before it becomes a zombie, and freeing a large heap
    # takes a while: a tick in that window once read RSS 0 for a rank (a CI failure). The
    # child exits without Python freeing its heap first, as a rank killed or exiting does.
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; heap = bytearray(b'1') * (512 << 20); print('ready', flush=True);"
            " sys.stdin.read(); os._exit(0)",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        host = HostSampler()
        pids = RunPids(workers=(child.pid,))
        (row,) = host.sample(pids)["processes"]
        assert row["rss"] > 512 << 20
        child.stdin.close()
        ending = []
        # Sample as fast as possible while it ends: every row must be a real reading.
        while child.poll() is None:
            ending += host.sample(pids)["processes"]
        assert all(r["rss"] > 0 for r in ending), [r["rss"] for r in ending]
        assert host.sample(pids)["processes"] == []
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
