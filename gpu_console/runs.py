"""The run directory: creating it, atomic JSON, status, checkpoints' LATEST, finding runs.

The run directory is the source of truth (see DESIGN.md); every rewritten document goes
through :func:`atomic_write_text`, so a reader never sees half a file. No torch here.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import tempfile
import time
import unicodedata
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import strict_json

STATUS = "status.json"
# ``interrupted`` and ``killed``: ended at once on request, no checkpoint (the supervisor's
# word: the engine never writes them).
# ``refused``: the ranks refused the user's input once they built it (engine/refusal.py).
FINAL_STATES = {
    "finished", "stopped", "requeued", "failed", "refused", "interrupted", "killed",
}  # fmt: skip

# The run's exit code (DESIGN.md "Exit codes"): the same number in status.json, ``ls --json``,
# ``status --json`` and the exit of the command that followed the run.
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_KILLED = 0, 1, 2, 130, 137


def exit_code(state: str | None, checkpointed: bool = True) -> int | None:
    """The exit code of a run that ended in ``state``; None while it is live.

    ``checkpointed``: a ``stopped`` run wrote its stop checkpoint (status.json's
    ``checkpointed_on_stop``); one that could not ended interrupted (130).
    """
    if state in ("finished", "requeued"):  # requeued: stopped with its checkpoint (slurm.py)
        return EXIT_OK
    if state == "stopped":
        return EXIT_OK if checkpointed else EXIT_INTERRUPTED
    if state == "interrupted":
        return EXIT_INTERRUPTED
    if state == "killed":
        return EXIT_KILLED
    if state in ("failed", "lost"):
        return EXIT_FAILED
    if state == "refused":  # bad input, judged by the ranks: as a launch check's refusal
        return EXIT_BAD_INPUT
    return None


def status_exit_code(status: dict[str, Any], state: str | None = None) -> int | None:
    """:func:`exit_code` from status.json (``state``: the one a reader derived, e.g. lost)."""
    checkpointed = status.get("checkpointed_on_stop") is True
    return exit_code(state or status.get("state"), checkpointed)


class RunDirError(Exception):
    """A runs directory or run that cannot be used as asked."""


def default_runs_dir() -> Path:
    return Path(os.environ.get("GPU_CONSOLE_RUNS") or "runs")


def atomic_write_text(path: Path, text: str, mode: int = 0o644, durable: bool = True) -> None:
    """Write to a temporary file beside ``path``, fsync, rename: all or nothing.

    ``durable=False``: no fsync, for a file rewritten several times a second whose next
    version comes anyway (a running run's status.json): a reader still never sees half of
    it, only a power loss may take the last few versions."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any, durable: bool = True) -> None:
    text = strict_json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write_text(path, text, durable=durable)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return strict_json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _slug(name: str) -> str:
    """A name as a directory name: letters (any script's), digits, ``_.-``; the rest ``-``.
    NFC first, so an accent typed as a combining mark stays with its letter."""
    slug = re.sub(r"[^\w.-]+", "-", unicodedata.normalize("NFC", name)).strip("-.")
    return slug or "run"


def run_dir_name(name: str) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>``: the directory a run launched now gets (``-2``… on a clash)."""
    return f"{_slug(name)}-{time.strftime('%Y%m%d-%H%M%S')}"


def exact_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a run directory's exact name (``--exact-name``), or None."""
    if _slug(name) != name:
        return (
            f"{name!r} is not a run directory name as it stands (letters, digits, _ . - and "
            f"no leading or trailing - or .; e.g. {_slug(name)!r})"
        )
    return None


def create_run_dir(runs_dir: Path, name: str, exact: bool = False) -> Path:
    """``runs_dir/<name>-<YYYYmmdd-HHMMSS>`` (0700), with logs/ and checkpoints/ inside;
    ``exact``: ``runs_dir/<name>`` itself, never one that exists (``--exact-name``)."""
    runs_dir = Path(runs_dir)
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{runs_dir}: cannot create the runs directory ({e.strerror})") from None
    if not os.access(runs_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"{runs_dir}: the runs directory is not writable")
    base = name if exact else run_dir_name(name)
    for n in range(1, 1000):
        path = runs_dir / (base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            if exact:  # another launch took it since the check (launch.prepare)
                raise RunDirError(f"{path}: already exists (--exact-name)") from None
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


NODES = "nodes.json"


def write_nodes(run_dir: Path, nodes: list[dict[str, Any]]) -> None:
    """A multi-node run's nodes (``node``, ``host``, ``run_dir``, ``rank``), each node's own
    copy written by its first rank: how a reader finds the other nodes' run directories."""
    atomic_write_json(Path(run_dir) / NODES, {"nodes": nodes})


def read_nodes(run_dir: Path) -> list[dict[str, Any]]:
    """The nodes of the run, [] for a single machine (or an unreadable file)."""
    data = read_json(Path(run_dir) / NODES)
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        return []
    return [n for n in nodes if isinstance(n, dict) and isinstance(n.get("run_dir"), str)]


def read_status(run_dir: Path) -> dict[str, Any]:
    status = read_json(Path(run_dir) / STATUS)
    return status if isinstance(status, dict) else {}


def write_status(run_dir: Path, status: dict[str, Any], durable: bool = True) -> None:
    """``durable=False``: progress only (the state unchanged), not worth an fsync."""
    atomic_write_json(Path(run_dir) / STATUS, status, durable)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint named by ``checkpoints/LATEST``, if any."""
    return named_checkpoint(run_dir, "LATEST")


def best_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint ``checkpoints/BEST`` names (``checkpoint.keep_best``), if any."""
    return named_checkpoint(run_dir, "BEST")


def named_checkpoint(run_dir: Path, which: str) -> Path | None:
    ckpts = Path(run_dir) / "checkpoints"
    try:
        name = (ckpts / which).read_text().strip()
    except (OSError, UnicodeDecodeError):  # absent, a directory, unreadable
        return None
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        return None
    path = ckpts / name
    return path if (path / "meta.json").is_file() else None


def unloadable(ckpt: Path) -> str | None:
    """Why a complete checkpoint cannot be loaded, as far as can be told without torch (None:
    it looks loadable). torch.save writes a zip whose directory is at its end, so a file cut
    short anywhere (a full disk, a copy interrupted) fails this; the ranks' load is the final
    judge (engine/loop.py ``loadable``)."""
    state = Path(ckpt) / "state.pt"
    try:
        if not state.is_file():
            return "its state.pt is missing"
        if not zipfile.is_zipfile(state):
            return "its state.pt is not a whole torch file (truncated?)"
    except OSError as e:
        return f"its state.pt cannot be read ({e.strerror})"
    return None


def resume_checkpoint(run_dir: Path) -> tuple[Path | None, str]:
    """The checkpoint a resume starts from, and one line saying why it is not LATEST's ("" when
    it is): what LATEST names when it is complete and looks loadable (:func:`unloadable`),
    else the newest complete one on disk (older than LATEST's) that does. (None, why) when no
    complete checkpoint can be loaded ("" when there is none at all)."""
    latest = latest_checkpoint(run_dir)
    complete = [Path(c["path"]) for c in reversed(list_checkpoints(run_dir))]  # newest first
    if latest is not None:
        at = _step(latest)  # None: LATEST names a directory by hand, not step-N
        order = [latest] + [
            c for c in complete if c != latest and (at is None or (_step(c) or 0) < at)
        ]
        why = ""
    else:
        order = complete
        why = _latest_problem(run_dir)
    skipped: list[tuple[Path, str]] = []
    for ckpt in order:
        problem = unloadable(ckpt)
        if problem is None:
            if not why and not skipped:
                return ckpt, ""
            reasons = [why] if why else []
            reasons += [f"{c.name} cannot be loaded: {p}" for c, p in skipped]
            return ckpt, (
                f"{'; '.join(reasons)}; resuming from {ckpt.name}, the newest complete "
                "checkpoint that can be loaded"
            )
        skipped.append((ckpt, problem))
    if not skipped:
        return None, ""
    first, problem = skipped[0]
    more = f" (and {len(skipped) - 1} older)" if len(skipped) > 1 else ""
    return None, f"no complete checkpoint can be loaded: {first.name} {problem}{more}"


def _step(ckpt: Path) -> int | None:
    """The step in a checkpoint's name: ``step-N``, or ``.tmp-step-N`` (which LATEST names for a
    moment while the same step is saved again, engine/checkpoint.py ``_replace``)."""
    found = re.fullmatch(r"(?:\.tmp-)?step-(\d+)", ckpt.name)
    return int(found[1]) if found else None


def _latest_problem(run_dir: Path) -> str:
    """Why ``checkpoints/LATEST`` names no complete checkpoint (read as named_checkpoint does)."""
    path = Path(run_dir) / "checkpoints" / "LATEST"
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return "checkpoints/LATEST is missing"
    except (OSError, UnicodeDecodeError):
        return "checkpoints/LATEST cannot be read"
    return f"checkpoints/LATEST names {name!r}, which is not a complete checkpoint"


def _checkpoint_bytes(entry: Path) -> int | None:
    """A checkpoint's size: its state.pt, or every file of an FSDP run's sharded one (its
    ``.metadata`` and each rank's shards beside state.pt)."""
    try:
        if (entry / ".metadata").is_file():
            return sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        return (entry / "state.pt").stat().st_size
    except OSError:  # unreadable, or pruned while read
        return None


# A reader's hold on a run's checkpoints (``export``): a shared flock on this file; the
# engine prunes only when it can take it exclusively (engine/checkpoint.py ``prune``).
HOLD = ".hold"


@contextlib.contextmanager
def hold_checkpoints(run_dir: Path) -> Iterator[None]:
    """While held, no checkpoint of the run is pruned (a later checkpoint prunes instead):
    a reader that chose one can read it whole. Where the file cannot be made (a read-only
    run directory, no checkpoints), nothing can prune there either: no hold is needed."""
    try:
        fd = os.open(Path(run_dir) / "checkpoints" / HOLD, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # and its lock with it


def list_checkpoints(run_dir: Path, newest: int | None = None) -> list[dict[str, Any]]:
    """The complete checkpoints on disk, oldest first: what pruning (``keep_last``) left; only
    the ``newest`` N directories are read when given (``keep_last = 0`` may keep thousands),
    and the best one (``checkpoint.keep_best``) however old.

    Each: ``step``, ``reason`` and ``t`` from its meta.json (written last, so a directory
    without one is incomplete), ``bytes`` (:func:`_checkpoint_bytes`), ``path``, ``latest``
    for the one ``checkpoints/LATEST`` names and ``best`` for the one ``checkpoints/BEST`` names.
    """
    ckpts = Path(run_dir) / "checkpoints"
    latest = latest_checkpoint(run_dir)
    best = best_checkpoint(run_dir)
    found = []
    try:
        entries = [e for e in ckpts.iterdir() if re.fullmatch(r"step-\d+", e.name)]
    except OSError:  # no checkpoints/ yet, or unreadable
        return []
    entries.sort(key=lambda e: int(e.name[5:]))
    chosen = entries[-newest:] if newest else entries
    if best is not None and newest and all(e.name != best.name for e in chosen):
        chosen = [e for e in entries if e.name == best.name] + chosen  # kept however old
    for entry in chosen:
        try:
            meta = read_json(entry / "meta.json") if (entry / "meta.json").is_file() else None
        except OSError:  # unreadable, or pruned while read
            continue
        if not isinstance(meta, dict):
            continue
        size = _checkpoint_bytes(entry)
        step = meta.get("step")
        found.append(
            {
                "step": step if isinstance(step, int) else int(entry.name[5:]),
                "reason": meta.get("reason"),
                "t": meta.get("t"),
                "bytes": size,
                "path": str(entry),
                "latest": latest is not None and entry.name == latest.name,
                "best": best is not None and entry.name == best.name,
            }
        )
    return found


def current_session(meta: dict[str, Any]) -> dict[str, Any]:
    """meta.json as the running session sees it: the run's facts, then its last session's.

    A resumed run continues in its own directory; each launch appends a session (command,
    resume point, torchrun argv, where its events and commands start) to ``sessions``.
    """
    sessions = meta.get("sessions")
    if isinstance(sessions, list) and sessions and isinstance(sessions[-1], dict):
        return {**meta, **sessions[-1]}
    return meta


def find_run(arg: str, runs_dir: Path) -> Path:
    """RUN is a run directory, or a run's name (or a prefix of one) under the runs directory.

    A spelling with a path separator (or ``.``/``..``/``~``) is a path and only a path: it
    is never taken as a name prefix to match. A name is, in order: a run directory's exact
    name; the newest run launched with ``--name`` that name (``NAME-<timestamp>``); the
    newest of the runs it prefixes when they all have one name (``quick`` for
    ``quickstart-…``). A prefix of runs of several names is refused, naming them: ``exp1``
    is never ``exp10-…``.
    """
    if not arg.strip():
        raise RunDirError(f"{arg!r}: no such run (an empty name)")
    runs_dir = Path(runs_dir)
    try:
        path = Path(arg).expanduser()
    except RuntimeError:  # ~user that does not exist, or no home directory
        path = Path(arg)
    if is_run(path):
        return path
    is_path = "/" in arg or arg in (".", "..") or arg.startswith("~")
    if not is_path:
        if (found := _by_name(arg, runs_dir)) is not None:
            return found
        if (found := _by_given_name(arg, runs_dir)) is not None:
            return found
    raise RunDirError(f"{arg}: {_why_not_a_run(path, is_path, runs_dir)}")


def _by_given_name(arg: str, runs_dir: Path) -> Path | None:
    """The newest run launched with ``--name ARG`` where its directory spells the name
    otherwise (``--name 'my run'`` is ``my-run-…``): the name a user gave finds the run.
    Only a run whose own name (run.toml's ``profile.name``) is ARG itself: ``real[`` never
    finds ``real-…``."""
    slug = _slug(arg)
    if slug == arg:
        return None
    try:
        found = sorted(runs_dir.glob(f"{glob.escape(slug)}-*"), key=lambda p: p.name)
    except (OSError, ValueError, NotImplementedError):
        return None
    named = [p for p in found if _launched_name(p.name) == slug and is_run(p)]
    return next((p for p in reversed(named) if given_name(p) == arg), None)


def given_name(run: Path) -> str | None:
    """The name the run was launched under (``--name``, else its profile's), if readable:
    meta.json's ``name``; a run launched before meta.json kept it had it in run.toml's
    ``[profile] name`` (which ``--name`` overwrote then)."""
    meta = read_json(Path(run) / "meta.json")
    name = meta.get("name") if isinstance(meta, dict) else None
    if isinstance(name, str) and name:
        return name
    return profile_name(run) or None


def profile_name(run: Path) -> str:
    """run.toml's ``[profile] name``: the profile the run was launched from ("" when it
    cannot be read; a run launched before meta.json kept its own name: its ``--name``)."""
    from .toml_text import TOMLDecodeError, loads

    try:
        table = loads((Path(run) / "run.toml").read_text(encoding="utf-8")).get("profile")
    except (OSError, UnicodeDecodeError, TOMLDecodeError):
        return ""
    name = table.get("name") if isinstance(table, dict) else None
    return name if isinstance(name, str) else ""


def _by_name(name: str, runs_dir: Path) -> Path | None:
    """The run ``name`` finds under ``runs_dir`` (see :func:`find_run`), or None."""
    candidate = runs_dir / name
    if is_run(candidate):
        return candidate
    try:
        found = runs_dir.glob(f"{glob.escape(name)}*")
        matches = sorted((p for p in found if is_run(p)), key=lambda p: p.name)
    except (OSError, ValueError, NotImplementedError):
        matches = []
    named = [p for p in matches if _launched_name(p.name) == name]
    names = sorted({_launched_name(p.name) for p in matches})
    if named or len(names) == 1:
        return (named or matches)[-1]
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise RunDirError(
            f"{name}: could be the runs of {len(names)} names ({shown}) under {runs_dir}; "
            f"give more of the name"
        )
    return None


# What run_dir_name adds to a run's name: -<YYYYmmdd-HHMMSS>, and -2... on a clash.
_LAUNCH_STAMP = re.compile(r"-\d{8}-\d{6}(?:-\d+)?$")


def _launched_name(directory: str) -> str:
    """The name a run directory's run was launched with (``--name``, else the profile's)."""
    return _LAUNCH_STAMP.sub("", directory)


# A run's own files beside run.toml. A directory holding two of them is a run whose run.toml
# was lost (shown damaged, not hidden): a checkpoint directory has one (its meta.json), and a
# run directory being created has only its control.jsonl until run.toml is written.
RUN_FILES = ("meta.json", "events.jsonl", STATUS, "control.jsonl")


def is_run(path: Path) -> bool:
    """A run directory: its run.toml, or (run.toml lost) two of :data:`RUN_FILES`."""
    try:
        if not path.is_dir():
            return False
        if (path / "run.toml").is_file():
            return True
        return sum((path / name).is_file() for name in RUN_FILES) >= 2
    except (OSError, ValueError):
        return False


def damage(run: Path) -> list[str]:
    """What a run directory lacks of what every view reads, one phrase each ([] when whole):
    every view shows a half-deleted run as what it is rather than hiding it or guessing."""
    from .toml_text import TOMLDecodeError, loads

    run = Path(run)
    if not run.is_dir():
        return []  # no run there at all: nothing half-deleted to say
    out = []
    try:
        loads((run / "run.toml").read_text(encoding="utf-8"))
    except FileNotFoundError:
        out.append("run.toml is missing")
    except (OSError, UnicodeDecodeError, TOMLDecodeError) as e:
        out.append(f"run.toml cannot be read ({getattr(e, 'strerror', None) or e})")
    for name in ("meta.json", "events.jsonl"):
        if not (run / name).is_file():
            out.append(f"{name} is missing")
    if not (run / "checkpoints").is_dir():
        out.append("checkpoints/ is missing")
    return out


def rebased(run: Path, stored: str | None) -> Path | None:
    """A path a run's files recorded (absolute, where the run was then), as it is in ``run``
    now: a copied or moved run directory names its own files, never the original's. The part
    after the run's original directory name (meta.json's ``id``) is kept; a path outside the
    run stays as it was."""
    if not isinstance(stored, str) or not stored:
        return None
    run, path = Path(run), Path(stored)
    meta = read_json(run / "meta.json")
    names = {run.name, meta.get("id") if isinstance(meta, dict) else None} - {None}
    parts = path.parts
    at = max((i for i, part in enumerate(parts) if part in names), default=None)
    if at is None:
        return path if path.is_absolute() else run / path
    return run.joinpath(*parts[at + 1 :])


def relative_text(run: Path, path: Path | None) -> str:
    """``checkpoints/step-00000012``: a path of the run as shown, relative to its directory."""
    if path is None:
        return "-"
    try:
        return str(Path(path).relative_to(run))
    except ValueError:
        return str(path)


def shown_checkpoint(run: Path) -> dict[str, Any] | None:
    """The checkpoint every view names for a run: the one ``--resume`` and ``export`` take
    (:func:`resume_checkpoint`: LATEST's when complete and loadable, else the newest complete
    one that is), as the disk has it now; None when there is none. ``path`` is absolute,
    ``note`` says why it is not LATEST's ("" when it is)."""
    ckpt, note = resume_checkpoint(run)
    if ckpt is None:
        return None
    meta = read_json(ckpt / "meta.json")
    meta = meta if isinstance(meta, dict) else {}
    step = meta.get("step")
    return {
        "path": str(Path(ckpt).absolute()),
        "step": step if type(step) is int else _step(ckpt),
        "reason": meta.get("reason"),
        "note": note.replace("resuming from", "--resume and export take"),
    }


def resume_step(session: dict[str, Any]) -> int | None:
    """The step a session resumed from (its ``resume_from`` checkpoint's name), else None."""
    found = session.get("resume_from") if isinstance(session, dict) else None
    return _step(Path(found)) if isinstance(found, str) and found else None


def _why_not_a_run(path: Path, is_path: bool, runs_dir: Path) -> str:
    try:
        for parent in path.resolve().parents:
            if parent.name == "checkpoints" and is_run(parent.parent):
                return f"a checkpoint, not a run: give its run, {parent.parent}"
        if path.is_file():
            return "a file, not a run directory"
        if path.is_dir():
            return "not a run directory (no run.toml in it)"
    except (OSError, ValueError, RuntimeError):
        pass
    if is_path:
        return "no such run directory"
    return f"no such run (looked for a directory and under {runs_dir})"


def previous_status(run_dir: Path, sessions: Any) -> dict[str, Any]:
    """The status.json a resumed run's last session ended with (``launch.continue_run`` keeps
    it as ``history/status-N.json``), else {}."""
    n = len(sessions) - 1 if isinstance(sessions, list) else 0
    if n < 1:
        return {}
    found = read_json(run_dir / "history" / f"status-{n}.json")
    return found if isinstance(found, dict) else {}
