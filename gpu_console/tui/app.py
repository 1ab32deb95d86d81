"""The Textual app: screens and keys wired together (see DESIGN.md and issue 4).

``ConsoleApp(runs_dir=...)`` opens on the launch screen; with ``run_dir`` it opens on that
run (``owner``: this console started it, so it records ``telemetry.jsonl``; ``readonly``:
a viewer whose keys cannot control the run). ``app.run()`` returns the exit code.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import ModalScreen, Screen

# Screens are imported where they are first needed: the first frame pays only for its own.
if TYPE_CHECKING:
    from .screens.run import RunScreen


def _run_screen_class():
    from .screens.run import RunScreen

    return RunScreen


def _is(screen: object, name: str) -> bool:
    """``isinstance`` by class name, so that checking does not import the screen's module."""
    return any(cls.__name__ == name for cls in type(screen).__mro__)


class ConsoleApp(App[int]):
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses live elsewhere
    TITLE = "gpu-console"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("r", "runs", "runs"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("escape", "to_sweep", "sweep", show=False),
    ]

    def __init__(
        self,
        *,
        runs_dir: Path,
        run_dir: Path | None = None,
        owner: bool = False,
        supervisor: subprocess.Popen | None = None,
        readonly: bool = False,
        clock: Callable[[], float] = time.time,
        refresh_s: float = 0.2,
        sample_interval_s: float = 1.0,
        telemetry: bool = True,
        devices_every_s: float = 3.0,
        sweep_dir: Path | None = None,
    ) -> None:
        super().__init__()
        self.runs_dir = Path(runs_dir)
        self.start_run = run_dir
        self.start_owner = owner
        self.start_supervisor = supervisor
        self.readonly = readonly
        self.run_options = {
            "clock": clock,
            "refresh_s": refresh_s,
            "sample_interval_s": sample_interval_s,
            "telemetry": telemetry,
        }
        self.devices_every_s = devices_every_s
        self.sweep_dir = sweep_dir

    def get_default_screen(self) -> Screen:
        """The first screen is the default one: no blank screen is drawn before it."""
        if self.start_run is not None:
            return self._run_screen(self.start_run, self.start_owner, self.start_supervisor)
        if self.sweep_dir is not None:
            from .screens.sweep import SweepScreen

            return SweepScreen(self.sweep_dir)
        from .screens.launch import LaunchScreen

        return LaunchScreen(self.runs_dir, self.devices_every_s)

    def _run_screen(
        self, run_dir: Path, owner: bool = False, supervisor: subprocess.Popen | None = None
    ) -> RunScreen:
        return _run_screen_class()(
            run_dir, owner=owner, supervisor=supervisor, readonly=self.readonly, **self.run_options
        )

    # -- navigation ------------------------------------------------------------------------
    def open_run(
        self, run_dir: Path, owner: bool = False, supervisor: subprocess.Popen | None = None
    ) -> None:
        """Show ``run_dir`` on a run screen (from the launch or the runs screen)."""
        if _is(self.screen, "RunsScreen"):
            self.pop_screen()
        current = self.screen
        if _is(current, "RunScreen"):
            if current.run_dir.resolve() == Path(run_dir).resolve():
                return
            self.switch_screen(self._run_screen(run_dir, owner, supervisor))
        else:
            self.push_screen(self._run_screen(run_dir, owner, supervisor))

    def finish(self, code: int, message: str | None = None) -> None:
        """Quit with ``code`` as the process's exit code (and ``message`` printed after)."""
        self.exit(code, return_code=code, message=message)

    def run_screen(self) -> RunScreen | None:
        for screen in reversed(self.screen_stack):
            if _is(screen, "RunScreen"):
                return screen
        return None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("runs", "help") and isinstance(self.screen, ModalScreen):
            return False
        return not (action == "runs" and _is(self.screen, "RunsScreen"))

    def action_runs(self) -> None:
        from .screens.runs import RunsScreen

        self.push_screen(RunsScreen(self.runs_dir))

    def action_to_sweep(self) -> None:
        """Back to the sweep screen from a trial's run screen opened on it."""
        if len(self.screen_stack) > 1 and _is(self.screen_stack[-2], "SweepScreen"):
            self.pop_screen()

    def action_help(self) -> None:
        from .screens.modals import HelpScreen

        self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        if isinstance(self.screen, ModalScreen):
            self.screen.dismiss(None)
            return
        screen = self.run_screen()
        if screen is None:
            self.finish(0)
            return
        if not screen.live or self.readonly:
            self.finish(screen.exit_code())
            return
        name = screen.run_dir.name

        def answer(choice: str | None) -> None:
            if choice == "stop":
                from ..events import append_control

                append_control(screen.run_dir, "stop")  # one line, before the app goes away
                self.finish(
                    0,
                    f"stop requested: {name} writes a checkpoint and exits. "
                    f"Follow it: gpu-console attach {screen.run_dir}",
                )
            elif choice == "detach":
                screen.action_detach()

        from .screens.modals import QuitScreen

        self.push_screen(QuitScreen(name), answer)

    # -- command palette -------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        run = screen if _is(screen, "RunScreen") else None
        if run is not None and run.live and not self.readonly:
            yield SystemCommand("Checkpoint now", "Write a checkpoint at the next step (c)",
                                run.action_checkpoint)  # fmt: skip
            yield SystemCommand("Pause / resume", "Pause the run, or resume it (p)",
                                run.action_pause)  # fmt: skip
            yield SystemCommand("Stop the run", "Checkpoint, then exit; asks y/n (s)",
                                run.action_stop)  # fmt: skip
            yield SystemCommand("Kill the run", "Kill it now, no checkpoint; asks y/n (k)",
                                run.action_kill)  # fmt: skip
            yield SystemCommand("Profile", "Trace the next 5 steps with torch.profiler (t)",
                                run.action_profile)  # fmt: skip
            yield SystemCommand("Detach", "Quit; the run keeps training (d)", run.action_detach)
        if run is not None:
            yield SystemCommand("Loss window", "Whole run / last 10k / 1k / 100 steps (w)",
                                run.action_window)  # fmt: skip
            yield SystemCommand("Chart series", "Loss, then each of the task's train metrics (m)",
                                run.action_series)  # fmt: skip
        if _is(screen, "LaunchScreen"):
            yield SystemCommand("Launch", "Launch the highlighted profile (Enter)",
                                screen.action_launch)  # fmt: skip
        yield SystemCommand("Runs", "Runs under the runs directory (r)", self.action_runs)
        yield SystemCommand("Help", "Keys and states (?)", self.action_help)
        yield from super().get_system_commands(screen)
