"""``gpu-console run PROFILE --dry-run``: the plan of a run, with nothing written.

``cli.run`` checks the launch exactly as a real run does (``launch.prepare``: profile,
overrides, devices, resume target); then this module asks the engine what it would build
(``python -m gpu_console.engine.plan``: the task's model, datasets, optimizer and schedule,
once, on the CPU; then one real training micro-batch and one batch of each eval split, unless
``--no-step``) and prints the plan. No run directory, no runs directory, no file: a run
directory's name is only computed. No torch here (the engine's part is a subprocess).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import launch, runs, strict_json
from .batching import IN_EPOCHS, epochs_to_steps
from .devices import Placement, parse_devices
from .format import strategy_text
from .profile import Profile, find_profile
from .resume_changes import line as change_line
from .schema import show as show_value

PLAN_TIMEOUT_S = 300


class PlanTimeout(Exception):
    """The plan's subprocess ran past a caller's own (short) time limit: nothing is judged."""


def engine_plan(
    profile: Profile,
    placement: Placement,
    world_size: int,
    cwd: str,
    start_step: int = 0,
    only: str | None = None,
    timeout_s: float | None = None,
    step: bool = False,
) -> dict:
    """The engine's half of the plan, or LaunchError naming the task and what went wrong.

    ``only="data"``: the task's data sets only (``{"train_samples": N}``), a launch's check.
    ``step``: one real training micro-batch and one batch of each eval split too.
    """
    kind = profile.task_kind
    with _scratch() as scratch:
        doc = {
            "profile": profile.to_dict(),
            "device_type": placement.device_type,
            "world_size": world_size,
            "start_step": start_step,
            "only": only,
            "step": step,
            "scratch": scratch,
            "tag": _tag(),
        }
        try:
            stdout, stderr, code = _run_plan(doc, cwd, placement, timeout_s or PLAN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            if timeout_s is not None:
                raise PlanTimeout(_data_late(kind, timeout_s)) from None
            raise launch.LaunchError(
                f"task {kind}: building the model and data took longer than {PLAN_TIMEOUT_S} s"
            ) from None
    answer = _plan_answer(kind, stdout, stderr, code, doc["tag"])
    return answer["data" if only == "data" else "plan"]


def _run_plan(doc: dict, cwd: str, placement: Placement, limit_s: float) -> tuple[str, str, int]:
    """``engine/plan.py`` on ``doc``: its stdout, stderr and exit code, or TimeoutExpired past
    ``limit_s``. Whatever it started is ended with it: it runs in a process group of its own,
    killed once it has ended. Files, not pipes: a process the task left behind may hold them
    open, and they are read once the plan has ended."""
    files = [tempfile.TemporaryFile("w+") for _ in range(3)]  # noqa: SIM115 (closed below)
    stdin, out, err = files
    try:
        stdin.write(json.dumps(doc))
        stdin.seek(0)
        proc = subprocess.Popen(
            PLAN_ARGV,
            stdin=stdin,
            stdout=out,
            stderr=err,
            cwd=cwd,
            env=_plan_env(placement),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limit_s)
        finally:
            _end_group(proc)
        return _text(out), _text(err), proc.returncode
    finally:
        for file in files:
            file.close()


def _end_group(proc: subprocess.Popen) -> None:
    """``proc``'s process group killed (what the task started there, its pools too) and
    ``proc`` reaped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tag() -> str:
    """A token the plan puts on its own lines: the task's prints share its output."""
    return secrets.token_hex(8)


def _tagged(line: str, tag: str) -> dict | None:
    """``line`` as the plan's own line carrying ``tag``, else None (a line of the task's)."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("tag") == tag else None


def _scratch() -> tempfile.TemporaryDirectory:
    """The planning process's run directory, made and removed here: a plan killed at its
    time limit runs no exit handler of its own."""
    return tempfile.TemporaryDirectory(prefix="gpu-console-plan-", ignore_cleanup_errors=True)


def _text(file) -> str:
    """What a subprocess wrote to a temporary file, a stray byte of the user's own replaced."""
    with open(file.fileno(), "rb", closefd=False) as raw:
        raw.seek(0)
        return raw.read().decode(errors="replace")


