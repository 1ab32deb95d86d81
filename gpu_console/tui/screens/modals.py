"""Small modal screens: a y/n confirmation, the quit question, and the key help."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static


class ConfirmScreen(ModalScreen[bool]):
    """``y`` confirms; ``n``, Esc or ``q`` cancels."""

    BINDINGS = [
        Binding("y", "answer(True)", "yes"),
        Binding("n", "answer(False)", "no"),
        Binding("escape,q", "answer(False)", "cancel", show=False),
    ]

    def __init__(self, title: str, body: str) -> None:
        super().__init__()
        self.title_text, self.body = title, body

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(Text(self.title_text, style="bold"), classes="dialog-title")
            yield Static(Text(self.body))
            yield Static(Text.assemble(("y", "bold"), " yes   ", ("n", "bold"), "/Esc no"))

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class QuitScreen(ModalScreen[str]):
    """While the run is live: ``y`` stop it, ``d`` detach (it keeps training), ``n`` cancel."""

    BINDINGS = [
        Binding("y", "answer('stop')", "stop the run"),
        Binding("d", "answer('detach')", "detach"),
        Binding("n,escape,q", "answer('cancel')", "cancel"),
    ]

    def __init__(self, run_name: str) -> None:
        super().__init__()
        self.run_name = run_name

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(Text(f"{self.run_name} is still running", style="bold"))
            yield Static(
                Text.assemble(
                    ("y", "bold"),
                    "  stop it (checkpoint, then exit) and quit\n",
                    ("d", "bold"),
                    "  detach: quit, the run keeps training\n",
                    ("n", "bold"),
                    "  cancel (also Esc)",
                )
            )

    def action_answer(self, choice: str) -> None:
        self.dismiss(choice)


HELP = """\
Run screen
  c   checkpoint now (at the next step boundary)
  p   pause / resume
  s   stop gracefully: checkpoint, then exit (asks y/n)
  k   kill the run now, no checkpoint (asks y/n)
  t   trace the next 5 steps (torch.profiler): RUN/profiles/step-N/
  d   detach: quit the console, the run keeps training
  w   loss window: whole run / last 10k / 1k / 100 steps
  m   main chart: the loss, then each train metric the task reports
  o   write the run's report (plots and one HTML page): RUN/report/

Launch screen
  ↑↓ Enter   pick a profile and launch it
  Tab        devices (Space toggles, + / - CPU ranks), precision, overrides

Runs screen
  Enter   attach    Space   mark a run    x   compare the two marked runs

Anywhere
  r   runs under the runs directory (Enter attaches)
  ^p  command palette    ?  this help    q  quit (asks while a run is live)

Every command goes through the run's control.jsonl; its acknowledgement
(received, done or rejected) shows in the header and the log.
States: starting compiling running paused stopping finished stopped failed refused,
interrupted and killed (ended at once, no checkpoint),
and two a reader derives: stalled (no rank advanced for 10 steps' time, 30 s at least;
never while paused) and lost (no supervisor)."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Static(Text("gpu-console keys", style="bold"))
            yield Static(Text(HELP))

    def action_close(self) -> None:
        self.dismiss(None)


class DiffScreen(ModalScreen[None]):
    """Two runs side by side (``gpu-console diff``): the keys that differ, the summaries."""

    BINDINGS = [Binding("escape,q", "close", "close")]

    def __init__(self, shown: list) -> None:
        super().__init__()
        self.shown = shown

    def compose(self) -> ComposeResult:
        from textual.containers import VerticalScroll

        with VerticalScroll(classes="dialog diff"):
            yield Static(Text("two runs side by side   (esc closes)", style="bold"))
            for renderable in self.shown:
                yield Static(renderable)

    def action_close(self) -> None:
        self.dismiss(None)
