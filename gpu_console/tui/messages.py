"""Messages that workers post to screens (``post_message`` is thread-safe)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textual.message import Message

from .feed import RunSnapshot


class RunUpdated(Message):
    def __init__(self, snapshot: RunSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class ControlSent(Message):
    """A command appended to control.jsonl (``cid``), or why it could not be (``error``)."""

    def __init__(self, cmd: str, cid: str | None, error: str = "") -> None:
        super().__init__()
        self.cmd, self.cid, self.error = cmd, cid, error


class Notice(Message):
    """A line for the header and the log: a kill's outcome, a read that failed."""

    def __init__(self, text: str, ok: bool) -> None:
        super().__init__()
        self.text, self.ok = text, ok


@dataclass
class ProfileInfo:
    path: Path
    name: str
    origin: str  # "local" (./profiles), "here" (the working directory) or "built-in"
    description: str


class ProfilesListed(Message):
    def __init__(self, profiles: list[ProfileInfo]) -> None:
        super().__init__()
        self.profiles = profiles


@dataclass
class Preview:
    path: Path
    toml: str = ""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what resolving changed (a warmup clamped)
    precision: str = "auto"
    devices: str = "auto"
    values: dict[str, Any] = field(default_factory=dict)  # the override fields' profile values
    sets: list[str] = field(default_factory=list)  # the overrides this preview resolved
    # Whether the task takes its lr from train.lr: True (a built-in), False (it builds its
    # own optimizer), None (a user task the console cannot tell: task_source.py).
    uses_train_lr: bool | None = True


class PreviewReady(Message):
    def __init__(self, preview: Preview) -> None:
        super().__init__()
        self.preview = preview


class DevicesSampled(Message):
    def __init__(self, available: bool, reason: str, gpus: list[dict[str, Any]], cpus: int):
        super().__init__()
        self.available, self.reason, self.gpus, self.cpus = available, reason, gpus, cpus


class LaunchDone(Message):
    def __init__(self, run_dir: Path, supervisor: subprocess.Popen) -> None:
        super().__init__()
        self.run_dir, self.supervisor = run_dir, supervisor


class LaunchFailed(Message):
    def __init__(self, problems: list[str]) -> None:
        super().__init__()
        self.problems = problems


class RunsListed(Message):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.rows = rows