PLAN_ARGV = [sys.executable, "-m", "gpu_console.engine.plan"]


def _plan_env(placement: Placement) -> dict[str, str]:
    env = launch.worker_env(placement)  # the GPUs a rank would see, the threads it would use
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # not even a user task's __pycache__
    return env


def _data_late(kind: str, timeout_s: float) -> str:
    return f"task {kind}: its data sets took over {timeout_s:.0f} s to build"


def _plan_answer(kind: str, stdout: str, stderr: str, returncode: int | None, tag: str) -> dict:
    """The plan's answer (its last line with ``tag``), or LaunchError naming the task and
    what went wrong."""
    answer = next(filter(None, (_tagged(x, tag) for x in reversed(stdout.splitlines()))), None)
    if answer is None:  # a failed import, a crash: stderr says why
        why = stderr.strip().splitlines()[-1:] or [f"exit code {returncode}"]
        raise launch.LaunchError(f"task {kind}: the plan could not be built ({why[0]})") from None
    if "error" in answer:
        raise launch.LaunchError(answer["error"])
    return answer


@dataclass
class DataSize:
    """A user task's training-set size, counted by the launch's one task subprocess and
    judged later, where ``launch.check_data`` judges it: ``samples``, or the build's
    ``error`` (a LaunchError's text), or ``late`` (past the data check's time limit)."""

    samples: int | None = None
    error: str | None = None
    late: str | None = None


class TaskProcess:
    """A user task's one subprocess before a launch (``engine/plan.py`` with ``"check"``):
    it imports the task and checks its keys at once (:meth:`verdict`), then waits; it builds
    and counts the data sets only when :meth:`count` tells it to, once every other launch
    check has passed, where the data check has always been made. One torch start-up before a
    run, not two (each is seconds). Always :meth:`close` it: a launch refused in between ends
    it, data sets unbuilt."""

    def __init__(self, profile: Profile, placement: Placement, world_size: int, cwd: str):
        self.kind = profile.task_kind
        self._closed = False
        self._stderr_last = ""
        self._scratch = _scratch()
        self._tag = _tag()
        doc = {
            "profile": profile.to_dict(),
            "device_type": placement.device_type,
            "world_size": world_size,
            "only": "data",
            "check": True,
            "scratch": self._scratch.name,
            "tag": self._tag,
        }
        # stderr: a file (closed by close()), never a pipe that fills and blocks it.
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                PLAN_ARGV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._err,
                text=True,
                errors="replace",  # a stray byte of the user's own is not the end of the answer
                cwd=cwd,
                env=_plan_env(placement),
                start_new_session=True,  # its group: what a user's data sets start ends with it
            )
        except BaseException:
            self._err.close()
            self._scratch.cleanup()
            raise
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self._send(json.dumps(doc) + "\n")

    def verdict(self) -> tuple[dict | None, str]:
        """``tasks/check.py``'s answer, or None and why there is none (the subprocess's last
        line of stderr: what a failed import said)."""
        deadline = time.monotonic() + launch.CHECK_TIMEOUT_S
        while isinstance(line := self._next(deadline), str):
            answer = _tagged(line, self._tag)  # not a line of the user's own (a print on import)
            if answer is not None and isinstance(answer.get("check"), dict):
                return answer["check"], ""
        self.close(wait_s=0.0 if line is _LATE else 5.0)  # ended: its exit code is coming
        if line is _LATE:
            return None, f"no answer within {launch.CHECK_TIMEOUT_S:.0f} s"
        return None, self._last_err() or f"exit code {self.proc.returncode}"

    def count(self, profile: Profile, timeout_s: float) -> DataSize:
        """The training set's size, counted within ``timeout_s`` (else ``late``), with the
        profile as the launch's checks left it (a resume's chosen batch size)."""
        self._send(json.dumps({"go": True, "profile": profile.to_dict()}) + "\n")
        end = time.monotonic() + timeout_s
        out = []
        while isinstance(line := self._next(end), str):
            out.append(line)
            if _tagged(line, self._tag):  # not the pipe's end: a helper of the task's may hold it
                break
        if line is _LATE:
            self.close()
            return DataSize(late=_data_late(self.kind, timeout_s))
        self.close(wait_s=5.0)
        try:
            answer = _plan_answer(
                self.kind, "".join(out), self._last_err(), self.proc.returncode, self._tag
            )
        except launch.LaunchError as e:
            return DataSize(error=str(e))
        return DataSize(samples=answer["data"]["train_samples"])

    def close(self, wait_s: float = 0.0) -> None:
        """Its process group ended (after ``wait_s`` for a process that has answered), its
        pipes and file closed. Once: later calls do nothing (its pid may be another's)."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
        _end_group(self.proc)
        self._reader.join(timeout=5)  # the pipe's end, now its writers are gone
        streams = [self.proc.stdin] + ([] if self._reader.is_alive() else [self.proc.stdout])
        for stream in streams:  # one still read (a writer that left the group) stays open
            with contextlib.suppress(OSError):
                stream.close()
        self._stderr_last = self._read_err()
        self._err.close()
        self._scratch.cleanup()

    def _send(self, text: str) -> None:
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # it ended (or was ended): its answer, or the lack of one, says why

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):
            pass  # closed under it
        self._lines.put(None)

    def _next(self, deadline: float):
        """The next line; None at its end; _LATE past ``deadline``."""
        try:
            return self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return _LATE

    def _last_err(self) -> str:
        """The subprocess's last line of stderr."""
        return self._stderr_last if self._closed else self._read_err()

    def _read_err(self) -> str:
        try:
            self._err.seek(0)
            lines = self._err.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return lines[-1] if lines else ""


