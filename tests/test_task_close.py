"""A rank's clean exit keeps what the user's task writes at its end: through real torchrun.

The engine leaves with ``os._exit`` (past torch/gloo's teardown abort); before that, the
task's ``close()`` and the process's atexit handlers run, on every rank, whether the run
finished or was stopped.
"""

from __future__ import annotations

from conftest import deadline, events_of, only_run, read_status, run_dirs, task_profile, wait_for

from gpu_console.events import append_control

LINES = 20_000

# A log the task writes as it trains, buffered, that an atexit handler completes and closes
# (as TensorBoard's and W&B's finalisers do), and a file its close() writes.
CLOSING_TASK = f"""
import atexit
import os
from pathlib import Path
from gpu_console.tasks.mlp import MLPTask

HERE = Path(__file__).parent


class Closing(MLPTask):
    def __init__(self, config):
        super().__init__(config)
        self.rank = os.environ.get("RANK", "console")
        self.log = open(HERE / f"atexit-{{self.rank}}.txt", "w")
        atexit.register(self.finish)

    def compute(self, model, batch):
        self.log.write("step\\n")
        return super().compute(model, batch)

    def finish(self):
        for i in range({LINES}):
            self.log.write(f"{{i}}\\n")
        self.log.write("end\\n")
        self.log.close()

    def close(self):
        (HERE / f"close-{{self.rank}}.txt").write_text("closed\\n")
"""


def assert_both_hooks_ran_on_every_rank(tmp_path) -> None:
    for rank in ("0", "1"):
        assert (tmp_path / f"close-{rank}.txt").read_text() == "closed\n"
        lines = (tmp_path / f"atexit-{rank}.txt").read_text().splitlines()
        assert lines[-1] == "end" and lines[-LINES - 1 : -1] == [str(i) for i in range(LINES)]
        assert "step" in lines[: -LINES - 1]


def test_close_and_atexit_run_on_every_rank_after_a_finished_run(procs, runs_dir, tmp_path):
    profile = task_profile(tmp_path, "closing", CLOSING_TASK, "Closing", max_steps=5, ranks=2)
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_status(only_run(runs_dir))["state"] == "finished"
    assert_both_hooks_ran_on_every_rank(tmp_path)


def test_close_and_atexit_run_on_every_rank_after_a_stopped_run(procs, runs_dir, tmp_path):
    profile = task_profile(
        tmp_path, "closing", CLOSING_TASK, "Closing", max_steps=1_000_000, ranks=2
    )
    console = procs.start(
        "run", str(profile), "--headless", "--runs-dir", str(runs_dir), cwd=tmp_path
    )
    run = wait_for(lambda: run_dirs(runs_dir) and only_run(runs_dir), what="the run directory")
    wait_for(lambda: events_of(run, "step"), what="a step")
    append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    assert read_status(run)["state"] == "stopped"
    assert_both_hooks_ran_on_every_rank(tmp_path)
