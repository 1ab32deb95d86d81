"""Synthetic run directories that follow DESIGN.md's schema (no torch).

For tests, benchmarks and pictures: a run's files as the engine and the supervisor write
them (events.jsonl, status.json, run.toml, meta.json, torchrun.log), with a deterministic
loss curve, without training anything.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

from .. import strict_json

T0 = 1_800_000_000.0  # a fixed clock: pictures and snapshots do not change between runs
MIB = 2**20


def _dump(obj: dict[str, Any]) -> str:
    return strict_json.dumps(obj, separators=(",", ":"))


def loss_at(step: int, rng: random.Random, floor: float = 0.35) -> float:
    return floor + 2.0 / (1.0 + step / 40.0) + rng.uniform(-0.05, 0.05) * (1 + 30 / (step + 30))


def write_run(
    run_dir: Path,
    *,
    steps: int = 300,
    max_steps: int | None = None,
    log_every: int = 10,
    eval_every: int = 100,
    checkpoint_every: int = 100,
    keep_last: int = 3,
    state: str = "finished",
    device_type: str = "cpu",
    world_size: int = 2,
    precision: str = "fp32",
    task: str = "mlp",
    t0: float = T0,
    step_s: float = 0.01,
    samples_per_s: float = 16_000.0,
    tokens_per_s: float | None = None,
    failure: dict[str, Any] | None = None,
    supervisor_pid: int | None = None,
    controls: list[dict[str, Any]] | None = None,
    seed: int = 0,
) -> Path:
    """Write a run that got to ``steps`` and is now in ``state``.

    ``state`` is a final state (``finished``, ``stopped``, ``failed``: status.json has
    ``ended``) or a live one (``running``, ``paused``), whose status.json names
    ``supervisor_pid`` as the supervisor (pass a live process, or the run reads as lost).
    """
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    max_steps = max_steps or steps
    rng = random.Random(seed)
    (run_dir / "run.toml").write_text(
        f'[profile]\nname = "{run_dir.name}"\n\n[train]\nmax_steps = {max_steps}\n'
        f"log_every = {log_every}\n"
    )
    placement = {
        "device_type": device_type,
        "nproc": world_size,
        "cuda_visible_devices": ",".join(map(str, range(world_size)))
        if device_type == "cuda"
        else None,
    }
    meta = {"id": run_dir.name, "placement": placement, "world_size": world_size}
    (run_dir / "meta.json").write_text(json.dumps(meta))
    t = t0
    lines = [
        _dump({"v": 1, "t": t, "kind": "status", "state": "starting", "reason": ""}),
        _dump(
            {
                "v": 1,
                "t": t + 2.0,
                "kind": "start",
                "world_size": world_size,
                "device_type": device_type,
                "precision": precision,
                "task": task,
                "params": 76_810,
                "max_steps": max_steps,
                "start_step": 0,
            }
        ),
        _dump({"v": 1, "t": t + 2.0, "kind": "status", "state": "running", "reason": ""}),
    ]
    t += 2.0
    lr0 = 3e-3
    last_ckpt = None
    # MiB: a transformer on an 80 GiB GPU, or an MLP's process on a CPU rank.
    alloc, extra_reserved, extra_peak, per_rank = (
        (30_900, 3800, 2900, 1536) if device_type == "cuda" else (326, 26, 14, 1)
    )
    for step in range(log_every, steps + 1, log_every):
        t += step_s * log_every
        lr = lr0 * 0.5 * (1 + math.cos(math.pi * step / max_steps))
        ev: dict[str, Any] = {
            "v": 1,
            "t": round(t, 3),
            "kind": "step",
            "step": step,
            "epoch": step // 256,
            "loss": round(loss_at(step, rng), 6),
            "lr": lr,
            "grad_norm": round(0.4 + rng.random() * 0.6, 4),
            "samples_per_s": round(samples_per_s * (0.9 + 0.2 * rng.random()), 1),
            "step_time_s": step_s,
            "memory": [
                {
                    "rank": r,
                    "allocated": (alloc + r * per_rank) * MIB + step * 1024,
                    "reserved": (alloc + extra_reserved + r * per_rank) * MIB,
                    "peak": (alloc + extra_peak + r * per_rank) * MIB + step * 1024,
                }
                for r in range(world_size)
            ],
        }
        if tokens_per_s is not None:
            ev["tokens_per_s"] = round(tokens_per_s * (0.9 + 0.2 * rng.random()), 1)
        lines.append(_dump(ev))
        if eval_every and step % eval_every == 0:
            acc = round(min(0.99, 0.6 + 0.25 * step / max_steps), 4)
            loss = round(loss_at(step, rng, 0.42), 4)
            lines.append(
                _dump({"v": 1, "t": round(t, 3), "kind": "eval", "step": step, "accuracy": acc,
                       "loss": loss})
            )  # fmt: skip
        if checkpoint_every and step % checkpoint_every == 0:
            # The engine's last step is the end checkpoint's, never an interval's.
            end = state == "finished" and step == max_steps
            last_ckpt = _checkpoint(run_dir, step, t, "end" if end else "interval", keep_last)
            lines.append(_dump(last_ckpt))
    for c in controls or ():
        lines.append(_dump({"v": 1, "t": round(t, 3), "kind": "control", **c}))
    if state == "stopped":
        stopping = {"v": 1, "t": t, "kind": "status", "state": "stopping", "reason": "stop"}
        lines.append(_dump(stopping))
        last_ckpt = _checkpoint(run_dir, steps, t + 0.05, "stop", keep_last)
        lines.append(_dump(last_ckpt))
    if state in ("finished", "stopped", "paused"):
        reason = {"finished": "max_steps reached", "stopped": "stop", "paused": "requested"}[state]
        lines.append(_dump({"v": 1, "t": t + 0.1, "kind": "status", "state": state,
                            "reason": reason}))  # fmt: skip
    if state == "failed":
        lines.append(_dump({"v": 1, "t": t, "kind": "log", "level": "error",
                            "message": "rank 1 raised RuntimeError"}))  # fmt: skip
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "logs" / "torchrun.log").write_text(
        "[default0]:starting rank 0\n"
        "[default1]:starting rank 1\n"
        "[default0]:UserWarning: a synthetic warning for the log pane\n"
    )
    status: dict[str, Any] = {
        "state": state,
        "reason": "",
        "pids": {"supervisor": supervisor_pid or 0, "workers": []},
        "started": t0 - 1.0,
        "step": steps,
        "loss": None,
        "max_steps": max_steps,
        "world_size": world_size,
        "last_step_t": round(t, 3),
    }
    if state in ("finished", "stopped", "failed"):
        status.update(ended=t + 0.5, exit_code=0 if state != "failed" else 1)
        status["checkpointed_on_stop"] = state == "stopped"
        status["reason"] = {"finished": "max_steps reached", "stopped": "stop"}.get(state, "")
    if state == "failed":
        status["failure"] = failure or {
            "rank": 1,
            "exit_code": 1,
            "summary": "rank 1 failed: RuntimeError: synthetic crash at step 120",
            "traceback": 'Traceback (most recent call last):\n  File "train.py", line 7, in '
            "step\n    raise RuntimeError('synthetic crash at step 120')\n"
            "RuntimeError: synthetic crash at step 120",
        }
        status["reason"] = status["failure"]["summary"]
    if last_ckpt:
        status["last_checkpoint"] = {k: last_ckpt[k] for k in ("step", "path", "reason", "t")}
    (run_dir / "status.json").write_text(strict_json.dumps(status, indent=2))
    return run_dir


def _checkpoint(run_dir: Path, step: int, t: float, reason: str, keep_last: int) -> dict[str, Any]:
    """A checkpoint event, and its directory as the engine leaves it (a sparse state.pt of
    the event's size, meta.json, LATEST, the oldest pruned beyond ``keep_last``)."""
    ckpts = run_dir / "checkpoints"
    folder = ckpts / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "state.pt", "wb") as f:
        f.truncate(946_709)
    meta = {"step": step, "reason": reason, "world_size": 2, "t": round(t, 3)}
    (folder / "meta.json").write_text(json.dumps(meta) + "\n")
    (ckpts / "LATEST").write_text(folder.name + "\n")
    if keep_last > 0:
        for old in sorted(ckpts.glob("step-*"))[:-keep_last]:
            shutil.rmtree(old)
    return {
        "v": 1,
        "t": round(t, 3),
        "kind": "checkpoint",
        "step": step,
        "path": str(run_dir / "checkpoints" / f"step-{step:08d}"),
        "seconds": 0.012,
        "bytes": 946_709,
        "reason": reason,
    }


