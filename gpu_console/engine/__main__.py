"""``python -m gpu_console.engine RUN_DIR``: one rank of a run (started by torchrun)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from ..profile import load_profile, with_task_config
from ..runs import read_json
from ..tasks.loader import load_task_class
from .distributed import die_with_parent
from .loop import train


@record
def main(argv: list[str]) -> None:
    die_with_parent()
    run_dir = Path(argv[0])
    meta = read_json(run_dir / "meta.json") or {}
    # A user's task module is found from where the run was launched, like `python -m`.
    if meta.get("cwd") and meta["cwd"] not in sys.path:
        sys.path.insert(0, meta["cwd"])
    profile = load_profile(str(run_dir / "run.toml"))
    task_cls = load_task_class(profile.task_kind)
    profile = with_task_config(profile, task_cls.Config, str(run_dir / "run.toml"))
    resume = meta.get("resume_from")
    train(
        run_dir,
        profile,
        task_cls(profile.task),
        meta.get("placement", {}).get("device_type", "cpu"),
        Path(resume) if resume else None,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m gpu_console.engine RUN_DIR", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1:])
