"""A child's output into a log file without a terminal's control sequences, including what a
process it started writes after it has ended (wandb's core after the W&B follower)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import deadline

from gpu_console.plain_copy import PlainCopy, strip_control

pytestmark = pytest.mark.quick


def test_colours_links_and_titles_are_taken_out_and_the_text_kept():
    raw = (
        b"\x1b[1;34mwandb\x1b[0m: Find logs at: \x1b[1;35mruns/x/logs\x1b[0m\n"
        b"\x1b]8;;https://wandb.ai\x1b\\link\x1b]8;;\x1b\\ and \x1b]0;title\x07done \xe2\x9c\x93\n"
    )
    assert strip_control(raw) == b"wandb: Find logs at: runs/x/logs\nlink and done \xe2\x9c\x93\n"


def test_the_copy_keeps_what_a_grandchild_writes_after_the_child_ended(tmp_path):
    log = tmp_path / "wandb.log"
    log.write_bytes(b"earlier session\n")
    script = (
        r"printf '\033[1;34mwandb\033[0m: first\n'; "
        # A process of its own that outlives the shell and writes once the shell has gone.
        r"(while kill -0 $$ 2>/dev/null; do :; done; printf '\033[35mlast\033[0m\n') &"
    )
    child = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert child.stdout is not None
    copy = PlainCopy(child.stdout, log)
    child.wait(timeout=deadline(60))
    copy.join(deadline(60))
    assert log.read_bytes() == b"earlier session\nwandb: first\nlast\n"
