"""The ``gpu-console`` command: parses, calls, and maps errors to exit codes.

Errors are typed where they arise (ProfileError, LaunchError, RunDirError) and turned into
one-line messages here, with exit code 2. Heavy modules are imported inside commands so
``--help`` stays fast, and nothing here imports torch (DESIGN.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from . import __version__

app = typer.Typer(
    name="gpu-console",
    help="A terminal training console for PyTorch: launch torchrun, watch, stop with a checkpoint.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_BAD_INPUT = 2

RunsDirOpt = typer.Option(
    None, "--runs-dir", help="Runs directory (default: $GPU_CONSOLE_RUNS or ./runs)."
)


def _runs_dir(value: Path | None) -> Path:
    from .runs import default_runs_dir

    return value if value is not None else default_runs_dir()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpu-console {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    runs_dir: Path | None = RunsDirOpt,
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

        raise typer.Exit(_run_tui(ConsoleApp(runs_dir=_runs_dir(runs_dir))))


@app.command()
def run(
    profile: str | None = typer.Argument(
        None, help="Profile name (./profiles/NAME.toml, then built-in) or a TOML file."
    ),
    headless: bool = typer.Option(False, "--headless", help="Report progress as text, no TUI."),
    devices: str | None = typer.Option(
        None, "--devices", help="auto | GPU indices like 0,1 | cpu | cpu:N"
    ),
    precision: str | None = typer.Option(None, "--precision", help="auto | fp32 | bf16 | fp16"),
    overrides: list[str] | None = typer.Option(
        None, "--set", help="Override a profile key: --set train.lr=3e-4 (repeatable)."
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        help="Continue this run (dir or name) from its newest checkpoint, in its own directory.",
    ),
    runs_dir: Path | None = RunsDirOpt,
    name: str | None = typer.Option(None, "--name", help="Run name (default: profile name)."),
    nnodes: str | None = typer.Option(
        None, "--nnodes", help="Machines in the run: N or MIN:MAX (torchrun's --nnodes)."
    ),
    node_rank: int | None = typer.Option(
        None, "--node-rank", help="This machine's rank (torchrun's --node-rank)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous, the same on every node."
    ),
) -> None:
    """Start a run. The run keeps training if this terminal goes away."""
    from . import launch

    nodes = launch.parse_nodes(nnodes, node_rank, rdzv_endpoint)

    if precision is not None and precision not in ("auto", "fp32", "bf16", "fp16"):
        raise launch.LaunchError(
            f"--precision: expected one of auto, fp32, bf16, fp16 (got {precision!r})"
        )
    if devices is not None:
        from .devices import DeviceSpecError, parse_devices

        try:
            parse_devices(devices)
        except DeviceSpecError as e:
            raise launch.LaunchError(f"--devices: {e}") from None
    folder = _runs_dir(runs_dir)
    prof, placement, resume_from = launch.prepare(
        profile,
        devices=devices,
        precision=precision,
        overrides=overrides,
        resume=resume,
        runs_dir=folder,
        name=name,
    )
    if placement.note:
        print(placement.note, file=sys.stderr)
    from .timings import process_start_time

    launched = launch.start(
        prof, placement, folder, resume_from, nodes=nodes, launched=process_start_time()
    )
    # After the checks (a bad input fails before Rich loads) and after the supervisor started
    # (its start-up overlaps this import).
    from . import headless as reporter

    if launched.run_dir.parent.resolve() != folder.resolve():
        folder = launched.run_dir.parent  # a resumed run lives where it always has
    if headless or not (sys.stdin.isatty() and sys.stdout.isatty()):
        # Without a terminal (a pipe, CI, nohup) the console reports as text.
        raise typer.Exit(reporter.follow(launched.run_dir, launched.supervisor))
    from .tui.app import ConsoleApp

    tui = ConsoleApp(runs_dir=folder, run_dir=launched.run_dir, owner=True,
                     supervisor=launched.supervisor)  # fmt: skip
    raise typer.Exit(_run_tui(tui))


@app.command("attach")
def attach_cmd(
    run: str | None = typer.Argument(
        None, help="Run directory, or a run name under the runs directory (default: newest)."
    ),
    readonly: bool = typer.Option(
        False, "--readonly", help="Watch only: the keys that control the run are off."
    ),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Open the console on a running or finished run."""
    from .runs import RunDirError, find_run
    from .tui.app import ConsoleApp

    folder = _runs_dir(runs_dir)
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
    from rich.console import Console
    from rich.table import Table

    from .profile import ProfileError, list_profiles, parse_toml

    table = Table(show_header=True, header_style="bold", box=None)
    for col in ("name", "where", "description"):
        table.add_column(col)
    for path, origin in list_profiles():
        try:
            meta = parse_toml(path).get("profile", {})
            desc = str(meta.get("description", "")) if isinstance(meta, dict) else ""
        except ProfileError as e:
            desc = f"(unreadable: {e.problems[0]})"
        table.add_row(path.stem, origin if origin == "built-in" else str(path), desc)
    Console().print(table)