_LATE = object()


def check_runs_dir(folder: Path) -> None:
    """What ``runs.create_run_dir`` would refuse, found without creating anything."""
    if folder.exists():
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise runs.RunDirError(f"{folder}: the runs directory is not writable")
        return
    parent = folder.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise runs.RunDirError(f"{folder}: cannot create the runs directory (Permission denied)")


def _no_gpu_reason() -> str:
    from .telemetry import nvml

    reason = nvml.status().reason
    return f"no GPU visible: {reason}" if reason else "no GPU granted to this user"


def _devices_from(devices: str | None, overrides: list[str] | None) -> str:
    if devices is not None:
        return "--devices"
    if any(s.split("=")[0].strip() == "hardware.devices" for s in overrides or []):
        return "--set"
    return "the profile's hardware.devices"


def _precision_why(requested: str, resolved: str, device_type: str, cap: list | None) -> str:
    if requested != "auto":
        return "as asked"
    if device_type == "cpu":
        return "auto: fp32 on CPU"
    has = f"compute capability {cap[0]}.{cap[1]}" if cap else "this GPU"
    return f"auto: {resolved} on {has}"


def build(
    profile: Profile,
    placement: Placement,
    resume_from: Path | None,
    runs_dir: Path,
    *,
    profile_arg: str | None,
    devices: str | None = None,
    overrides: list[str] | None = None,
    nodes: launch.Nodes | None = None,
    step: bool = True,
) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict: the profile's facts and the engine's; ``step``
    (not ``--no-step``): the engine also runs one micro-batch and each eval split's batch."""
    world = placement.nproc * (nodes.max_nodes if nodes else 1)
    resume_run = resume_from.parent.parent if resume_from is not None else None
    cwd = (launch.run_cwd(resume_run) if resume_run else None) or os.getcwd()
    start = 0
    if resume_from is not None:
        meta = runs.read_json(resume_from / "meta.json")  # prepare checked its step
        start = meta["step"] if isinstance(meta, dict) else 0
    built = engine_plan(profile, placement, world, cwd, start, step=step)
    # A user task's lengths in epochs: its size is known once the plan built its data (the
    # plan applied the same rule to its copy of the profile).
    if any(getattr(profile.train, k) for k in IN_EPOCHS):
        epochs_to_steps(profile, built["train_samples"], world, _refusal)
        if resume_run is not None:  # the check prepare left for now
            launch.steps_left(resume_run, start, profile.train.max_steps, _refusal)
    if resume_run is not None and nodes is None:
        run_dir, creates = resume_run, False  # a resumed run continues in its own directory
    else:
        check_runs_dir(runs_dir)
        name = profile.run_name or profile.profile.name or "run"
        run_dir, creates = runs_dir / runs.run_dir_name(name), True
    why = placement.note
    auto = parse_devices(profile.hardware.devices).kind == "auto"
    if not why and auto and placement.device_type == "cpu":
        why = f"auto: on the CPU, {_no_gpu_reason()}"
    t, c = profile.train, profile.checkpoint
    source = profile_arg or (str(resume_run / "run.toml") if resume_run else None)
    plan: dict[str, Any] = {
        "dry_run": True,
        "profile": profile.profile.name,
        "profile_file": str(find_profile(source).absolute()) if source else None,
        "devices": {
            "spec": profile.hardware.devices,
            "from": _devices_from(devices, overrides),
            "device_type": placement.device_type,
            "ranks_per_node": placement.nproc,
            "nodes": nodes.nnodes if nodes else "1",
            "world_size": world,
            "gpus": list(placement.gpus),
            "cuda_visible_devices": placement.cuda_visible_devices,
            "why": why,
        },
        "precision": built["precision"],
        "precision_why": _precision_why(
            t.precision, built["precision"], placement.device_type, built["capability"]
        ),
        "task": built["task"],
        "task_class": built["task_class"],
        "params": built["params"],
        "trainable": built["trainable"],
        "data": {
            "train_samples": built["train_samples"],
            "eval_samples": built["eval_samples"],
            "batches_per_epoch": built["batches_per_epoch"],
            "epochs": built["epochs"],
        },
        "batch_size": profile.data.batch_size,
        "grad_accum": t.grad_accum,
        "global_batch": built["global_batch"],
        "max_steps": t.max_steps,
        "lr": built["lr"],
        "lr_scaling": profile.distributed.lr_scaling,
        **built["strategy"],  # "strategy", and under fsdp "fsdp": what would be sharded
        "optimizer": built["optimizer"],
        "optimizers": built["optimizers"],
        "weight_decay": built["weight_decay"],
        "param_groups": built["param_groups"],
        "schedule": built["schedule"],
        "eval_every": t.eval_every,
        "eval_at": sorted(t.eval_at),
        "early_stop": {
            "metric": t.early_stop_metric,
            "mode": t.early_stop_direction(),
            "patience": t.early_stop_patience,
            "min_delta": t.early_stop_min_delta,
        }
        if t.early_stop_metric
        else None,
        "log_every": t.log_every,
        "compile": built["compile"],
        "activation_checkpointing": built["activation_checkpointing"],
        "checkpoint": {
            "every_steps": c.every_steps,
            "keep_last": c.keep_last,
            "at_end": c.at_end,
            "on_stop": c.on_stop,
        },
        "run_dir": str(run_dir.absolute()),
        "creates_run_dir": creates,
        "resume": None,
        "torch": built["versions"]["torch"],
        "rehearsal": built.get("rehearsal"),  # None: --no-step
    }
    if resume_run is not None:
        plan["resume"] = {
            "run": str(resume_run.absolute()),
            "checkpoint": str(resume_from.absolute()),
            "step": start,
            "changes": [ch.as_dict() for ch in launch.resume_changes(profile, resume_run, world)],
        }
    return plan


