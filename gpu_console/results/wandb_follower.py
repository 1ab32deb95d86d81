"""The W&B mirror of a run (``[logging] wandb``): a process of its own, started by the
supervisor for its session, that follows the run directory as a console does and logs the
same scalars TensorBoard gets (:mod:`.scalars`) and the resolved profile as config.

A process, not a thread of the supervisor: ``wandb.init`` in online mode without a network
waits for its timeout, and nothing the supervisor does may wait on it. Whatever goes wrong
here (no package, no login, no network) ends this process with one line in
``RUN/wandb.json`` (``{"state": "off", "why": ...}``), which the summary shows; training
never notices. A resumed run logs into the same W&B run (its id is kept in
``RUN/wandb_id``). W&B takes steps in increasing order only: a session resumed from an
earlier checkpoint logs the steps past what the run already logged (TensorBoard, which can
purge, keeps the whole curve). Telemetry goes on the newest logged step. No torch here.

    python -m gpu_console.results.wandb_follower RUN_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from .. import runs
from ..commands.diff import flatten
from ..events import JsonlTail
from ..plain_copy import plain_stdio
from ..telemetry.fold import TELEMETRY_FILE
from ..toml_text import loads_or_empty
from . import scalars

STATUS_FILE = "wandb.json"
ID_FILE = "wandb_id"
POLL_S = 1.0
LOG_COPY_GRACE_S = 5.0  # for what wandb's core still writes once this process is done
INIT_TIMEOUT_S = float(os.environ.get("GPU_CONSOLE_WANDB_INIT_TIMEOUT_S") or 60.0)


def settings(profile_text: str) -> dict[str, Any]:
    """``[logging] wandb`` of a run.toml; empty when off."""
    table = loads_or_empty(profile_text).get("logging", {})
    value = table.get("wandb") if isinstance(table, dict) else None
    return value if isinstance(value, dict) else {}


def write_status(run_dir: Path, **fields: Any) -> None:
    runs.atomic_write_text(run_dir / STATUS_FILE, json.dumps(fields, sort_keys=True) + "\n")


def read_status(run_dir: Path) -> dict[str, Any] | None:
    value = runs.read_json(run_dir / STATUS_FILE)
    return value if isinstance(value, dict) else None


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run, the same for every session (made at the first)."""
    path = run_dir / ID_FILE
    try:
        kept = path.read_text().strip()
    except OSError:
        kept = ""
    if kept:
        return kept
    made = uuid.uuid4().hex[:12]
    runs.atomic_write_text(path, made + "\n")
    return made


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text if len(text) <= 300 else text[:297] + "..."


class Follower:
    """This session's events and telemetry, logged to W&B as they come."""

    def __init__(self, run_dir: Path, wb_run, events: JsonlTail, telemetry: JsonlTail) -> None:
        self.run_dir, self.wb, self.events, self.telemetry = run_dir, wb_run, events, telemetry
        self.last_step = -1
        self.skipped = 0  # steps at or before what the W&B run already had

    def drain(self) -> bool:
        """Log what is new; whether there was anything."""
        new = False
        for e in self.events.read():
            new = True
            kind, step = e.get("kind"), e.get("step")
            if type(step) is not int:
                continue
            if kind == "step":
                if step > self.last_step:
                    self.wb.log(scalars.of_step(e), step=step)
                    self.last_step = step
                else:
                    self.skipped += 1
            elif kind == "eval" and step >= self.last_step:
                self.wb.log(scalars.of_eval(e), step=step)
                self.last_step = step
        for s in self.telemetry.read():
            new = True
            if s.get("kind") == "sample" and self.last_step >= 0:
                self.wb.log(scalars.of_sample(s), step=self.last_step)
        return new

    def ended(self) -> bool:
        status = runs.read_status(self.run_dir)
        return bool(status.get("ended")) or status.get("state") in runs.FINAL_STATES


def main(argv: list[str]) -> int:
    run_dir = Path(argv[1])
    profile_text = (run_dir / "run.toml").read_text()
    cfg = settings(profile_text)
    if not cfg:
        return 0
    mode = cfg.get("mode", "offline")
    # Where this session starts reading: its own events; telemetry from now on.
    meta = runs.read_json(run_dir / "meta.json")
    session = runs.current_session(meta if isinstance(meta, dict) else {})
    events = JsonlTail(run_dir / "events.jsonl", int(session.get("events_from") or 0))
    tel = run_dir / TELEMETRY_FILE
    telemetry = JsonlTail(tel, tel.stat().st_size if tel.exists() else 0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's: the supervisor ends us
    try:
        import wandb
    except ImportError:
        write_status(run_dir, state="off", why="the wandb package is not installed")
        return 0
    try:
        wb = wandb.init(
            project=cfg["project"],
            entity=cfg.get("entity"),
            mode=mode,
            dir=str(run_dir),
            id=run_id(run_dir),
            resume="allow",
            name=run_dir.name,
            config=flatten(loads_or_empty(profile_text)),
            settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, console="off"),
        )
    except Exception as e:  # noqa: BLE001 (any failure to start: W&B is off, training is not)
        write_status(run_dir, state="off", mode=mode, why=_one_line(e))
        print(f"W&B off for this session: {_one_line(e)}", file=sys.stderr, flush=True)
        return 0
    where = str(Path(wb.dir).parent)  # offline: RUN/wandb/offline-run-…, what `wandb sync` takes
    write_status(run_dir, state="on", mode=mode, id=wb.id, dir=where, url=wb.url)
    f = Follower(run_dir, wb, events, telemetry)
    try:
        while not stop.is_set():
            if not f.drain() and f.ended():
                break
            stop.wait(POLL_S)
        f.drain()
    except Exception as e:  # noqa: BLE001 (a W&B error mid-run: say so, leave training alone)
        write_status(run_dir, state="off", mode=mode, id=wb.id, dir=where, why=_one_line(e))
        return 0
    finally:
        with contextlib.suppress(Exception):  # its own flush failing changes nothing now
            wb.finish()
    write_status(run_dir, state="done", mode=mode, id=wb.id, dir=where, url=wb.url,
                 skipped_steps=f.skipped, last_step=f.last_step)  # fmt: skip
    return 0


def _teardown_wandb() -> None:
    """wandb's core ends here, not in an exit handler after :func:`plain_stdio`: its last
    lines (``Find logs at: ...``) go through the copy."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        with contextlib.suppress(Exception):  # its own teardown failing changes nothing now
            wandb.teardown()


if __name__ == "__main__":
    # The supervisor made stdout logs/wandb.log; wandb colours lines whatever it writes to.
    with plain_stdio(LOG_COPY_GRACE_S):
        try:
            code = main(sys.argv)
        finally:
            _teardown_wandb()
    sys.exit(code)
