"""``python -m gpu_console.tasks.check KIND TABLE_JSON``: validate a user task's keys.

The console never imports torch, and a user's task module usually does, so the console
asks this small subprocess instead. It prints ``{"errors": [...], "task": {...}}``.
"""

from __future__ import annotations

import json
import sys

from .. import schema
from .loader import TaskLoadError, load_task_class


def check(kind: str, table: dict) -> dict:
    try:
        cls = load_task_class(kind)
    except TaskLoadError as e:
        return {"errors": [str(e)], "task": None}
    errors: list[str] = []
    try:
        cfg = schema.build(cls.Config, table, "task", errors)
    except (TypeError, ValueError) as e:
        return {"errors": [str(e)], "task": None}
    return {
        "errors": errors,
        "task": None if errors else schema.to_dict(cfg),
        # Activation checkpointing needs it (launch.py checks it against the profile).
        "blocks": callable(getattr(cls, "blocks", None)),
    }


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], json.loads(sys.argv[2]))))