@app.command("devices")
def devices_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """GPUs as NVML sees them (or why it cannot), and which look busy."""
    from .commands import devices as command

    raise typer.Exit(command.main(as_json))


@app.command("check")
def check_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    runs_dir: Path | None = RunsDirOpt,
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, help="Seconds each torch subprocess may take."
    ),
) -> None:
    """Diagnose the environment: torch, CUDA, NCCL/gloo, NVML, bf16, a real collective."""
    from .commands import check as command

    raise typer.Exit(command.main(as_json, _runs_dir(runs_dir), timeout))


@app.command("ls")
def ls_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Runs under the runs directory: state, step, loss, age (newest first)."""
    from .commands import runs as command

    rows = command.list_runs(_runs_dir(runs_dir))
    if as_json:
        typer.echo(command.to_json(rows))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .headless import fmt, human_duration

    table = Table(box=None, header_style="bold")
    for col in ("run", "state", "step", "loss", "age"):
        table.add_column(col)
    for r in rows:
        step = f"{r['step'] or 0}/{r['max_steps'] or '-'}"
        table.add_row(Text(r["name"]), r["state"], step, fmt(r["loss"]), human_duration(r["age_s"]))
    if not rows:
        typer.echo(f"no runs under {_runs_dir(runs_dir)}")
        return
    Console().print(table)


@app.command("stop")
def stop_cmd(
    run: str = typer.Argument(..., help="Run directory, or a run name under the runs directory."),
    now: bool = typer.Option(False, "--now", help="Terminate the run's processes now."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Stop a run gracefully (checkpoint, then exit), or at once with --now."""
    from .commands import runs as command

    if now:
        path = command.stop_now(run, _runs_dir(runs_dir))
        typer.echo(f"{path.name}: terminating")
        return
    path, _, acks = command.request(run, _runs_dir(runs_dir), "stop")
    states = [a.get("state") for a in acks]
    if "done" in states:
        typer.echo(f"{path.name}: stopping with a checkpoint")
    else:
        typer.echo(f"{path.name}: stop requested; no acknowledgement yet (is the run paused?)")


@app.command("checkpoint")
def checkpoint_cmd(
    run: str = typer.Argument(..., help="Run directory, or a run name under the runs directory."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Write a checkpoint at the next step boundary and print where it went."""
    from .commands import runs as command

    path, cid, acks = command.request(run, _runs_dir(runs_dir), "checkpoint")
    event = command.checkpoint_after(path, cid) if acks else None
    if event is None:
        typer.echo(f"{path.name}: checkpoint requested; no acknowledgement yet", err=True)
        raise typer.Exit(1)
    typer.echo(f"{event['path']} (step {event['step']}, {event['bytes']:,} bytes)")


@app.command("dump")
def dump_cmd(
    run: str = typer.Argument(..., help="Run directory, or a run name under the runs directory."),
    runs_dir: Path | None = RunsDirOpt,
) -> None:
    """Write each rank's Python stack (py-spy dump) into the run directory."""
    from .commands import runs as command

    raise typer.Exit(command.dump_main(run, _runs_dir(runs_dir)))


def main() -> None:
    from .devices import DeviceSpecError
    from .launch import LaunchError
    from .profile import ProfileError
    from .runs import RunDirError

    try:
        app()
    except ProfileError as e:
        for problem in e.problems:
            print(f"gpu-console: {problem}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except (LaunchError, RunDirError, DeviceSpecError) as e:
        print(f"gpu-console: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
