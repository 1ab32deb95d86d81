"""``profiles``: the built-in and local profiles, each with its one-line description."""

from __future__ import annotations


def main(console=None) -> None:
    """Print the table to ``console`` (default: stdout's)."""
    from rich.console import Console
    from rich.table import Table

    from ..format import uncut
    from ..profile import ProfileError, list_profiles, parse_toml

    table = Table(show_header=True, header_style="bold", box=None)
    # A narrow terminal folds a long name or path onto more lines: it is never cut.
    for col in ("name", "where", "description"):
        table.add_column(col, overflow="fold")
    for path, origin in list_profiles():
        try:
            meta = parse_toml(path).get("profile", {})
            desc = str(meta.get("description", "")) if isinstance(meta, dict) else ""
        except ProfileError as e:
            desc = f"(unreadable: {e.problems[0]})"
        table.add_row(path.stem, origin if origin == "built-in" else str(path), desc)
    uncut(console or Console()).print(table)
