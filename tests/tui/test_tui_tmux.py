"""The real binary in a real terminal: tmux types into ``gpu-console`` and reads its screen.

Enter launches quickstart (with max steps raised in the override field, so the run is still
training when the keys arrive), the screen shows loss and samples/s, ``c`` writes a
checkpoint with reason ``request``, ``s`` ``y`` stops the run (state ``stopped``), and ``q``
quits with exit code 0. The pane is polled with deadlines, never slept on.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import synthetic
from conftest import (
    events_of,
    fast_profile,
    only_run,
    read_events,
    read_status,
    repo_pythonpath,
    run_dirs,
    wait_for,
)
from conftest import test_env as environment
from tui_support import kill_runs

from gpu_console.profile import BUILTIN_DIR

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


class Tmux:
    def __init__(self, socket: str, env: dict[str, str]):
        self.socket, self.env = socket, env

    def __call__(self, *args: str) -> str:
        # A private server (-S: a socket under the test's tmp_path): its sessions get this
        # environment, and it is ours to end.
        return subprocess.run(
            ["tmux", "-S", self.socket, *args],
            capture_output=True,
            text=True,
            timeout=30,
            env=self.env,
        ).stdout

    def end(self) -> None:
        """End this test's tmux server by its pid (and with it the console in its pane)."""
        pid = self("display-message", "-p", "#{pid}").strip()
        if pid.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)

    def pane(self) -> str:
        return self("capture-pane", "-p", "-t", "console")

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", "console", *keys)

    def type(self, text: str) -> None:
        self("send-keys", "-t", "console", "-l", text)

    def wait(self, text: str, timeout: float = 60.0) -> str:
        return wait_for(lambda: text in (pane := self.pane()) and pane, timeout, repr(text))


def wait_for_pane(tmux: Tmux, text: str, timeout: float) -> str | None:
    try:
        return tmux.wait(text, timeout)
    except AssertionError:
        return None


def console(tmp_path, *args: str, size: tuple[int, int] = (100, 32)) -> tuple[Tmux, Path]:
    """``gpu-console ARGS`` in a new tmux session (100×32); the file its exit code goes to."""
    exit_file = tmp_path / f"exit-code-{uuid.uuid4().hex[:8]}"
    command = (
        f"cd {shlex.quote(str(tmp_path))} && {shlex.quote(sys.executable)} -m gpu_console "
        f"{' '.join(shlex.quote(a) for a in args)}; echo $? > {shlex.quote(str(exit_file))}"
    )
    env = environment(PYTHONPATH=repo_pythonpath())
    tmux = Tmux(str(tmp_path / f"tmux-{uuid.uuid4().hex[:8]}.sock"), env)
    tmux("new-session", "-d", "-x", str(size[0]), "-y", str(size[1]), "-s", "console", command)
    return tmux, exit_file


def busiest(n: int = 8) -> str:
    """The processes using the most CPU over half a second (what else held the machine)."""
    procs = list(psutil.process_iter(["pid", "cmdline"]))
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.cpu_percent(None)
    time.sleep(0.5)  # the measuring interval of cpu_percent, not a wait on the test's subject
    usage = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            usage.append((p.cpu_percent(None), p.pid, " ".join(p.info["cmdline"] or [])[:160]))
    return "\n".join(f"{c:5.0f}% {pid} {cmd}" for c, pid, cmd in sorted(usage, reverse=True)[:n])


def diagnosis(tmux: Tmux, runs: Path) -> str:
    """What a failing wait saw: the pane, and each run's state and last events."""
    parts = ["pane:", tmux.pane(), "busiest processes:", busiest()]
    for run in run_dirs(runs):
        parts.append(f"{run.name}: status {read_status(run)}")
        parts.extend(str(e) for e in read_events(run)[-8:])
        for log in sorted((run / "logs").rglob("*.log")):  # the supervisor's, torchrun's, ranks'
            name = log.relative_to(run / "logs")
            parts.append(f"{name}: {log.read_text(errors='replace')[-1500:]}")
    return "\n".join(parts)


def pinned_quickstart(folder: Path) -> None:
    """A local quickstart (it shadows the built-in one) on 2 CPU ranks: the built-in's devices
    are "auto", so the launch screen would pick the GPU wherever NVML sees one."""
    local = folder / "profiles" / "quickstart.toml"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text((BUILTIN_DIR / "quickstart.toml").read_text() + PINNED_DEVICES)


PINNED_DEVICES = '\n[hardware]\ndevices = "cpu:2"\n'


