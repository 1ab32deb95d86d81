"""A run's summary: what the headless console prints at its end and ``status`` at any time.

One builder, :func:`summary_fields`, gives the figures as data (``status --json`` adds them to
the run's ``ls --json`` entry); :func:`summary_rows` words them; :func:`print_summary` lays
them out. On a terminal: a table whose long values wrap, never cut, and the paths below it,
each whole on a line of its own. Elsewhere (a pipe, CI, nohup, ``| tee``): plain
``key: value`` lines, so every path is one string to copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .format import fmt, human_bytes, human_duration, steps_text
from .runs import (
    current_session,
    damage,
    read_json,
    rebased,
    relative_text,
    shown_checkpoint,
)
from .state import RunState

# Rows whose value is a path: printed outside the table on a terminal, so none is ever folded.
PATH_ROWS = ("checkpoint", "best checkpoint", "profile", "run dir")
TRACEBACK_LINES = 6


def launch_facts(run_dir: Path) -> dict[str, Any]:
    """What the run was launched as (run.toml, meta.json): a run that failed before its
    engine's first ``start`` event is summarised with these, not with dashes."""
    from .profile import ProfileError, parse_toml

    try:
        profile = parse_toml(Path(run_dir) / "run.toml")
    except ProfileError:
        profile = {}
    train, task = profile.get("train"), profile.get("task")
    train = train if isinstance(train, dict) else {}
    task = task if isinstance(task, dict) else {}
    meta = read_json(Path(run_dir) / "meta.json")
    session = current_session(meta) if isinstance(meta, dict) else {}
    placement = session.get("placement")
    placement = placement if isinstance(placement, dict) else {}
    return {
        "max_steps": train.get("max_steps"),
        "precision": train.get("precision"),
        "task": task.get("kind"),
        "world_size": session.get("world_size"),
        "device_type": placement.get("device_type"),
    }


def summary_fields(st: RunState, run_dir: Path) -> dict[str, Any]:
    """The summary as data: the engine's figures where it reported them, else the launch's."""
    known = launch_facts(run_dir)

    def first(*values: Any) -> Any:
        return next((v for v in values if v is not None), None)

    failure = st.status.get("failure")
    # The disk's, as --resume and export take it: never one deleted, nor an older one than
    # LATEST's (a crash between LATEST and the checkpoint's event).
    checkpoint = shown_checkpoint(Path(run_dir))
    return {
        "name": Path(run_dir).name,
        "path": str(run_dir),
        "state": st.state,
        "reason": st.reason,
        "damaged": damage(run_dir),  # what the directory lacks: ls shows the same
        "step": st.step,
        "max_steps": first(st.max_steps, st.status.get("max_steps"), known["max_steps"]),
        "loss": st.loss,
        "best_loss": st.best_loss,
        "skipped_updates": st.skipped,  # nan_policy = "skip" (None under another policy)
        "eval": dict(sorted(st.eval.items())),
        "train_metrics": dict(sorted(st.train_metrics.items())),  # the task's, last values
        "samples_per_s": st.mean_samples_per_s(),
        "epoch_time": st.epoch_time(),  # the mean of whole epochs' wall times, and how many
        "mfu": st.mean_mfu(),
        "mfu_not_shown": st.mfu_not_shown,
        "task": first(st.task, known["task"]),
        "params": st.params,
        "world_size": first(st.world_size, st.status.get("world_size"), known["world_size"]),
        "device_type": first(st.device_type, known["device_type"]),
        "precision": first(st.precision, known["precision"]),
        "auto_batch": st.start.get("auto_batch"),  # data.batch_size = "auto": how it was chosen
        "env": st.start.get("env") or None,  # distributed.env: what each rank set
        "timeouts": st.start.get("timeouts"),  # distributed.startup_timeout_s, then collective's
        "peak_memory": [{"rank": r, "peak": p} for r, p in sorted(st.peak_memory.items())],
        "compile": _compile_fields(st),
        "activation_checkpointing": _held_fields(st),
        "gpus": st.gpus,
        "wall_s": st.elapsed_s(),
        "restarts": st.restarts,
        "max_restarts": st.max_restarts,
        "checkpoint": checkpoint,
        "checkpoint_gone": None if checkpoint else _gone(st, Path(run_dir)),
        "best_checkpoint": _best(st, Path(run_dir)),
        "checkpoint_failed": st.status.get("checkpoint_failed"),
        "failure": failure if isinstance(failure, dict) else None,
        "wandb": _wandb(Path(run_dir)),  # RUN/wandb.json (results/wandb_follower.py)
        "slurm": _slurm(Path(run_dir), st.status),  # the job of the latest session, its requeue
        # RUN/tensorboard/ (results/tensorboard.py), where a session wrote it
        "tensorboard": str(tb) if (tb := Path(run_dir) / "tensorboard").is_dir() else None,
        "profiles": [  # the profile command's traces, oldest first, in this run directory
            {k: e.get(k) for k in ("first_step", "last_step", "ended_by")}
            | {"path": str(p.absolute()) if (p := rebased(Path(run_dir), e.get("path"))) else None}
            for e in st.profiles
        ],
    }


