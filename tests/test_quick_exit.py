"""``python -m gpu_console.quick_exit MODULE ARGS``, how the supervisor runs torchrun: what
``python -m MODULE ARGS`` would do (argv, exit code, traceback, atexit, threads, output), less the
interpreter's teardown. The real torchrun path is every integration test's."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from conftest import test_env as cli_env

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

PROGRAM = """
import atexit, sys, threading, time

def late():
    time.sleep(0.2)
    print("thread done", flush=True)

atexit.register(lambda: print("atexit ran"))
print("argv", sys.argv[1:], __name__, sys.argv[0].endswith("prog.py"))
threading.Thread(target=late).start()  # not a daemon: exit waits for it
what = sys.argv[1]
if what == "raise":
    raise ValueError("broken")
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "message":
    sys.exit("a message")
if what == "interrupt":
    raise KeyboardInterrupt
print("end", end="")  # no newline, still flushed
"""


def run(tmp_path, *args: str, quick: bool) -> subprocess.CompletedProcess:
    (tmp_path / "prog.py").write_text(PROGRAM)
    argv = [sys.executable, "-m", *(["gpu_console.quick_exit"] if quick else []), "prog", *args]
    return subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=cli_env()
    )


@pytest.mark.parametrize(
    "args", [["ok"], ["raise"], ["exit", "3"], ["exit", "0"], ["message"], ["interrupt"]]
)
def test_it_exits_as_python_dash_m_does(tmp_path, args):
    plain = run(tmp_path, *args, quick=False)
    quick = run(tmp_path, *args, quick=True)
    assert quick.returncode == plain.returncode
    assert quick.stdout == plain.stdout
    assert quick.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]
    if args == ["ok"]:
        assert plain.returncode == 0
        for line in ("argv ['ok'] __main__ True", "thread done", "atexit ran", "end"):
            assert line in quick.stdout
    if args == ["raise"]:
        assert quick.returncode == 1 and "Traceback (most recent call last)" in quick.stderr
    if args == ["interrupt"]:
        assert quick.returncode == -signal.SIGINT


def test_without_a_module_it_says_how_to_use_it():
    proc = subprocess.run(
        [sys.executable, "-m", "gpu_console.quick_exit"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "usage: python -m gpu_console.quick_exit" in proc.stderr