def write_big_events(path: Path, n: int, world_size: int = 2, t0: float = T0) -> int:
    """Append ``n`` events to ``path`` fast (string templates): steps, with an eval and a
    checkpoint every 1000 steps and a warning every 10 000. Returns the bytes written."""
    rng = random.Random(1)
    mem = ",".join(
        f'{{"rank":{r},"allocated":{341741568 + r},"reserved":{352321536 + r},'
        f'"peak":{343932928 + r}}}'
        for r in range(world_size)
    )
    head = (
        _dump({"v": 1, "t": t0, "kind": "status", "state": "starting", "reason": ""})
        + "\n"
        + _dump(
            {
                "v": 1,
                "t": t0,
                "kind": "start",
                "world_size": world_size,
                "device_type": "cpu",
                "precision": "fp32",
                "task": "mlp",
                "params": 76810,
                "max_steps": n,
                "start_step": 0,
            }
        )  # fmt: skip
        + "\n"
        + _dump({"v": 1, "t": t0, "kind": "status", "state": "running", "reason": ""})
        + "\n"
    )
    written = 0
    with open(path, "w") as f:
        f.write(head)
        written += len(head)
        buf: list[str] = []
        step = 0
        count = 3
        while count < n:
            step += 1
            t = t0 + step * 0.02
            loss = 0.35 + 2.0 / (1 + step / 4000) + rng.random() * 0.05
            buf.append(
                f'{{"v":1,"t":{t:.3f},"kind":"step","step":{step},"epoch":{step // 1000},'
                f'"loss":{loss:.6f},"lr":0.001,"grad_norm":0.5,"samples_per_s":'
                f'{16000 + rng.random() * 1000:.1f},"step_time_s":0.02,"memory":[{mem}]}}\n'
            )
            count += 1
            if step % 1000 == 0:
                buf.append(
                    f'{{"v":1,"t":{t:.3f},"kind":"eval","step":{step},"loss":{loss + 0.1:.4f},'
                    f'"accuracy":0.8}}\n{{"v":1,"t":{t:.3f},"kind":"checkpoint","step":{step},'
                    f'"path":"checkpoints/step-{step:08d}","seconds":0.01,"bytes":946709,'
                    f'"reason":"interval"}}\n'
                )
                count += 2
            if step % 10000 == 0:
                buf.append(
                    f'{{"v":1,"t":{t:.3f},"kind":"log","level":"warning",'
                    f'"message":"synthetic warning at step {step}"}}\n'
                )
                count += 1
            if len(buf) >= 10000:
                chunk = "".join(buf)
                f.write(chunk)
                written += len(chunk)
                buf.clear()
        chunk = "".join(buf)
        f.write(chunk)
        written += len(chunk)
    return written


def write_status(run_dir: Path, status: dict[str, Any]) -> None:
    """status.json, written atomically as the supervisor does."""
    tmp = Path(run_dir) / ".status.json.tmp"
    tmp.write_text(strict_json.dumps(status))
    os.replace(tmp, Path(run_dir) / "status.json")