def _gone(st: RunState, run_dir: Path) -> str | None:
    """The newest checkpoint the run wrote, where none is on disk now (deleted): its path."""
    if st.last_checkpoint is None:
        return None
    path = rebased(run_dir, st.last_checkpoint.get("path"))
    return str(path.absolute()) if path else None


def _best(st: RunState, run_dir: Path) -> dict[str, Any] | None:
    """checkpoint.keep_best's newest, its path as this run directory has it."""
    best = st.best_checkpoint
    if not isinstance(best, dict):
        return None
    path = rebased(run_dir, best.get("path"))
    return {**best, "path": str(path.absolute()) if path else None}


def _slurm(run_dir: Path, status: dict[str, Any]) -> dict[str, Any] | None:
    """The SLURM job the latest session ran in (meta.json) and its requeue (status.json)."""
    meta = read_json(run_dir / "meta.json")
    job = current_session(meta).get("slurm") if isinstance(meta, dict) else None
    if not isinstance(job, dict):
        return None
    requeue = status.get("requeue")
    return {**job, "requeue": requeue if isinstance(requeue, dict) else None}


def slurm_text(j: dict[str, Any]) -> str:
    text = f"job {j.get('job_id')}, node {j.get('node_id')} of {j.get('nnodes')}"
    if j.get("restart_count"):
        text += f", started {j['restart_count'] + 1} times (requeued)"
    r = j.get("requeue")
    # No answer recorded: SLURM ends the job's processes as it requeues it, often before
    # scontrol returns to the supervisor. A failure (scontrol's error, or none to run): the
    # run's reason says it, once.
    if r is not None and ("exit_code" not in r or r["exit_code"] == 0):
        done = "requeued" if "exit_code" in r else "requeue asked"
        text += f"; {done}: {' '.join(r.get('command') or [])}"
    return text


def requeue_unanswered(status: dict[str, Any]) -> bool:
    """The run ended ``requeued`` and its supervisor still waits for scontrol's answer."""
    r = status.get("requeue")
    return status.get("state") == "requeued" and isinstance(r, dict) and "exit_code" not in r


def _wandb(run_dir: Path) -> dict[str, Any] | None:
    value = read_json(run_dir / "wandb.json")
    return value if isinstance(value, dict) and value.get("state") else None


def env_text(env: dict[str, Any]) -> str:
    """``NCCL_DEBUG=INFO, MY_FLAG=x``: distributed.env as the ranks set it."""
    return ", ".join(f"{k}={v}" for k, v in env.items())


def wandb_text(w: dict[str, Any]) -> str:
    if w.get("state") == "off":
        return f"off: {w.get('why') or 'not started'}"
    if w.get("mode") == "offline":
        return f"offline run {w.get('id')}: wandb sync {w.get('dir')}"
    return f"{w.get('url') or w.get('id')}"


def _compile_fields(st: RunState) -> dict[str, Any] | None:
    """train.compile as the run did it: mode, the first step's seconds, recompiles."""
    mode = st.start.get("compile")
    if not mode:
        return None
    return {
        "mode": mode,
        "seconds": st.last_step.get("compile_s"),
        "recompiles": st.last_step.get("recompiles"),
    }


def _held_fields(st: RunState) -> dict[str, Any] | None:
    """train.activation_checkpointing and the bytes one micro-batch holds without and with."""
    held = st.start.get("activation_checkpointing")
    return held if isinstance(held, dict) else None


