"""``gpu-console sweep SWEEP.toml`` and ``gpu-console sweep --resume SWEEP``.

A new sweep is judged in full before anything is written: the file (sweep/spec.py), each key
against the base profile, the devices and the slots they make, and every trial's launch
checks (``launch.prepare``, as ``gpu-console run`` makes them). Then the sweep's directory,
its plan and the driver (sweep/driver.py), which the console follows. No torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import launch, session_lock, strict_json
from ..devices import DeviceSpecError
from ..profile import ProfileError
from ..schema import show
from ..sweep import store
from ..sweep.follow import follow, params_text
from ..sweep.slots import Slot, cores_note, cut
from ..sweep.spec import SweepError, SweepSpec, check_keys, load_sweep, trial_sets
from ..sweep.trials import corners, grid_size, make_trials


def plan_sweep(file: str, devices: str | None, runs_dir: Path) -> tuple[SweepSpec, dict[str, Any]]:
    """The sweep's plan, every check made; nothing written."""
    spec = load_sweep(file)
    check_keys(spec)
    pool_spec = devices if devices is not None else spec.devices
    origin = "--devices" if devices is not None else f"{spec.path}: sweep.devices"
    try:
        pool = launch.resolve_placement(pool_spec)
    except DeviceSpecError as e:
        raise SweepError([f"{origin}: {e} (got {show(pool_spec)})"]) from None
    slots, why = cut(pool, spec.trial_devices)
    if not slots:
        got = show(spec.trial_devices)
        raise SweepError([f"{spec.path}: sweep.trial_devices: {why} (got {got})"])
    trials = make_trials(spec)
    problems = []
    # A search that chooses as it goes (tpe) is checked at the edges of what it may choose.
    checked = [(f"trial {n}", p) for n, p in enumerate(trials)] or [
        ("a trial", p) for p in corners(spec)
    ]
    for which, params in checked:
        try:
            launch.prepare(
                spec.profile, devices=slots[0].devices, overrides=trial_sets(spec.sets, params),
                runs_dir=runs_dir, name=store.trial_name(0),
            )  # fmt: skip
        except ProfileError as e:
            problems += [f"{spec.path}: {which} ({params_text(params)}): {p}" for p in e.problems]
        except launch.LaunchError as e:
            problems.append(f"{spec.path}: {which} ({params_text(params)}): {e}")
        if len(problems) >= 10:
            problems.append(f"{spec.path}: more trials not checked after these")
            break
    if problems:
        raise SweepError(problems)
    plan = {
        "version": 1,
        "sweep": spec.as_dict(),
        "objective": {"metric": spec.metric, "direction": spec.direction, "use": spec.use},
        "pruning": {
            "kind": spec.pruner,
            "startup_trials": spec.startup_trials,
            "warmup_evals": spec.warmup_evals,
        },  # fmt: skip
        "pool": pool_spec,
        "slots": [s.as_dict() for s in slots],
        "grid": grid_size(spec) if spec.search == "grid" else None,
        "params": spec.params_dict(),
        "trials": [
            {"trial": n, "params": params, "sets": trial_sets(spec.sets, params)}
            for n, params in enumerate(trials)
        ],
    }
    return spec, plan


