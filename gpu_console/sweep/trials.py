"""The trials a search makes, all of them before the first starts: the plan a resumed sweep
continues and ``--dry-run`` prints. A random search is seeded (``sweep.seed``), so the same
file makes the same trials. No torch."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

from .spec import Param, SweepSpec


def make_trials(spec: SweepSpec) -> list[dict[str, Any]]:
    """Each trial's parameter values, by key, in the order they start (a ``tpe`` search: none
    yet, its driver asks Optuna for each as a slot frees up)."""
    if spec.search == "tpe":
        return []
    if spec.search == "grid":
        keys = [p.key for p in spec.params]
        combos = itertools.product(*(p.grid() for p in spec.params))
        if spec.trials is not None:
            combos = itertools.islice(combos, spec.trials)
        return [dict(zip(keys, combo, strict=True)) for combo in combos]
    rng = random.Random(spec.seed)
    assert spec.trials is not None  # load_sweep: a random search names its count
    return [{p.key: draw(p, rng) for p in spec.params} for _ in range(spec.trials)]


def corners(spec: SweepSpec) -> list[dict[str, Any]]:
    """What a search that chooses as it goes may choose, at its edges: every key at its low
    end, at its high end, and each listed value once (checked before a ``tpe`` sweep starts)."""
    lows = {p.key: p.values[0] if p.values else p.low for p in spec.params}
    highs = {p.key: p.values[-1] if p.values else p.high for p in spec.params}
    out = [lows, highs]
    for p in spec.params:
        out += [{**lows, p.key: v} for v in p.values[1:-1]]
    return out


def grid_size(spec: SweepSpec) -> int:
    return math.prod(p.count() for p in spec.params)


def draw(p: Param, rng: random.Random) -> Any:
    """One value of ``p``: a listed one, uniform in a range (on its step's grid where it has
    one), log-uniform in a log range; whole numbers where both bounds are."""
    if p.values:
        return rng.choice(p.values)
    assert p.low is not None and p.high is not None
    if p.step is not None:
        return p.point(rng.randrange(p.count()))
    if p.log:
        value = math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
    else:
        value = rng.uniform(p.low, p.high)
    return min(max(round(value), int(p.low)), int(p.high)) if p.integer else value