def compile_text(c: dict[str, Any]) -> str:
    took = f", first step {c['seconds']:.1f} s" if isinstance(c["seconds"], (int, float)) else ""
    again = f", {c['recompiles']} recompiles" if c["recompiles"] is not None else ""
    return f"{c['mode']}{took}{again}"


def held_text(h: dict[str, Any]) -> str:
    """``blocks: 1.1 MiB → 394.0 KiB held for backward per micro-batch (-65%)``."""
    without, with_ = h.get("held_without"), h.get("held_with")
    if not isinstance(without, int) or not isinstance(with_, int):
        return f"{h.get('mode')}: not measured ({h.get('not_measured') or 'another rank'})"
    saved = f" ({with_ / without - 1:+.0%})" if without else ""
    return (
        f"{h.get('mode')}: {human_bytes(without)} → {human_bytes(with_)} held for backward "
        f"per micro-batch{saved}"
    )


def skipped_text(skipped: int, steps: Any) -> str:
    """``171 of 200 (non-finite gradient; nan_policy = skip)``."""
    of = f" of {steps}" if isinstance(steps, int) and steps else ""
    return f"{skipped:,}{of} (non-finite gradient; nan_policy = skip)"


def mfu_text(f: dict[str, Any]) -> str:
    """The summary's MFU: the mean over step events, else why there is none."""
    if f["mfu"] is not None:
        return f"{f['mfu']:.1%} (mean)"
    return f["mfu_not_shown"] or "-"


