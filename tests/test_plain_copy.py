"""A process's output into its log file without a terminal's control sequences, its children's
included (wandb's core, started by the W&B follower)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import deadline

from gpu_console.plain_copy import strip_control

pytestmark = pytest.mark.quick


def test_colours_links_and_titles_are_taken_out_and_the_text_kept():
    raw = (
        b"\x1b[1;34mwandb\x1b[0m: Find logs at: \x1b[1;35mruns/x/logs\x1b[0m\n"
        b"\x1b]8;;https://wandb.ai\x1b\\link\x1b]8;;\x1b\\ and \x1b]0;title\x07done \xe2\x9c\x93\n"
    )
    assert strip_control(raw) == b"wandb: Find logs at: runs/x/logs\nlink and done \xe2\x9c\x93\n"


# As the W&B follower runs: its stdout the log file (the supervisor's), children writing to
# the fds they inherited, one of them still running when this process leaves plain_stdio.
PROCESS = r"""
import subprocess, sys
from gpu_console.plain_copy import plain_stdio
with plain_stdio(grace_s=float(sys.argv[1])):
    print("\x1b[1;34mwandb\x1b[0m: mine")
    print("\x1b[31mto stderr\x1b[0m", file=sys.stderr)
    subprocess.run(["sh", "-c", r"printf '\033[1mchild\033[0m\n'"], check=True)
    late = subprocess.Popen(["sh", "-c", r"read x; printf '\033[35mlast\033[0m\n'"],
                            stdin=subprocess.PIPE)
    late.stdin.close()  # it writes once it reads the end of its input, perhaps after the block
print("after: nowhere")
"""


def test_this_process_and_its_children_reach_the_file_plain(tmp_path):
    log = tmp_path / "wandb.log"
    log.write_bytes(b"earlier session\n")
    with open(log, "ab") as out:
        done = subprocess.run(
            [sys.executable, "-c", PROCESS, str(deadline(60))],
            stdout=out, stderr=subprocess.STDOUT, timeout=deadline(120),
        )  # fmt: skip
    assert done.returncode == 0
    lines = log.read_bytes().splitlines()
    assert lines[:4] == [b"earlier session", b"wandb: mine", b"to stderr", b"child"]
    assert lines[4:] == [b"last"]
