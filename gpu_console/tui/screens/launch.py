"""The launch screen: profile, devices, precision and a few overrides; Enter launches.

Everything that touches files, NVML or processes runs in thread workers: listing profiles,
resolving the highlighted one with the overrides (validated as typed, with ``--set``'s own
messages), sampling the GPUs every few seconds, and the launch itself. A mistake is shown
on the screen, never raised. The first frame comes before all of that, and before the
controls: see :meth:`LaunchScreen.compose`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widget import MountError, Widget
from textual.widgets import (
    Footer,
    Input,
    Label,
    OptionList,
    RadioButton,
    RadioSet,
    SelectionList,
    Static,
)
from textual.widgets.option_list import Option
from textual.widgets.selection_list import Selection

# The messages module imports the run screen's feed: the workers that post them import it,
# after the first frame.
if TYPE_CHECKING:
    from ..messages import (
        DevicesSampled,
        LaunchDone,
        LaunchFailed,
        Preview,
        PreviewReady,
        ProfileInfo,
        ProfilesListed,
    )

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def key_lines(toml: str, keys: list[str]) -> list[int]:
    """The lines (1-based, in order) of ``section.key`` names in a TOML text of flat sections."""
    wanted, section, found = set(keys), "", []
    for n, line in enumerate(toml.splitlines(), 1):
        text = line.strip()
        if text.startswith("[") and text.endswith("]"):
            section = text.strip("[]").strip()
        elif "=" in text and f"{section}.{text.partition('=')[0].strip()}" in wanted:
            found.append(n)
    return found


# The override fields: (input id, profile key, label).
FIELDS = (
    ("max_steps", "train.max_steps", "max steps"),
    ("batch_size", "data.batch_size", "batch/rank"),
    ("grad_accum", "train.grad_accum", "grad accum"),
    ("lr", "train.lr", "lr"),
)
CPU = "cpu"


class DeviceList(SelectionList[str]):
    """The devices: Space toggles one, Enter launches as it does in every other control
    (the list's own Enter toggled the highlighted device, and did nothing before one was)."""

    BINDINGS = [Binding("enter", "screen.launch", "launch", show=False)]


class PrecisionSet(RadioSet):
    """The precisions: Space or the arrows choose, Enter launches (as in the device list)."""

    BINDINGS = [Binding("enter", "screen.launch", "launch", show=False)]


def here_profiles(folder: Path) -> list[Path]:
    """The TOML files of ``folder`` (the working directory) that are profiles: every top-level
    table a profile section, at least one of them (``pyproject.toml`` is not one)."""
    from ...profile import SECTIONS, ProfileError, parse_toml

    known = {*SECTIONS, "task"}
    out = []
    for path in sorted(folder.glob("*.toml")):
        try:
            doc = parse_toml(path)
        except ProfileError:
            continue
        if doc and set(doc) <= known and all(isinstance(v, dict) for v in doc.values()):
            out.append(path)
    return out


# The lr field's label: whether the task takes train.lr (task_source.py).
LR_LABELS = {True: "lr", False: "lr unused", None: "lr if used"}


def _gpu_prompt(g: dict[str, Any]) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"GPU {g['index']} ", style="bold")
    name = str(g.get("name") or "?").removeprefix("NVIDIA ")
    t.append(f"{name}  ")
    used, total = g.get("memory_used"), g.get("memory_total")
    if isinstance(used, int) and isinstance(total, int):
        t.append(f"{used / 2**30:.1f}/{total / 2**30:.0f} GiB  ", style="dim")
    util, temp = g.get("util_gpu"), g.get("temperature_c")
    t.append(f"{'-' if util is None else util}% {'-' if temp is None else temp}°C")
    users = g.get("users") or []
    if not g.get("yours", True):
        t.append("  not yours", style="dim")  # outside the grant: shown, never picked
    elif users:
        t.append("  busy: " + ", ".join(users[:2]), style="#ffd75f")
    return t


