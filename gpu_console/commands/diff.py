"""``diff RUN1 RUN2 [--json]``: what two runs were launched with that differs, and their
summary figures side by side (no torch here).

The profiles are the runs' ``run.toml`` (the resolved profile each trained with), compared
key by key; a key one of them lacks (a section added in a later version) is shown as
missing, and a run.toml that cannot be read is refused in one line. The figures are the
headless summary's (:mod:`gpu_console.summary`), the same the ``status`` command prints, one
column per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import strict_json
from ..profile import ProfileError, parse_toml
from ..runs import RunDirError, find_run
from ..summary import summary_rows
from . import status as status_cmd

MISSING = "(missing)"


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 0.1}}`` → ``{"train.lr": 0.1}``; a task's own tables too."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _profile(run: Path) -> dict[str, Any]:
    """The run's resolved profile, flattened. A run whose run.toml cannot be read is no
    comparison (every key would read as missing): refused in one line naming the file."""
    try:
        return flatten(parse_toml(run / "run.toml"))
    except ProfileError as e:
        raise RunDirError(
            f"{'; '.join(e.problems)} (diff compares the runs' run.toml; this one is damaged)"
        ) from None


def profile_changes(a: Path, b: Path) -> list[dict[str, Any]]:
    """Every key whose value differs, in the order of A's run.toml (then B's own keys);
    ``None`` where a run lacks the key."""
    pa, pb = _profile(a), _profile(b)
    keys = _merged(list(pa), list(pb))
    return [
        {"key": k, "a": pa.get(k), "b": pb.get(k)}
        for k in keys
        if k not in pa or k not in pb or pa[k] != pb[k]
    ]


def _merged(first: list[str], second: list[str]) -> list[str]:
    """``first``, with each name only ``second`` has placed after the name it follows there
    (a task key beside the other task keys, a second rank's row beside the first's)."""
    out = list(first)
    at = 0
    for name in second:
        if name in out:
            at = out.index(name) + 1
        else:
            out.insert(at, name)
            at += 1
    return out


def side_by_side(fa: dict[str, Any], fb: dict[str, Any]) -> list[dict[str, str]]:
    """The summary's rows of both runs, aligned by what they say (A's order, then B's own)."""
    ra, rb = dict(summary_rows(fa)), dict(summary_rows(fb))
    whats = _merged(list(ra), list(rb))
    return [{"what": w, "a": ra.get(w, "-"), "b": rb.get(w, "-")} for w in whats]


def compare(run_a: str, run_b: str, runs_dir: Path) -> dict[str, Any]:
    a, b = find_run(run_a, runs_dir), find_run(run_b, runs_dir)
    fields = []
    for run in (a, b):
        path, follower, row = status_cmd.status(str(run), runs_dir)
        fields.append(status_cmd.to_json(path, follower, row))
    return {
        "runs": [{"name": r.name, "path": str(r)} for r in (a, b)],
        "profile": profile_changes(a, b),
        "figures": side_by_side(*fields),
        "summary": {"a": fields[0], "b": fields[1]},
    }


def _show(value: Any) -> str:
    if value is None:
        return MISSING
    return strict_json.dumps(value) if not isinstance(value, str) else repr(value)


def renderables(out: dict[str, Any]) -> list[Any]:
    """The comparison as Rich renderables: the differing keys, then the summaries (the CLI
    prints them; the runs screen shows them)."""
    from rich.table import Table
    from rich.text import Text

    name_a, name_b = (r["name"] for r in out["runs"])
    shown: list[Any] = []
    if out["profile"]:
        table = Table(title="profile: what differs", box=None, header_style="bold",
                      title_justify="left")  # fmt: skip
        for col in ("key", name_a, name_b):
            table.add_column(col, overflow="fold")
        for c in out["profile"]:
            table.add_row(Text(c["key"]), Text(_show(c["a"])), Text(_show(c["b"])))
        shown.append(table)
    else:
        shown.append(Text("profile: the same"))
    shown.append(Text(""))
    table = Table(title="summary", box=None, header_style="bold", title_justify="left")
    for col in ("", name_a, name_b):
        table.add_column(col, overflow="fold")
    for row in out["figures"]:
        table.add_row(Text(row["what"]), Text(row["a"]), Text(row["b"]))
    shown.append(table)
    return shown


def main(run_a: str, run_b: str, runs_dir: Path, as_json: bool) -> int:
    out = compare(run_a, run_b, runs_dir)
    if as_json:
        print(strict_json.dumps(out, indent=2))
        return 0
    from rich.console import Console

    from ..format import uncut

    console = uncut(Console())
    for shown in renderables(out):
        console.print(shown)
    return 0
