"""A user's input that the ranks refuse: judged only once they built it, reported like a launch
check's refusal (one line naming the key, exit 2), not as a crash with a traceback.

Every rank must reach the same verdict at the same point (the data sets, the task's own
optimizer step are the same on each): the loop then records the run as ``refused`` and the
ranks exit 0, so torchrun does not restart them (loop.py), and the supervisor records the
engine's one line with exit code 2 (``runs.exit_code``).
"""

from __future__ import annotations


class Refused(ValueError):
    """``key``: the profile key (or the task's method) to change; ``problem``: why, and what
    to do instead, in one line. A ValueError, as such checks raised before it existed."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
