"""The test modules that take longest, from a full run's ``--durations=0`` output.

    python -m pytest -n 2 --durations=0 > run.log; python scripts/heaviest_modules.py run.log

Prints each module's seconds (setup, call and teardown of its tests, on one worker: with
``--dist loadscope`` a module is one worker's unit) and the ``HEAVIEST_FIRST`` tuple for
tests/conftest.py, which deals the longest modules first so no worker ends the suite alone.
"""

from __future__ import annotations

import re
import sys
from collections import Counter

LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(\S+?\.py)::")


def module_seconds(text: str) -> Counter[str]:
    seconds: Counter[str] = Counter()
    for line in text.splitlines():
        if m := LINE.match(line):
            seconds[m.group(2)] += float(m.group(1))
    return seconds


def main(path: str, top: int = 20) -> None:
    with open(path) as f:
        seconds = module_seconds(f.read())
    total = sum(seconds.values())
    print(f"{total:.0f} s of tests in {len(seconds)} modules ({total / 2:.0f} s a worker on two)")
    for module, s in seconds.most_common(top):
        print(f"{s:8.1f} s  {module}")
    print("HEAVIEST_FIRST = (")
    for module, _ in seconds.most_common(top):
        print(f'    "{module}",')
    print(")")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