def _group_rows(groups: list[dict[str, Any]], lr: float | None) -> list[tuple[str, str]]:
    """One line per param group; its lr where it is not ``lr``."""
    rows = []
    for i, g in enumerate(groups, 1):
        own = f", lr {_n(g['lr'])}" if g["lr"] != lr else ""
        rows.append(
            (
                f"  group {i}",
                f"{g['tensors']} tensors, {g['params']:,} params, "
                f"weight_decay {g['weight_decay']:g}{own}",
            )
        )
    return rows


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _n(x: float) -> str:
    return f"{x:.3g}"


def text(plan: dict[str, Any]) -> str:
    """Plain lines, one fact each, every path whole (copyable, never cut to a width)."""
    d, s, ck = plan["devices"], plan["schedule"], plan["checkpoint"]
    rows: list[tuple[str, str]] = [("profile", f"{plan['profile']} ({plan['profile_file']})")]
    where = f"{d['ranks_per_node']} × {d['device_type']}"
    if d["device_type"] == "cuda":
        where += f" (GPU {','.join('MIG' if g is None else str(g) for g in d['gpus'])})"
    if d["nodes"] != "1":
        where += f" on each of {d['nodes']} nodes: {d['world_size']} ranks"
    rows.append(("devices", f"{where} ({d['spec']}, from {d['from']})"))
    if d["why"]:
        rows.append(("", d["why"]))
    rows.append(("precision", f"{plan['precision']} ({plan['precision_why']})"))
    rows.append(("strategy", strategy_text(plan)))
    rows.append(("task", f"{plan['task']} ({plan['task_class']})"))
    trainable = f"{plan['trainable']:,} trainable"
    if plan["trainable"] == plan["params"]:
        trainable = "all trainable"
    rows.append(("parameters", f"{plan['params']:,} ({trainable})"))
    data = plan["data"]
    evals = f", {data['eval_samples']:,} eval" if data["eval_samples"] is not None else ", no eval"
    rows.append(
        (
            "data",
            f"{data['train_samples']:,} train samples{evals}"
            + (
                f"; {data['batches_per_epoch']:,} batches per rank per epoch"
                if data["batches_per_epoch"] is not None
                else ""
            ),
        )
    )
    if plan["global_batch"] is None:  # data.batch_size = "auto"
        batch = (
            f"auto per rank (the largest that fits, searched on every rank at the start) × "
            f"{_ranks(d['world_size'])} × {plan['grad_accum']} grad_accum"
        )
    else:
        batch = (
            f"{plan['batch_size']} per rank × {_ranks(d['world_size'])} × "
            f"{plan['grad_accum']} grad_accum = {plan['global_batch']:,} global"
        )
    rows.append(("batch", batch))
    left = ""
    endless = not plan["max_steps"]
    if plan["resume"] and not endless:
        start = plan["resume"]["step"]
        left = f"{plan['max_steps'] - start:,} left after step {start}; "
    epochs = (
        f"{data['epochs']:.3g} epochs"
        if data["epochs"] is not None
        else "epochs follow the size chosen at start"
    )
    if endless:
        rows.append(("steps", "until stopped (train.max_steps = 0)"))
    else:
        rows.append(("steps", f"{plan['max_steps']:,} ({left}{epochs})"))
    scaled = f", scaled {plan['lr_scaling']}" if plan["lr_scaling"] != "none" else ""
    if s is not None:  # the profile's optimizer
        rows.append(("optimizer", f"{plan['optimizer']}, lr {_n(plan['lr'])}{scaled}"))
        rows += _group_rows(plan["param_groups"], plan["lr"])
        rows.append(("  decay", f"by {plan['weight_decay']['source']} (train.weight_decay_params)"))
        warm = f"warmup {s['warmup_steps']} steps, then " if s["warmup_steps"] else ""
        floor = _n(s["min_lr_ratio"] * plan["lr"])
        decay = (
            "constant"
            if s["kind"] == "constant"
            else f"{s['kind']} decay to {floor} at step {s.get('decay_end', s['max_steps'])}"
        )
        last = f"at step {s['max_steps']}" if s["max_steps"] else f"from step {s['decay_end']} on"
        rows.append(
            (
                "schedule",
                f"{warm}{decay} (lr {_n(s['first_lr'])} at step {s['start_step'] + 1}, "
                f"{_n(s['last_lr'])} {last})",
            )
        )
    else:  # the task's configure_optimizers()
        for o in plan["optimizers"]:
            sched = o["schedule"]["kind"]
            if o["schedule"].get("monitor"):
                sched += f" on eval {o['schedule']['monitor']}"
            rows.append((f"optimizer {o['name']}", f"{o['class']} ({o['impl']}), schedule {sched}"))
            rows += _group_rows(o["param_groups"], None)
    if (mode := plan["compile"]) is not None:
        rows.append(("compile", f"torch.compile mode {mode}" if mode else "no (eager)"))
    if (ac := plan["activation_checkpointing"])["mode"] != "none":
        rows.append(("activation ckpt", f"{ac['mode']}: {ac['blocks']} blocks of the task"))
    if endless:  # no end to evaluate at (a stop does not evaluate)
        every = f"every {plan['eval_every']} steps" if plan["eval_every"] else "never (no end)"
    else:
        every = (
            f"every {plan['eval_every']} steps and at the end"
            if plan["eval_every"]
            else "at the end"
        )
    if points := [n for n in plan.get("eval_at") or [] if endless or n <= plan["max_steps"]]:
        every = f"after steps {', '.join(map(str, points))}" + (
            "" if endless and not plan["eval_every"] else f"; {every}"
        )
    rows.append(("eval", every if data["eval_samples"] is not None else "none (no eval set)"))
    if early := plan.get("early_stop"):
        by = f" by more than {early['min_delta']:g}" if early["min_delta"] else ""
        rows.append(("early stopping", f"after {early['patience']} evals without {early['metric']} "
                     f"improving{by} ({early['mode']})"))  # fmt: skip
    cadence = [f"every {ck['every_steps']} steps"] if ck["every_steps"] else []
    cadence += ["at the end"] if ck["at_end"] and not endless else []
    cadence += ["on stop"] if ck["on_stop"] else []
    keep = f"keep last {ck['keep_last']}" if ck["keep_last"] else "keep all"
    rows.append(("checkpoint", f"{', '.join(cadence) or 'never'}; {keep}"))
    resume = plan["resume"]
    if resume:
        rows.append(("resume", f"from {resume['checkpoint']} (step {resume['step']})"))
        for i, change in enumerate(resume["changes"]):
            rows.append(("changes" if i == 0 else "", change_line(change)))
        if not resume["changes"]:
            rows.append(("changes", "none"))
    rows.append(("rehearsal", _rehearsal(plan.get("rehearsal"))))
    made = "would be created" if plan["creates_run_dir"] else "continued in place"
    rows.append(("run dir", f"{plan['run_dir']} ({made})"))
    width = max(len(k) for k, _ in rows)
    head = f"dry run of {plan['profile']}: nothing was written"
    return "\n".join([head, *(f"{k:<{width}}  {v}" for k, v in rows)])


def _rehearsal(r: dict[str, Any] | None) -> str:
    """What the dry run tried for real (on the CPU, rank 0's data)."""
    if r is None:
        return "none (--no-step: built only)"
    splits = [f"'{s}'" if s else "the eval set" for s in r["eval_splits"]]
    evals = f", one batch of {', '.join(splits)}" if splits else ""
    return f"one training micro-batch{evals} on the CPU: passed in {r['seconds']:.2f}s"


def show(plan: dict[str, Any], as_json: bool) -> int:
    print(strict_json.dumps(plan, indent=2) if as_json else text(plan))
    return 0


def _refusal(key: str, problem: str, value: Any) -> launch.LaunchError:
    return launch.LaunchError(f"{key}: {problem} (got {show_value(value)})")
