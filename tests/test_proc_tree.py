"""proc_tree: a process's children from the kernel's lists equal psutil's walk."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from gpu_console import proc_tree

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

# A parent with two children, one of which has a child of its own; each sleeps until killed.
TREE = """
import subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
inner = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])"
nested = [sys.executable, "-c", f"import subprocess, sys, time; {inner}; time.sleep(600)"]
subprocess.Popen(sleep); subprocess.Popen(nested)
print("up", flush=True)
time.sleep(600)
"""


def _tree_up(proc: subprocess.Popen, deadline_s: float = 120.0) -> psutil.Process:
    root = psutil.Process(proc.pid)
    end = time.monotonic() + deadline_s
    while len(root.children(recursive=True)) < 3:
        assert time.monotonic() < end, "the test's process tree never came up"
        time.sleep(0.05)
    return root


def test_children_equal_psutils_walk_and_reuse_known_processes():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE)
    try:
        root = _tree_up(proc)
        walked = {p.pid for p in root.children(recursive=True)}
        assert {p.pid for p in proc_tree.children(root, recursive=True)} == walked
        direct = proc_tree.children(root)
        assert {p.pid for p in direct} == {p.pid for p in root.children()}
        assert len(direct) == 2
        known = {p.pid: p for p in direct}
        again = proc_tree.children(root, known=known)
        assert all(p is known[p.pid] for p in again)  # the same objects, not made anew
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_has_no_children():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert proc_tree.child_pids(proc.pid) == []


def test_without_the_kernels_lists_it_is_psutils_walk(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE)
    try:
        root = _tree_up(proc)
        monkeypatch.setattr(proc_tree, "child_pids", lambda pid: None)  # no CONFIG_PROC_CHILDREN
        assert {p.pid for p in proc_tree.children(root, recursive=True)} == {
            p.pid for p in root.children(recursive=True)
        }
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait()
