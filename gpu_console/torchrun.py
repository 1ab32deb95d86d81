"""What the installed torchrun accepts, asked of its own argument parser.

torchrun's flags come and go between torch releases (``--shutdown-timeout`` is not in 2.11), and
an unknown flag fails every run. The console never imports torch, so the parser is asked in a
subprocess of the same interpreter, and the answer is cached on disk under the user's cache
directory, keyed by what identifies the installed torch without importing it (its version, the
location of its metadata and that metadata's mtime): a launch pays the second it costs once per
installed torch. A cache that cannot be read or written only costs that second again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

# Printed by the subprocess: every option of torch.distributed.run, by its dest.
_ASK_PARSER = """
import json
from torch.distributed.run import get_args_parser
parser = get_args_parser()
print(json.dumps({a.dest: list(a.option_strings) for a in parser._actions if a.option_strings}))
"""
DETECT_TIMEOUT_S = 120


@dataclass(frozen=True)
class Options:
    """torchrun's options by dest (``nproc_per_node``), each with its spellings."""

    spellings: dict[str, list[str]] = field(default_factory=dict)
    # Why the parser could not be asked; then every flag is passed as written, and a flag the
    # torchrun lacks fails the run with torchrun's own error, which the failure summary names.
    error: str = ""

    def flag(self, dest: str, default: str) -> str | None:
        """The parser's preferred long spelling of ``dest``; None when torchrun lacks it."""
        if self.error:
            return default
        names = [s for s in self.spellings.get(dest, []) if s.startswith("--")]
        if not names:
            return None
        hyphenated = [s for s in names if "_" not in s]
        return (hyphenated or names)[0]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpu-console"


def torch_identity() -> dict[str, object] | None:
    """The installed torch as its package metadata names it (no import); None without one."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    where = getattr(dist, "_path", None)  # the .dist-info directory of a path distribution
    mtime = None
    if where is not None:
        for name in ("RECORD", "METADATA"):
            with contextlib.suppress(OSError):
                mtime = os.stat(Path(where) / name).st_mtime_ns
                break
    return {
        "python": sys.executable,
        "torch": dist.version,
        "dist_info": str(where) if where is not None else None,
        "mtime_ns": mtime,
    }


def _cache_file(identity: dict[str, object]) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"torchrun-options-{digest}.json"


def _read_cache(path: Path, identity: dict[str, object]) -> dict[str, list[str]] | None:
    try:
        data = json.loads(path.read_text())
        if data["identity"] != identity or not isinstance(data["options"], dict):
            return None
        return {str(k): [str(s) for s in v] for k, v in data["options"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: Path, identity: dict[str, object], options: dict[str, list[str]]) -> None:
    """Atomically, or not at all: a cache is never worth failing a launch over."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".torchrun-options-")
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": identity, "options": options}, f)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def ask_parser() -> dict[str, list[str]]:
    """torchrun's options from its own parser, in a subprocess (it imports torch)."""
    proc = subprocess.run(
        [sys.executable, "-c", _ASK_PARSER],
        capture_output=True,
        text=True,
        timeout=DETECT_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(err[0])
    options = json.loads(lines[-1])
    if not isinstance(options, dict):
        raise RuntimeError("the parser's answer is not a mapping")
    return {str(k): [str(s) for s in v] for k, v in options.items()}


def accepted_options() -> Options:
    """What the installed torchrun accepts (the seam tests replace)."""
    identity = torch_identity()
    if identity is None:
        return Options(error="torch is not installed")
    path = _cache_file(identity)
    cached = _read_cache(path, identity)
    if cached is not None:
        return Options(cached)
    try:
        options = ask_parser()
    except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
        return Options(error=f"cannot ask torchrun's parser: {e}")
    _write_cache(path, identity, options)
    return Options(options)