def show_plan(plan: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return strict_json.dumps(plan, indent=2)
    sweep = plan["sweep"]
    slots = [Slot.from_dict(s) for s in plan["slots"]]
    count = sweep["trials"] if sweep["search"] == "tpe" else len(plan["trials"])
    lines = [
        f"sweep {sweep['name']}: {count} trials ({sweep['search']}"
        + (f", of a grid of {plan['grid']}" if plan["grid"] else "")
        + f"), {len(slots)} at a time on {', '.join(s.describe() for s in slots)}",
        f"base profile: {sweep['profile']}",
        f"objective: {plan['objective']['metric']} ({plan['objective']['direction']}, "
        f"{plan['objective']['use']} eval)",
    ]
    if plan["pruning"]["kind"] != "none":
        p = plan["pruning"]
        lines.append(f"pruning: {p['kind']} (after {p['startup_trials']} trials finished, "
                     f"from a trial's eval {p['warmup_evals'] + 1})")  # fmt: skip
    if sweep.get("max_minutes"):
        lines.append(f"budget: no trial starts after {sweep['max_minutes']:g} minutes")
    keys = sweep["parameters"]
    if sweep["search"] == "tpe":
        lines.append("trials: chosen by Optuna's TPE as results come in, over "
                     + ", ".join(keys))  # fmt: skip
    lines += [
        f"  trial {t['trial']}: {params_text({k: t['params'][k] for k in keys})}"
        for t in plan["trials"]
    ]
    return "\n".join(lines)


def start(
    file: str, devices: str | None, runs_dir: Path, dry_run: bool, as_json: bool, headless: bool
) -> int:
    spec, plan = plan_sweep(file, devices, runs_dir)
    if dry_run:
        print(show_plan(plan, as_json))
        return 0
    slots = [Slot.from_dict(s) for s in plan["slots"]]
    if note := cores_note(slots):
        print(note, file=sys.stderr)
    sweep_dir = store.create(runs_dir, spec.name)
    try:
        shutil.copyfile(spec.path, sweep_dir / store.FILE)
        plan["created"] = round(time.time(), 3)
        store.write_plan(sweep_dir, plan)
        proc = spawn_driver(sweep_dir)
    except BaseException:
        shutil.rmtree(sweep_dir, ignore_errors=True)
        raise
    print(show_plan(plan, False).splitlines()[0] + f"  ({sweep_dir})")
    return console(sweep_dir, proc, headless)


def console(sweep_dir: Path, proc: subprocess.Popen, headless: bool, told: int = 0) -> int:
    """The sweep screen on a terminal (quitting it leaves the sweep running), else the
    headless lines."""
    if headless or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return follow(sweep_dir, lambda: proc.poll() is None, told)
    from ..held_signals import release
    from ..tui.app import ConsoleApp

    release()
    app = ConsoleApp(runs_dir=sweep_dir, sweep_dir=sweep_dir)
    app.run()
    return app.return_code or 0


def resume(arg: str, runs_dir: Path, headless: bool = True) -> int:
    sweep_dir = store.find_sweep(arg, runs_dir)
    store.read_plan(sweep_dir)  # a damaged plan is one line, before the lock
    events = store.read_events(sweep_dir)
    last = [e for e in events if e.get("kind") == "sweep"]
    if last and last[-1].get("state") == "finished":
        raise launch.LaunchError(
            f"--resume: {sweep_dir}: the sweep finished ({last[-1].get('reason', '')}); "
            "nothing to resume"
        )
    told = (sweep_dir / store.EVENTS).stat().st_size if (sweep_dir / store.EVENTS).exists() else 0
    proc = spawn_driver(sweep_dir)
    print(f"sweep {sweep_dir.name} resumed  ({sweep_dir})")
    return console(sweep_dir, proc, headless, told)


def spawn_driver(sweep_dir: Path) -> subprocess.Popen:
    """The driver in a session of its own, holding the sweep's lock (taken here first: a
    second driver is refused in one line)."""
    try:
        lock = session_lock.take(sweep_dir, "sweep")
    except session_lock.RunLockedError as e:
        holder = f" (pid {e.pid})" if e.pid else ""
        raise launch.LaunchError(
            f"--resume: {sweep_dir}: its driver is running{holder}; one driver per sweep"
        ) from None
    try:
        lock.claim(0)
        log = open(sweep_dir / store.LOG, "ab")  # noqa: SIM115 - handed to the child
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "gpu_console.sweep.driver", str(sweep_dir.absolute()),
                 "--lock-fd", str(lock.fd)],
                pass_fds=(lock.fd,), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()
    finally:
        lock.release()
