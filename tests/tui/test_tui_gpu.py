"""Every built-in profile from the console on GPU 0: the real binary in tmux, a few steps.

Marked ``gpu`` and skipped where torch cannot use CUDA (or tmux is missing); run with
``python -m pytest -m gpu``.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import only_run, read_status, wait_for
from test_tui_tmux import console, diagnosis
from tui_support import kill_runs

from gpu_console.profile import BUILTIN_DIR

try:
    import torch

    CUDA, WHY = torch.cuda.is_available(), "torch.cuda.is_available() is False"
except ImportError:  # pragma: no cover - torch is a dependency
    CUDA, WHY = False, "torch is not installed"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {WHY}"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


@pytest.mark.parametrize("name", sorted(p.stem for p in BUILTIN_DIR.glob("*.toml")))
def test_every_builtin_profile_runs_in_the_console_on_gpu_0(tmp_path, name):
    runs = tmp_path / "runs"
    sets = ["train.max_steps=30", "train.warmup_steps=5", "train.eval_every=15"]
    args = ["run", name, "--devices", "0", "--runs-dir", str(runs)]
    tmux, exit_file = console(tmp_path, *args, *[x for s in sets for x in ("--set", s)])
    try:
        pane = tmux.wait(" finished ", 120)
        assert "1× cuda" in pane and "30/30" in pane, pane
        run = only_run(runs)
        # The pane folds the events; status.json is the supervisor's and may land a moment later.
        wait_for(lambda: read_status(run).get("state") == "finished", 60, "status.json finished")
        tmux.keys("q")
        wait_for(exit_file.exists, 30, "the console to exit")
        assert exit_file.read_text().strip() == "0"
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(tmux, runs)}") from None
    finally:
        tmux.end()
        kill_runs(runs)