def test_the_real_binary_in_tmux(tmp_path):
    runs = tmp_path / "runs"
    pinned_quickstart(tmp_path)
    tmux, exit_file = console(tmp_path, "--runs-dir", str(runs))
    try:
        tmux.wait("resolved: quickstart", 30)
        tmux.wait("→ CPU", 30)
        for _ in range(3):  # profiles → devices → precision → max steps
            tmux.keys("Tab")

        def typed() -> bool:
            # Keys that arrive before the field has taken the focus are dropped: clear the
            # field (ctrl+u) and type again until the screen shows the value.
            tmux.keys("C-u")
            tmux.type("1000000")
            return bool(wait_for_pane(tmux, "max steps  1000000", 2.0))

        wait_for(typed, 30, "max steps typed into its field")
        tmux.keys("Enter")

        pane = wait_for(
            lambda: "samples/s" in (p := tmux.pane()) and " running " in p and "loss 0." in p and p,
            120,
            "loss and samples/s on the run screen",
        )
        assert "quickstart-" in pane
        run = only_run(runs)

        tmux.keys("c")
        # Answered with a checkpoint: a new one, or the interval's of the step it landed on.
        wait_for(
            lambda: [
                e
                for e in events_of(run, "control")
                if e.get("cmd") == "checkpoint" and e.get("state") == "done" and e.get("checkpoint")
            ],
            60,
            "a checkpoint answering the request",
        )
        tmux.wait("checkpoint ✓ done", 30)

        tmux.keys("s")
        tmux.wait("Stop the run?", 15)
        tmux.keys("y")
        wait_for(lambda: read_status(run).get("ended"), 60, "the run to end")
        assert read_status(run)["state"] == "stopped"
        tmux.wait(" stopped ", 15)

        tmux.keys("q")
        wait_for(exit_file.exists, 30, "the console to exit")
        assert exit_file.read_text().strip() == "0"
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(tmux, runs)}") from None
    finally:
        tmux.end()
        kill_runs(runs)


def test_run_without_headless_opens_the_console_and_attach_shows_a_failure(tmp_path):
    runs = tmp_path / "runs"
    profile = fast_profile(tmp_path, max_steps=30)
    tmux, exit_file = console(tmp_path, "run", str(profile), "--runs-dir", str(runs))
    try:
        tmux.wait(" finished ", 120)
        assert "30/30" in tmux.pane()
        tmux.keys("q")
        wait_for(exit_file.exists, 30, "the console to exit")
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.end()
        kill_runs(runs)

    failed = synthetic.write_run(runs / "crash-20260101-000000", state="failed")
    tmux, exit_file = console(tmp_path, "attach", failed.name, "--runs-dir", str(runs))
    try:
        pane = tmux.wait("FAILED", 30)
        assert "rank 1" in pane and "exit code 1" in pane
        tmux.keys("q")
        wait_for(exit_file.exists, 30, "the console to exit")
        assert exit_file.read_text().strip() == "1"  # the run's own exit code (DESIGN.md)
    finally:
        tmux.end()


def test_a_mixture_of_experts_run_shows_its_experts_in_the_console(tmp_path):
    """The built-in moe with its experts spread over 2 CPU ranks, in the real console at
    80×24: the experts panel shows each expert's share of the tokens as the run trains, and
    the log keeps 40 columns beside it."""
    runs = tmp_path / "runs"
    sets = ["task.d_model=32", "task.n_heads=2", "task.num_experts=4", "task.seq_len=32",
            "data.batch_size=16", "train.max_steps=30", "train.log_every=5", "train.eval_every=0",
            "checkpoint.every_steps=0", "task.expert_parallel=true"]  # fmt: skip
    args = ["run", "moe", "--devices", "cpu:2", "--runs-dir", str(runs)]
    tmux, exit_file = console(
        tmp_path, *args, *[x for s in sets for x in ("--set", s)], size=(80, 24)
    )
    try:
        pane = tmux.wait(" finished ", 120)
        assert "experts · % of tokens" in pane and "│ even share 25.0%" in pane, pane
        assert all(f"e{i} " in pane for i in range(4)), pane
        top = next(line for line in pane.splitlines() if "╭─ log " in line)
        assert len(top[top.index("╭─ log ") :].rstrip()) >= 40, pane  # the log's width
        run = only_run(runs)
        assert events_of(run, "start")[0]["strategy"] == "expert"
        tmux.keys("q")
        wait_for(exit_file.exists, 30, "the console to exit")
        assert exit_file.read_text().strip() == "0"
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(tmux, runs)}") from None
    finally:
        tmux.end()
        kill_runs(runs)
