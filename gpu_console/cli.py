"""The ``gpu-console`` command: parses, calls, and maps errors to exit codes.

Errors are typed where they arise (ProfileError, LaunchError, RunDirError) and turned into
one-line messages here, with exit code 2. Heavy modules are imported inside commands so
``--help`` stays fast, and nothing here imports torch (DESIGN.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from typer.core import TyperCommand

from . import __version__


class Command(TyperCommand):
    """A command whose help names each argument by its metavar (``RUN``), as its options are
    (``--set KEY=VALUE``): this Typer writes ``{run}`` and ``RUN <str>`` for arguments."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces += param.get_usage_pieces(ctx)
        return pieces

    def format_options(self, ctx: typer.Context, formatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append((param.metavar or param.name.upper(), record[1]))
            else:
                opts.append(record)
        for title, records in (("Arguments", args), ("Options", opts)):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class App(typer.Typer):
    """Every command of the app is a :class:`Command`."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or Command, **kwargs)


app = App(
    name="gpu-console",
    help="A terminal training console for PyTorch: launch torchrun, watch, stop with a checkpoint.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1  # a request the run could not act on (stop or checkpoint to a stalled run)

RunsDirOpt = typer.Option(
    None,
    "--runs-dir",
    metavar="DIR",
    help="Runs directory (default: gpu-console --runs-dir DIR before the command, else "
    "$GPU_CONSOLE_RUNS, else ./runs).",
)
RootRunsDirOpt = typer.Option(
    None,
    "--runs-dir",
    metavar="DIR",
    help="Runs directory of the console and of every command (default: $GPU_CONSOLE_RUNS or "
    "./runs); a command's own --runs-dir must name the same one.",
)
RUN_HELP = "Run directory, or a run name under the runs directory."
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")


def _runs_dir(ctx: typer.Context, value: Path | None) -> Path:
    """The runs directory a command uses: its own ``--runs-dir``, else the one given before the
    command (``gpu-console --runs-dir DIR ls``), else ``$GPU_CONSOLE_RUNS``, else ``./runs``.
    Both flags naming different directories is a bad input (one line, exit 2): a launch must
    not guess which of two places the user meant."""
    from .runs import RunDirError, default_runs_dir

    group = ctx.find_root().params.get("runs_dir")
    if value is not None and group is not None and not _same_dir(value, group):
        raise RunDirError(
            f"--runs-dir given twice: {group} before the command and {value} after it; give one"
        )
    if value is not None:
        return value
    return group if group is not None else default_runs_dir()


def _same_dir(a: Path, b: Path) -> bool:
    return a == b or a.resolve() == b.resolve()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpu-console {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    runs_dir: Path | None = RootRunsDirOpt,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Without a command: the console opens on the launch screen."""
    if ctx.invoked_subcommand is None:
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            typer.echo(ctx.get_help())
            typer.echo("\nThe console needs a terminal; without one use `run --headless`.")
            return
        from .tui.app import ConsoleApp

        raise typer.Exit(_run_tui(ConsoleApp(runs_dir=_runs_dir(ctx, runs_dir))))


@app.command()
def run(
    ctx: typer.Context,
    profile: str | None = typer.Argument(
        None,
        metavar="PROFILE",
        help="Profile name (./profiles/NAME.toml, then built-in) or a TOML file.",
    ),
    headless: bool = typer.Option(False, "--headless", help="Report progress as text, no TUI."),
    devices: str | None = typer.Option(
        None, "--devices", metavar="DEVICES", help="auto | GPU indices like 0,1 | cpu | cpu:N"
    ),
    precision: str | None = typer.Option(
        None, "--precision", metavar="PRECISION", help="auto | fp32 | bf16 | fp16"
    ),
    overrides: list[str] | None = typer.Option(
        None,
        "--set",
        metavar="KEY=VALUE",
        help="Override a profile key: --set train.lr=3e-4 (repeatable); an entry of a table "
        "key: --set task.config.n_layer=4.",
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="RUN",
        help="Continue this run (dir or name) from its newest checkpoint, in its own directory; "
        "auto: the run this SLURM job started, if any (a requeued job continues it).",
    ),
    runs_dir: Path | None = RunsDirOpt,
    name: str | None = typer.Option(
        None, "--name", metavar="NAME", help="Run name (default: profile name)."
    ),
    exact_name: bool = typer.Option(
        False,
        "--exact-name",
        help="The run directory is exactly NAME (--name), not NAME-YYYYmmdd-HHMMSS; never reused.",
    ),
    nnodes: str | None = typer.Option(
        None,
        "--nnodes",
        metavar="N",
        help="Machines in the run: N or MIN:MAX (torchrun's --nnodes).",
    ),
    node_rank: int | None = typer.Option(
        None, "--node-rank", metavar="RANK", help="This machine's rank (torchrun's --node-rank)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None,
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="HOST:PORT of the c10d rendezvous, the same on every node.",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check everything, build the model once, print the plan; "
        "start nothing, write nothing.",
    ),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    no_step: bool = typer.Option(
        False,
        "--no-step",
        help="With --dry-run: build only, without the one training micro-batch and eval "
        "batch per split it runs on the CPU.",
    ),
) -> None:
    """Start a run. The run keeps training if this terminal goes away."""
    from . import launch, slurm

    nodes = launch.job_nodes(launch.parse_nodes(nnodes, node_rank, rdzv_endpoint), slurm.job())
    if as_json and not dry_run:
        raise launch.LaunchError("--json: only with --dry-run (a run reports with --headless)")
    if no_step and not dry_run:
        raise launch.LaunchError("--no-step: only with --dry-run")

    if precision is not None and precision not in ("auto", "fp32", "bf16", "fp16", "fp64"):
        raise launch.LaunchError(
            f"--precision: expected one of auto, fp32, bf16, fp16, fp64 (got {precision!r})"
        )
    if devices is not None:
        from .devices import DeviceSpecError, parse_devices

        try:
            parse_devices(devices)
        except DeviceSpecError as e:
            raise launch.LaunchError(f"--devices: {e}") from None
    folder = _runs_dir(ctx, runs_dir)
    prof, placement, resume_from = launch.prepare(
        profile,
        devices=devices,
        precision=precision,
        overrides=overrides,
        resume=resume,
        runs_dir=folder,
        name=name,
        nodes=nodes,
        build_data=not dry_run,  # the plan builds them, and judges them by the same rule
        exact_name=exact_name,
    )
    for note in [*prof.notes, placement.note]:
        if note:
            print(note, file=sys.stderr)
    if dry_run:
        from . import dry_run as plan
        from .held_signals import release

        release()  # a dry run starts nothing a signal should wait for

        said = len(prof.notes)
        try:
            built = plan.build(prof, placement, resume_from, folder, profile_arg=profile,
                               devices=devices, overrides=overrides, nodes=nodes,
                               step=not no_step)  # fmt: skip
        finally:
            launch.release_resumes()  # a dry run starts no session: the run is as it found it
        for note in prof.notes[said:]:  # what the plan found (a user task's epochs in steps)
            print(note, file=sys.stderr)
        raise typer.Exit(plan.show(built, as_json))
    from .timings import process_start_time

    launched = launch.start(
        prof, placement, folder, resume_from, nodes=nodes, launched=process_start_time(),
        exact_name=exact_name,
    )  # fmt: skip
    # After the checks (a bad input fails before Rich loads) and after the supervisor started
    # (its start-up overlaps this import).
    from . import headless as reporter

    if launched.run_dir.parent.resolve() != folder.resolve():
        folder = launched.run_dir.parent  # a resumed run lives where it always has
    if headless or not (sys.stdin.isatty() and sys.stdout.isatty()):
        # Without a terminal (a pipe, CI, nohup) the console reports as text.
        raise typer.Exit(reporter.follow(launched.run_dir, launched.supervisor))
    from .held_signals import release
    from .tui.app import ConsoleApp

    release()  # the console's own: a signal meant for the run reaches its supervisor directly
    tui = ConsoleApp(runs_dir=folder, run_dir=launched.run_dir, owner=True,
                     supervisor=launched.supervisor)  # fmt: skip
    raise typer.Exit(_run_tui(tui))


@app.command("attach")
def attach_cmd(
    ctx: typer.Context,
    run: str | None = typer.Argument(
        None,
        metavar="RUN",
        help="Run directory, or a run name under the runs directory (default: newest).",
    ),
    readonly: bool = typer.Option(
        False, "--readonly", help="Watch only: the keys that control the run are off."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Open the console on a running or finished run."""
    from .runs import RunDirError, find_run
    from .tui.app import ConsoleApp

    folder = _runs_dir(ctx, runs_dir)
    if run is None:
        from .commands.runs import list_runs

        rows = list_runs(folder)
        if not rows:
            raise RunDirError(f"{folder}: no runs to attach to")
        path = Path(rows[0]["path"])
    else:
        path = find_run(run, folder)
    raise typer.Exit(_run_tui(ConsoleApp(runs_dir=folder, run_dir=path, readonly=readonly)))


def _run_tui(tui) -> int:
    """Run the Textual console; its exit code is the run's (DESIGN.md), 0 on detach."""
    tui.run()
    return tui.return_code or 0


@app.command()
def profiles() -> None:
    """List built-in and local profiles with one-line descriptions."""
    from .commands import profiles as command

    command.main()


@app.command("devices")
def devices_cmd(
    as_json: bool = JsonOpt,
) -> None:
    """GPUs as NVML sees them (or why it cannot), and which look busy."""
    from .commands import devices as command

    raise typer.Exit(command.main(as_json))


@app.command("check")
def check_cmd(
    ctx: typer.Context,
    as_json: bool = JsonOpt,
    runs_dir: Path | None = RunsDirOpt,
    timeout: float = typer.Option(
        120.0,
        "--timeout",
        min=1.0,
        metavar="SECONDS",
        help="Seconds each torch subprocess may take.",
    ),
) -> None:
    """Diagnose the environment: torch, CUDA, NCCL/gloo, NVML, bf16, a real collective."""
    from .commands import check as command

    raise typer.Exit(command.main(as_json, _runs_dir(ctx, runs_dir), timeout))


@app.command("ls")
def ls_cmd(
    ctx: typer.Context,
    as_json: bool = JsonOpt,
    runs_dir: Path | None = RunsDirOpt,
    state: list[str] = typer.Option(
        [],
        "--state",
        metavar="STATE",
        help="Only runs in this state (repeat, or a,b; live and ended stand for their states).",
    ),
    since: str | None = typer.Option(
        None,
        "--since",
        metavar="WHEN",
        help="Only runs started since WHEN: a time ago (90m, 2h, 3d, 1w) or a date (2026-11-25).",
    ),
    profile: str | None = typer.Option(
        None,
        "--profile",
        metavar="NAME",
        help="Only runs of this profile (or run) name; a shell pattern like 'cvrp*'.",
    ),
    sort: str | None = typer.Option(
        None,
        "--sort",
        metavar="KEY",
        help="started or updated (newest first), name, state, step (furthest first), loss or "
        "best_loss (lowest first); default: the newest session first.",
    ),
    sweep: str | None = typer.Option(
        None,
        "--sweep",
        metavar="SWEEP",
        help="Only the trials of this sweep (its directory, or its name under the runs directory).",
    ),
) -> None:
    """Runs under the runs directory, newest first: state, step, loss, when started and
    last updated."""
    from .commands import runs as command

    folder = _runs_dir(ctx, runs_dir)
    if sweep is not None:
        from .sweep.store import find_sweep

        folder = find_sweep(sweep, folder)  # its trials are runs under its directory
    command.ls_main(folder, as_json, state, since, profile, sort)


@app.command("sweep")
def sweep_cmd(
    ctx: typer.Context,
    file: str | None = typer.Argument(
        None, metavar="SWEEP_FILE", help="The sweep file (TOML): docs/sweeps.md."
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        metavar="SWEEP",
        help="Continue a sweep (its directory, or its name under the runs directory): ended "
        "trials kept, running ones taken back, interrupted ones resumed from their checkpoints.",
    ),
    devices: str | None = typer.Option(
        None,
        "--devices",
        metavar="D",
        help="The devices trials are placed on: auto, GPU indices like 0,1, or cpu:N "
        "(default: the sweep file's sweep.devices, else auto).",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Check everything and list the trials; start nothing."
    ),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    headless: bool = typer.Option(
        False, "--headless", help="Report as text: a line per trial event, then every trial."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Run many trials of one profile, placed on the devices as they free up. The sweep
    keeps going if this terminal goes away."""
    from . import launch
    from .commands import sweep as command

    folder = _runs_dir(ctx, runs_dir)
    if as_json and not dry_run:
        raise launch.LaunchError("--json: only with --dry-run")
    if resume is not None:
        if file is not None:
            raise launch.LaunchError(
                f"SWEEP_FILE: --resume continues a sweep with its own plan; leave the file out "
                f"(got {file!r})"
            )
        if dry_run or devices is not None:
            raise launch.LaunchError(
                "--resume: a resumed sweep keeps its plan and devices (no --dry-run, --devices)"
            )
        raise typer.Exit(command.resume(resume, folder, headless))
    if file is None:
        raise launch.LaunchError("SWEEP_FILE: give a sweep file (or --resume SWEEP)")
    if devices is not None:
        from .devices import DeviceSpecError, parse_devices

        try:
            parse_devices(devices)
        except DeviceSpecError as e:
            raise launch.LaunchError(f"--devices: {e}") from None
    raise typer.Exit(command.start(file, devices, folder, dry_run, as_json, headless))


@app.command("status")
def status_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON: the run's `ls --json` entry and the summary's fields."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """One run's summary, running or ended (the table a headless run ends with)."""
    from .commands import status as command

    raise typer.Exit(command.main(run, _runs_dir(ctx, runs_dir), as_json))


@app.command("diff")
def diff_cmd(
    ctx: typer.Context,
    run_a: str = typer.Argument(..., metavar="RUN1", help=RUN_HELP),
    run_b: str = typer.Argument(..., metavar="RUN2", help=RUN_HELP),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON: the differing keys, the rows, both runs' summaries."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Two runs side by side: the profile keys that differ, then their summary figures."""
    from .commands import diff as command

    raise typer.Exit(command.main(run_a, run_b, _runs_dir(ctx, runs_dir), as_json))


@app.command("report")
def report_cmd(
    ctx: typer.Context,
    runs: list[str] = typer.Argument(..., metavar="RUN...", help=RUN_HELP),
    out: Path | None = typer.Option(
        None,
        "--out",
        metavar="DIR",
        help="Where to write (default: RUN/report/; several runs: ./report-RUN1-vs-RUN2).",
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """PNG plots and one HTML page of a run (several: their curves overlaid, their profiles
    compared), or of a sweep (its objective against each parameter, every trial's curve);
    needs matplotlib (pip install 'gpu-console[report]')."""
    from .results import report as command
    from .sweep import store

    folder = _runs_dir(ctx, runs_dir)
    if len(runs) == 1 and (sweep := store.sweep_or_none(runs[0], folder)) is not None:
        from .sweep import report as sweep_report

        raise typer.Exit(sweep_report.main(sweep, out))
    raise typer.Exit(command.main(runs, folder, out))


@app.command("stop")
def stop_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    now: bool = typer.Option(
        False, "--now", help="Kill the run's processes now: no checkpoint, state killed."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Stop a run gracefully (checkpoint, then exit), or kill it at once with --now."""
    from .commands import runs as command

    # A stalled run: StalledError, one line naming --now (exit 1, main).
    if now:  # exit 0: the kill was delivered (the run's own exit code is 137)
        path, status = command.stop_now(run, _runs_dir(ctx, runs_dir))
        if status:
            typer.echo(f"{path.name}: {status.get('state')} (exit code {status.get('exit_code')})")
        else:
            typer.echo(f"{path.name}: kill sent; its end is not recorded yet")
        return
    path, _, acks = command.request(run, _runs_dir(ctx, runs_dir), "stop")
    states = [a.get("state") for a in acks]
    if "done" in states:
        typer.echo(f"{path.name}: stopping with a checkpoint")
    else:
        typer.echo(f"{path.name}: stop requested; no acknowledgement yet (is the run paused?)")


@app.command("checkpoint")
def checkpoint_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Write a checkpoint at the next step boundary and print where it went."""
    from .commands import runs as command

    path, cid, acks = command.request(run, _runs_dir(ctx, runs_dir), "checkpoint")
    event = command.checkpoint_after(path, cid) if acks else None
    if event is None:
        typer.echo(f"{path.name}: checkpoint requested; no acknowledgement yet", err=True)
        raise typer.Exit(1)
    size = f"{event['bytes']:,} bytes" if isinstance(event.get("bytes"), int) else "-"
    typer.echo(f"{event['path']} (step {event['step']}, {size}, {event.get('reason')})")


@app.command("profile")
def profile_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    steps: str = typer.Option(
        "5", "--steps", metavar="K", help="Steps to trace (after one warmup step), 1-1000."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the answer as JSON."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Trace the next K steps on every rank (torch.profiler) and print the trace directory."""
    from .commands import profile as command

    raise typer.Exit(command.main(run, _runs_dir(ctx, runs_dir), steps, as_json))


@app.command("export")
def export_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    out: Path = typer.Option(..., "--out", metavar="FILE", help="The file to write."),
    best: bool = typer.Option(False, "--best", help="The best checkpoint (checkpoint.keep_best)."),
    step: int | None = typer.Option(None, "--step", metavar="N", help="The checkpoint of step N."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Write the model's plain state_dict (default: the newest checkpoint's), loadable with
    torch.load and load_state_dict without gpu-console."""
    from .commands import export as command

    typer.echo(command.describe(command.export(run, _runs_dir(ctx, runs_dir), out, best, step)))


@app.command("dump")
def dump_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help=RUN_HELP),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Write each rank's Python stack (py-spy dump) into the run directory."""
    from .commands import runs as command

    raise typer.Exit(command.dump_main(run, _runs_dir(ctx, runs_dir)))


def main() -> None:
    from .devices import DeviceSpecError
    from .fold import StalledError
    from .launch import LaunchError
    from .profile import ProfileError
    from .runs import RunDirError

    try:
        app()
    except StalledError as e:  # a request the run cannot reach a step boundary to act on
        print(f"gpu-console: {e}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except ProfileError as e:
        for problem in e.problems:
            print(f"gpu-console: {problem}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except (LaunchError, RunDirError, DeviceSpecError) as e:
        print(f"gpu-console: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as e:  # a file a command reads or writes: read-only, full, gone
        print(f"gpu-console: {os_error_line(e)}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def os_error_line(e: OSError) -> str:
    """An OSError in one line naming the path and the cause (a full disk: its free space)."""
    from .diskfull import classify

    path = e.filename if e.filename is not None else ""
    full = classify(e, path) if path else None
    cause = str(full) if full is not None else (e.strerror or type(e).__name__)
    return f"{path}: {cause}" if path else cause


if __name__ == "__main__":
    main()