def gpu_rows(gpus: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One row per GPU of the run, from its telemetry; none on a run without GPUs."""
    from .telemetry.figures import describe, several_nodes, title

    marked = several_nodes(gpus)
    return [(title(g, marked), describe(g)) for g in gpus]


def summary_rows(f: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, value) rows of :func:`summary_fields`, in the order they are shown."""
    out = [("state", f["state"] + (f" ({f['reason']})" if f["reason"] else ""))]
    if f.get("damaged"):
        out.append(("damaged", "; ".join(f["damaged"])))
    out.append(("steps", steps_text(f["step"], f["max_steps"])))
    if f["task"]:
        params = f" ({f['params']:,} parameters)" if isinstance(f["params"], int) else ""
        out.append(("task", f"{f['task']}{params}"))
    out += [("final loss", fmt(f["loss"])), ("best loss", fmt(f["best_loss"]))]
    if (skipped := f.get("skipped_updates")) is not None:
        out.append(("skipped updates", skipped_text(skipped, f["step"])))
    # A table of figures (``a/b/c``: moe_mnist's expert activations per class) is the
    # report's to draw (performance_summary.txt, expert_activations.png): counted here.
    table = [k for k in f["eval"] if k.count("/") >= 2]
    out += [(f"eval {k}", fmt(v)) for k, v in f["eval"].items() if k not in table]
    if table:
        out.append(("eval per-class figures", f"{len(table)} (gpu-console report draws them)"))
    out += [(f"train {k}", fmt(v)) for k, v in f["train_metrics"].items()]
    rate = f["samples_per_s"]
    out.append(("samples/s", f"{rate:,.0f} (mean)" if rate else "-"))
    if et := f.get("epoch_time"):
        many = f"{et['epochs']} whole epoch{'s' if et['epochs'] != 1 else ''}"
        mean = et["mean_s"]
        shown = f"{mean:.3g} s" if mean < 60 else human_duration(mean)
        out.append(("time per epoch", f"{shown} (mean of {many})"))
    out.append(("MFU", mfu_text(f)))
    devices = f"{f['world_size'] or '-'} × {f['device_type'] or '-'}, {f['precision'] or '-'}"
    out.append(("devices", devices))
    if ab := f.get("auto_batch"):
        out.append(("batch size", f"{ab['chosen']} per rank (auto, {len(ab['tried'])} tried)"))
    if f.get("env"):
        out.append(("distributed.env", env_text(f["env"])))
    out += [(f"peak memory rank {m['rank']}", human_bytes(m["peak"])) for m in f["peak_memory"]]
    if f["activation_checkpointing"]:
        out.append(("activation checkpointing", held_text(f["activation_checkpointing"])))
    if f["compile"]:
        out.append(("compile", compile_text(f["compile"])))
    out += gpu_rows(f["gpus"])
    out.append(("wall time", human_duration(f["wall_s"])))
    if f["restarts"]:
        out.append(("restarts", f"{f['restarts']} of {f['max_restarts']}"))
    run = Path(f["path"]).absolute()
    if (c := f["checkpoint"]) is not None:
        shown = relative_text(run, Path(c["path"]))
        note = f"; {c['note']}" if c.get("note") else ""
        out.append(("checkpoint", f"{shown} (step {c['step']}, {c['reason']}{note})"))
    elif gone := f.get("checkpoint_gone"):
        out.append(("checkpoint", f"none on disk ({relative_text(run, Path(gone))} is gone)"))
    if (b := f["best_checkpoint"]) is not None:
        shown = relative_text(run, Path(b["path"])) if b["path"] else "-"
        value = f"{b['metric']} {fmt(b['value'])}"
        if not (b["path"] and (Path(b["path"]) / "meta.json").is_file()):
            out.append(("best checkpoint", f"none on disk ({shown}, step {b['step']}, is gone)"))
        else:
            out.append(("best checkpoint", f"{shown} (step {b['step']}, {value})"))
    if failed := f["checkpoint_failed"]:
        out.append(
            (
                "checkpoint failed",
                f"step {failed.get('step')} ({failed.get('reason')}): "
                f"{failed.get('error')}; LATEST is {failed.get('latest') or 'none'}",
            )
        )
    if profiles := f["profiles"]:
        newest = profiles[-1]
        more = f"; {len(profiles)} captures in all" if len(profiles) > 1 else ""
        steps = f"steps {newest['first_step']}-{newest['last_step']}"
        where = relative_text(run, Path(newest["path"])) if newest["path"] else "-"
        out.append(("profile", f"{where} ({steps}{more})"))
    if failure := f["failure"]:
        out.append(("failure", failure.get("summary", "")))
        tb = (failure.get("traceback") or "").strip().splitlines()
        if tb:
            out.append(("traceback", "\n".join(tb[-TRACEBACK_LINES:])))
    if j := f.get("slurm"):
        out.append(("SLURM", slurm_text(j)))
    if w := f.get("wandb"):
        out.append(("W&B", wandb_text(w)))
    if f.get("tensorboard"):
        out.append(("tensorboard", f"tensorboard --logdir {f['tensorboard']}"))
    out.append(("run dir", f["path"]))
    return out


def summary_title(f: dict[str, Any]) -> str:
    return f"{f['name']}: {f['state']}"


def summary_table(st: RunState, run_dir: Path) -> Group:
    """The terminal's summary: a table (values wrap at the edge, never cut) and below it the
    paths, each whole on its own line."""
    table, paths = _table_and_paths(summary_fields(st, run_dir))
    return Group(table, *paths)


def _table_and_paths(f: dict[str, Any]) -> tuple[Table, list[Text]]:
    table = Table(title=summary_title(f), show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    paths = []
    for what, value in summary_rows(f):
        if what in PATH_ROWS:
            paths.append(Text.assemble((f"{what}: ", "bold"), value))
        else:
            table.add_row(what, Text(value))  # run text (reasons, tracebacks) is not markup
    return table, paths


def summary_lines(st: RunState, run_dir: Path) -> list[str]:
    """Off a terminal: ``key: value`` lines, a multi-line value (a traceback) indented."""
    f = summary_fields(st, run_dir)
    lines = [summary_title(f)]
    for what, value in summary_rows(f):
        first, *rest = value.splitlines() or [""]
        lines.append(f"{what}: {first}".rstrip() if not rest else f"{what}:")
        if rest:
            lines += [f"  {line}" for line in (first, *rest)]
    return lines


def print_summary(console: Console, st: RunState, run_dir: Path) -> None:
    if console.is_terminal:
        table, paths = _table_and_paths(summary_fields(st, run_dir))
        console.print(table)
        for line in paths:  # soft_wrap: one line however narrow; the terminal wraps it
            console.print(line, soft_wrap=True, highlight=False)
        return
    for line in summary_lines(st, run_dir):
        console.print(Text(line), soft_wrap=True, highlight=False)