def _cpu_prompt(n: int) -> Text:
    return Text.assemble(("CPU", "bold"), f" × {n} rank{'s' if n != 1 else ''} (gloo)")


class LaunchScreen(Screen):
    BINDINGS = [
        Binding("enter", "launch", "launch", show=True),
        Binding("plus", "cpu_ranks(1)", "+rank", show=False),
        Binding("minus", "cpu_ranks(-1)", "-rank", show=False),
    ]

    def __init__(self, runs_dir: Path, devices_every_s: float = 3.0) -> None:
        super().__init__()
        self.runs_dir = Path(runs_dir)
        self.devices_every_s = devices_every_s
        self.profiles: list[ProfileInfo] = []
        self.preview: Preview | None = None
        self.gpus: list[dict[str, Any]] = []
        self.nvml_reason = ""
        self.cpu_ranks = 2
        self.max_cpus = os.cpu_count() or 1
        self.devices_touched = False
        self.precision_touched = False
        self.launching = False
        self._devices_ready = False
        self._setting = False  # programmatic changes are not the user's

    # -- layout ----------------------------------------------------------------------------
    # Draw the screen first, fill it after: the first frame has the layout, the section titles
    # and the (empty) profile list; the controls (about thirty widgets, most of what a frame
    # costs) are mounted right after it, while the workers start.
    def compose(self) -> ComposeResult:
        with Horizontal(id="launch"):
            with Vertical(id="choices"):
                yield Label("Profile", classes="section")
                yield OptionList(id="profiles")
                yield Label("Devices", classes="section", id="devices-title")
                yield Static("", id="devices-note", classes="note")
                yield Label("Precision", classes="section", id="precision-title")
                yield Static("", id="precision-note", classes="note")
                yield Label("Overrides (empty: the profile's value)", classes="section")
                yield Horizontal(classes="fields", id="fields-0")
                yield Horizontal(classes="fields", id="fields-1")
                yield Static("", id="problems")
                yield Static(
                    "Enter launch · Tab next field · Space toggle a device · +/- CPU ranks",
                    id="launch-hint",
                )
            with VerticalScroll(id="resolved"):
                yield Static("", id="toml")

    def on_mount(self) -> None:
        self.query_one("#resolved").border_title = "resolved profile"
        self.query_one("#profiles", OptionList).focus()
        # After the first frame, as a message of its own: the callbacks that wait for that
        # frame run one after another, and would wait for the filling too.
        self.call_after_refresh(self.call_later, self._fill)

    async def _fill(self) -> None:
        if not self.is_attached:  # the app quit as soon as it started
            return
        # The workers read files and NVML in threads while the controls mount; what they post
        # is handled after this handler, when the controls are there.
        self._start_workers()
        try:
            with self.app.batch_update():  # one frame with all of them
                await self.mount(DeviceList(id="device-list"), after="#devices-title")
                buttons = [RadioButton(p, id=f"prec-{p}", value=p == "auto") for p in PRECISIONS]
                await self.mount(PrecisionSet(*buttons, id="precision"), after="#precision-title")
                for row, fields in enumerate((FIELDS[:2], FIELDS[2:])):
                    widgets: list[Widget] = []
                    for fid, _, label in fields:
                        widgets.append(Label(label, classes="field-label", id=f"label-{fid}"))
                        widgets.append(Input(id=f"set-{fid}", compact=True, classes="field"))
                    await self.query_one(f"#fields-{row}").mount_all(widgets)
                await self.mount(Footer(compact=True))
        except MountError:  # the screen went away meanwhile: a quit right at the start
            return
        self.refresh_bindings()  # a footer mounted after the focus was set shows no keys yet

    def _start_workers(self) -> None:
        self.list_profiles()
        self.sample_devices()
        self.set_interval(self.devices_every_s, self.sample_devices)

    # -- profiles and the preview ------------------------------------------------------------
    @work(thread=True, exclusive=True, group="profiles", exit_on_error=False)
    def list_profiles(self) -> None:
        from ...profile import ProfileError, list_profiles, parse_toml
        from ..messages import ProfileInfo, ProfilesListed

        listed = list_profiles()
        # A profile in the working directory, beside ./profiles: after them, before built-ins.
        seen = {p.resolve() for p, _ in listed}
        here = [(p, "here") for p in here_profiles(Path.cwd()) if p.resolve() not in seen]
        at = sum(1 for _, origin in listed if origin == "local")
        out = []
        for path, origin in listed[:at] + here + listed[at:]:
            try:
                meta = parse_toml(path).get("profile", {})
                desc = str(meta.get("description", "")) if isinstance(meta, dict) else ""
            except ProfileError as e:
                desc = f"(unreadable: {e.problems[0]})"
            out.append(ProfileInfo(path, path.stem, origin, desc))
        out.sort(key=lambda p: p.name != "quickstart")  # stable: local before built-in
        self.post_message(ProfilesListed(out))

    def on_profiles_listed(self, message: ProfilesListed) -> None:
        self.profiles = message.profiles
        ol = self.query_one("#profiles", OptionList)
        ol.clear_options()
        for p in self.profiles:
            prompt = Text(no_wrap=True, overflow="ellipsis")
            prompt.append(f"{p.name:<12}", style="bold")
            prompt.append(f" {p.description}", style="dim")
            if p.origin == "local":
                prompt.append(" (local)", style="italic dim")
            elif p.origin == "here":
                prompt.append(f" (./{p.path.name})", style="italic dim")
            ol.add_option(Option(prompt, id=str(p.path)))
        if self.profiles:
            ol.highlighted = 0
        else:
            self._problems(["no profiles found (./profiles, ./*.toml or the built-ins)"])

    @on(OptionList.OptionHighlighted, "#profiles")
    def _highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.resolve()

    @on(Input.Changed)
    def _typed(self, event: Input.Changed) -> None:
        self.resolve()

    def overrides(self) -> list[str]:
        out = []
        for fid, key, _ in FIELDS:
            value = self.query_one(f"#set-{fid}", Input).value.strip()
            if value:
                out.append(f"{key}={value}")
        return out

    def selected_path(self) -> Path | None:
        ol = self.query_one("#profiles", OptionList)
        if ol.highlighted is None or not self.profiles:
            return None
        return self.profiles[ol.highlighted].path

    def resolve(self) -> None:
        path = self.selected_path()
        if path is not None:
            self._resolve(path, self.overrides())

    @work(thread=True, exclusive=True, group="resolve", exit_on_error=False)
    def _resolve(self, path: Path, sets: list[str]) -> None:
        from ...profile import ProfileError, load_profile
        from ..messages import Preview, PreviewReady
        from ..task_source import uses_train_lr

        preview = Preview(path, sets=list(sets))
        try:
            base = load_profile(str(path))
            preview.values = {
                "max_steps": base.train.max_steps,
                "batch_size": base.data.batch_size,
                "grad_accum": base.train.grad_accum,
                "lr": base.train.lr,
            }
            preview.precision = base.train.precision
            preview.devices = base.hardware.devices
            preview.uses_train_lr = uses_train_lr(base.task_kind)
            prof = load_profile(str(path), sets) if sets else base
            preview.toml = prof.to_toml()
            preview.notes = list(prof.notes)
        except ProfileError as e:
            preview.problems = list(e.problems)
        except Exception as e:  # a broken file must not take the screen down
            preview.problems = [f"{path}: {type(e).__name__}: {e}"]
        self.post_message(PreviewReady(preview))

    def _is_current(self, p: Preview) -> bool:
        """Whether ``p`` answers for what the screen shows now: the highlighted profile and
        the overrides as typed. Thread workers run to their end, so an older answer may
        arrive after a newer one."""
        return p.path == self.selected_path() and p.sets == self.overrides()

    def on_preview_ready(self, message: PreviewReady) -> None:
        p = message.preview
        if not self._is_current(p):
            return
        changed_profile = self.preview is None or self.preview.path != p.path
        self.preview = p
        for fid, key, _ in FIELDS:
            field = self.query_one(f"#set-{fid}", Input)
            field.placeholder = str(p.values.get(fid, ""))
            field.set_class(any(f"{key}:" in problem for problem in p.problems), "-bad")
        # A task that builds its own optimizer ignores train.lr: the field says so.
        self.query_one("#label-lr", Label).update(LR_LABELS[p.uses_train_lr])
        if p.uses_train_lr is False:
            self.query_one("#set-lr", Input).placeholder = "its own optimizer"
        self._problems(p.problems, p.notes)
        toml = self.query_one("#toml", Static)
        if p.toml:
            from rich.syntax import Syntax  # pygments: not before the first frame

            # The overridden keys are marked, and the first is scrolled into view: the
            # profile has more keys than the pane has rows.
            lines = key_lines(p.toml, [s.partition("=")[0].strip() for s in p.sets])
            toml.update(
                Syntax(
                    p.toml,
                    "toml",
                    theme="ansi_dark",
                    background_color="default",
                    highlight_lines=set(lines),
                )
            )
            if lines:
                pane = self.query_one("#resolved", VerticalScroll)
                self.call_after_refresh(pane.scroll_to, y=max(0, lines[0] - 3), animate=False)
        self.query_one("#resolved").border_title = f"resolved: {p.path.stem}"
        if changed_profile and p.values:
            if not self.precision_touched:
                self._set_precision(p.precision)
            if not self.devices_touched:
                self._apply_profile_devices(p.devices)

    def _problems(self, problems: list[str], notes: list[str] = ()) -> None:
        text = Text("\n".join(problems), style="bold #ff5f5f")
        for note in [] if problems else notes:  # what a launch would change, said before it
            text.append(("\n" if text else "") + note, style="#ffd75f")
        self.query_one("#problems", Static).update(text)

    # -- devices -----------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="devices", exit_on_error=False)
    def sample_devices(self) -> None:
        from ...devices import default_cpu_ranks, read_grant
        from ...telemetry import nvml
        from ..messages import DevicesSampled

        status = nvml.status()
        gpus = [g.to_json() for g in nvml.sample_gpus()] if status.available else []
        grant = read_grant(gpus)
        for g in gpus:
            g["users"] = _users(g.get("processes") or [])
            g["yours"] = grant.owns(g["index"])
        self.post_message(
            DevicesSampled(status.available, status.reason, gpus, default_cpu_ranks())
        )

    def on_devices_sampled(self, message: DevicesSampled) -> None:
        self.gpus = message.gpus
        self.nvml_reason = message.reason
        sel = self.query_one("#device-list", SelectionList)
        if not self._devices_ready:
            self._devices_ready = True
            self.cpu_ranks = message.cpus
            self._setting = True
            yours = self._yours()
            for g in self.gpus:
                mine = str(g["index"]) in yours
                sel.add_option(Selection(_gpu_prompt(g), str(g["index"]), mine, disabled=not mine))
            sel.add_option(Selection(_cpu_prompt(self.cpu_ranks), CPU, not yours))
            self._setting = False
            if self.preview is not None and not self.devices_touched:
                self._apply_profile_devices(self.preview.devices)
        else:
            for i, g in enumerate(self.gpus[: sel.option_count - 1]):
                sel.replace_option_prompt_at_index(i, _gpu_prompt(g))
        self._update_precision_choices()

    def _apply_profile_devices(self, spec: str) -> None:
        """Show the profile's ``hardware.devices`` as the selection."""
        if not self._devices_ready:
            return
        from ...devices import DeviceSpecError, parse_devices

        try:
            parsed = parse_devices(spec)
        except DeviceSpecError:
            return
        if parsed.kind == "cpu":
            wanted = {CPU}
            if parsed.nproc:
                self.cpu_ranks = parsed.nproc
                self._cpu_prompt_refresh()
        elif parsed.kind == "cuda":
            wanted = {str(i) for i in parsed.indices} & self._yours()
        else:
            wanted = self._yours() or {CPU}
        self._set_selection(wanted)

    def _yours(self) -> set[str]:
        """The listed GPUs the environment grants (the only ones a launch may pick)."""
        return {str(g["index"]) for g in self.gpus if g.get("yours", True)}

    def _set_selection(self, wanted: set[str]) -> None:
        sel = self.query_one("#device-list", SelectionList)
        self._setting = True
        try:
            sel.deselect_all()
            for value in wanted:
                sel.select(value)
        finally:
            self._setting = False
        self._update_precision_choices()

    @on(SelectionList.SelectionToggled, "#device-list")
    def _toggled(self, event: SelectionList.SelectionToggled) -> None:
        if self._setting:
            return
        self.devices_touched = True
        value = event.selection.value
        sel = self.query_one("#device-list", SelectionList)
        # CPU and GPUs do not mix: choosing one clears the other.
        if value in sel.selected:
            if value == CPU:
                self._set_selection({CPU})
            elif CPU in sel.selected:
                self._set_selection(set(sel.selected) - {CPU})
        self._update_precision_choices()

    def action_cpu_ranks(self, delta: int) -> None:
        self.cpu_ranks = max(1, min(self.max_cpus, self.cpu_ranks + delta))
        self.devices_touched = True
        self._cpu_prompt_refresh()

    def _cpu_prompt_refresh(self) -> None:
        sel = self.query_one("#device-list", SelectionList)
        if sel.option_count:
            sel.replace_option_prompt_at_index(sel.option_count - 1, _cpu_prompt(self.cpu_ranks))
            self._update_devices_note()

    def devices_spec(self) -> str | None:
        """The ``--devices`` value of the selection; None when nothing is selected."""
        sel = self.query_one("#device-list", SelectionList)
        chosen = list(sel.selected)
        if CPU in chosen:
            return f"cpu:{self.cpu_ranks}"
        gpus = sorted(int(v) for v in chosen if v != CPU)
        return ",".join(map(str, gpus)) if gpus else None

    # -- precision ---------------------------------------------------------------------------
    def _update_devices_note(self) -> None:
        """What the launch will use, in words (the list's marks alone need colour)."""
        spec = self.devices_spec()
        if spec is None:
            text = Text("→ nothing selected (Space toggles)", style="bold #ff5f5f")
        elif spec.startswith("cpu"):
            text = Text(f"→ CPU × {self.cpu_ranks} ranks", style="bold")
        else:
            text = Text(f"→ GPU {spec}", style="bold")
        if not self.gpus:
            text.append(f"   no GPU: {self.nvml_reason or 'NVML sees none'}", style="dim")
        self.query_one("#devices-note", Static).update(text)

    def _update_precision_choices(self) -> None:
        spec = self.devices_spec() if self._devices_ready else None
        if self._devices_ready:
            self._update_devices_note()
        from ...devices import precision_refusals

        on_gpus = spec is not None and not spec.startswith("cpu")
        indices = [int(i) for i in spec.split(",")] if on_gpus else []
        known = {g["index"]: g.get("compute_capability") for g in self.gpus}
        refused = precision_refusals("cuda" if on_gpus else "cpu", indices, known)
        disabled = set(refused)
        notes = list(refused.values())
        for p in PRECISIONS:
            self.query_one(f"#prec-{p}", RadioButton).disabled = p in disabled
        if self.precision() in disabled:
            self._set_precision("auto")
        self.query_one("#precision-note", Static).update(Text("; ".join(notes), style="dim"))

    def precision(self) -> str:
        pressed = self.query_one("#precision", RadioSet).pressed_button
        return pressed.id.removeprefix("prec-") if pressed and pressed.id else "auto"

    def _set_precision(self, value: str) -> None:
        if value not in PRECISIONS:
            return
        button = self.query_one(f"#prec-{value}", RadioButton)
        if button.disabled:
            button = self.query_one("#prec-auto", RadioButton)
        self._setting = True
        try:
            button.value = True
        finally:
            self.call_after_refresh(self._done_setting)

    def _done_setting(self) -> None:
        self._setting = False

    @on(RadioSet.Changed, "#precision")
    def _precision_changed(self, event: RadioSet.Changed) -> None:
        if not self._setting:
            self.precision_touched = True

    # -- launching ---------------------------------------------------------------------------
    @on(OptionList.OptionSelected, "#profiles")
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.action_launch()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.action_launch()

    def action_launch(self) -> None:
        path = self.selected_path()
        if path is None or self.launching:
            return
        # A preview of another profile or other overrides (the newest still resolving) does not
        # judge this launch: prepare() below checks everything again.
        current = self.preview is not None and self._is_current(self.preview)
        problems = list(self.preview.problems) if current else []
        devices = self.devices_spec() if self._devices_ready else None
        if self._devices_ready and devices is None:
            problems.append("devices: select at least one (Space toggles)")
        if problems:
            self._problems(problems)
            return
        self.launching = True
        self._problems([])
        self.query_one("#problems", Static).update(Text(f"launching {path.stem}…", style="bold"))
        self._launch(
            path,
            devices if self.devices_touched else None,
            self.precision() if self.precision_touched else None,
            self.overrides(),
        )

    @work(thread=True, exclusive=True, group="launch", exit_on_error=False)
    def _launch(
        self, path: Path, devices: str | None, precision: str | None, sets: list[str]
    ) -> None:
        from ...devices import DeviceSpecError
        from ...launch import LaunchError, prepare, start
        from ...profile import ProfileError
        from ...runs import RunDirError
        from ..messages import LaunchDone, LaunchFailed

        argv = ["gpu-console", "run", str(path)]
        if devices:
            argv += ["--devices", devices]
        if precision:
            argv += ["--precision", precision]
        for s in sets:
            argv += ["--set", s]
        argv += ["--runs-dir", str(self.runs_dir)]
        try:
            prof, placement, resume_from = prepare(
                str(path),
                devices=devices,
                precision=precision,
                overrides=sets,
                runs_dir=self.runs_dir,
            )
            launched = start(prof, placement, self.runs_dir, resume_from, argv=argv)
        except ProfileError as e:
            self.post_message(LaunchFailed(list(e.problems)))
            return
        except (LaunchError, RunDirError, DeviceSpecError) as e:
            self.post_message(LaunchFailed([str(e)]))
            return
        except Exception as e:  # never crash on a launch: say what happened
            self.post_message(LaunchFailed([f"launch failed: {type(e).__name__}: {e}"]))
            return
        self.post_message(LaunchDone(launched.run_dir, launched.supervisor))

    def on_launch_failed(self, message: LaunchFailed) -> None:
        self.launching = False
        self._problems(message.problems)

    def on_launch_done(self, message: LaunchDone) -> None:
        self.launching = False
        self._problems([])
        self.app.open_run(message.run_dir, owner=True, supervisor=message.supervisor)


def _users(processes: list[dict[str, Any]]) -> list[str]:
    """ "name pid (user)" for each process on a GPU, as far as this user may see."""
    import psutil

    out = []
    for p in processes:
        pid = p.get("pid")
        try:
            proc = psutil.Process(pid)
            out.append(f"{proc.name()} {pid} ({proc.username()})")
        except (psutil.Error, TypeError):
            out.append(f"pid {pid}")
    return out
