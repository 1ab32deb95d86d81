"""The run directory: creating it, atomic JSON, status, checkpoints' LATEST, finding runs.

The run directory is the source of truth (see DESIGN.md); every rewritten document goes
through :func:`atomic_write_text`, so a reader never sees half a file. No torch here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

STATUS = "status.json"
FINAL_STATES = {"finished", "stopped", "failed"}


class RunDirError(Exception):
    """A runs directory or run that cannot be used as asked."""


def default_runs_dir() -> Path:
    return Path(os.environ.get("GPU_CONSOLE_RUNS") or "runs")


def atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: all or nothing."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    return slug or "run"


def create_run_dir(runs_dir: Path, name: str) -> Path:
    """``runs_dir/<name>-<YYYYmmdd-HHMMSS>`` (0700), with logs/ and checkpoints/ inside."""
    runs_dir = Path(runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{runs_dir}: cannot create the runs directory ({e.strerror})") from None
    if not os.access(runs_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"{runs_dir}: the runs directory is not writable")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{_slug(name)}-{stamp}"
    for n in range(1, 1000):
        path = runs_dir / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as e:
            raise RunDirError(f"{runs_dir}: cannot create a run directory ({e.strerror})") from None
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
        (path / "logs").mkdir()
        (path / "checkpoints").mkdir()
        fd = os.open(path / "control.jsonl", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
        return path
    raise RunDirError(f"{runs_dir}: too many runs named {base}")


def read_status(run_dir: Path) -> dict[str, Any]:
    return read_json(Path(run_dir) / STATUS) or {}


def write_status(run_dir: Path, status: dict[str, Any]) -> None:
    atomic_write_json(Path(run_dir) / STATUS, status)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint named by ``checkpoints/LATEST``, if any."""
    ckpts = Path(run_dir) / "checkpoints"
    try:
        name = (ckpts / "LATEST").read_text().strip()
    except FileNotFoundError:
        return None
    path = ckpts / name
    return path if name and (path / "meta.json").is_file() else None


def find_run(arg: str, runs_dir: Path) -> Path:
    """RUN is a run directory, or a run's name (or a prefix of one) under the runs directory."""
    path = Path(arg).expanduser()
    if (path / "run.toml").is_file():
        return path
    candidate = Path(runs_dir) / arg
    if (candidate / "run.toml").is_file():
        return candidate
    matches = sorted(
        (p for p in Path(runs_dir).glob(f"{arg}*") if (p / "run.toml").is_file()),
        key=lambda p: p.name,
    )
    if matches:
        return matches[-1]
    raise RunDirError(f"{arg}: no such run (looked for a directory and under {runs_dir})")
