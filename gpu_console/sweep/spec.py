"""The sweep file (``gpu-console sweep SWEEP.toml``), read and judged in full.

Every problem is a line ``FILE: KEY: what is wrong (got VALUE)``, all of them at once, as a
profile's are (:class:`SweepError`, exit 2 through the CLI). What depends on a trial's
values (a parameter key the base profile does not have, a value its key refuses, a launch
check) is judged by resolving every trial's profile (:func:`check_trials`) before the sweep
writes anything. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..devices import DeviceSpecError, parse_devices
from ..profile import BEST_METRIC, ProfileError, find_profile, load_profile
from ..schema import show
from ..toml_text import TOMLDecodeError
from ..toml_text import loads as toml_loads

SEARCHES = ("grid", "random", "tpe")
DIRECTIONS = ("min", "max", "auto")
USES = ("last", "best")
SWEEP_KEYS = {
    "name": "the sweep's name (its directory under the runs directory; default: the file's)",
    "profile": "the base profile every trial starts from: a name or a TOML file",
    "search": "grid (every combination), random (draws, seeded) or tpe (Optuna's TPE, the "
    "sweep extra)",
    "trials": "the most trials (random: how many; grid: the first of its combinations)",
    "max_minutes": "no trial starts after this many minutes of the sweep (0: no limit)",
    "trial_devices": "each trial's devices: cpu:N (N ranks on the CPU) or a GPU count",
    "devices": "the devices trials are placed on (auto, 0,1,..., cpu:N); --devices wins",
    "seed": "the random search's seed",
}
OBJECTIVE_KEYS = {
    "metric": "eval.<metric>: a metric of the trials' eval events (e.g. eval.loss)",
    "direction": "min or max is better; auto: min for a *loss* metric",
    "use": "last (the trial's last eval) or best (its best eval)",
}
# Beyond these a typo (a step of 1e-9) would build millions of trials before saying anything.
MAX_POINTS = 10_000  # values of one parameter's grid
MAX_TRIALS = 100_000  # trials of one sweep
PRUNERS = ("none", "median")
PRUNING_KEYS = {
    "kind": "none, or median: a trial whose eval is worse than the median of the other "
    "trials' at the same step stops early, pruned",
    "startup_trials": "no pruning before this many trials ended (finished or pruned)",
    "warmup_evals": "a trial is never pruned at its first warmup_evals evals",
}
PARAM_FORMS = ("values", "range", "log_range", "step", "num")


class SweepError(ProfileError):
    """A sweep file that cannot be run: one line a problem, each naming the file and key."""


@dataclass(frozen=True)
class Param:
    """One swept key: ``values`` (a list), or ``range``/``log_range`` [low, high] with a
    grid's ``step`` (range) or ``num`` points (log_range)."""

    key: str
    values: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    num: int | None = None

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def count(self) -> int:
        """How many values a grid takes (without making them)."""
        if self.values:
            return len(self.values)
        if self.log:
            return self.num or 2
        assert self.low is not None and self.high is not None
        return int(math.floor((self.high - self.low) / (self.step or 1) + 1e-9)) + 1

    def grid(self) -> list[Any]:
        """The values a grid search takes, in order."""
        if self.values:
            return list(self.values)
        assert self.low is not None and self.high is not None
        if self.log:
            n = self.num or 2
            a, b = math.log(self.low), math.log(self.high)
            points = [math.exp(a + (b - a) * i / (n - 1)) for i in range(n)]
            points[0], points[-1] = self.low, self.high  # the ends as written, not rounded
            # whole numbers close to the low end round alike: each once
            return list(dict.fromkeys(round(p) for p in points)) if self.integer else points
        return [self.point(i) for i in range(self.count())]

    def point(self, i: int) -> Any:
        """A range's ``i``-th value on its step's grid."""
        assert self.low is not None
        step = self.step if self.step is not None else 1
        value = self.low + i * step
        return round(value) if self.integer and float(step).is_integer() else value


@dataclass
class SweepSpec:
    path: Path
    name: str
    profile: str  # the base profile as find_profile resolves it (a file's absolute path)
    search: str = "grid"
    trials: int | None = None
    max_minutes: float = 0.0
    trial_devices: str = "cpu:1"
    devices: str = "auto"
    seed: int = 0
    metric: str = "eval.loss"
    direction: str = "min"
    use: str = "last"
    pruner: str = "none"
    startup_trials: int = 2
    warmup_evals: int = 0
    params: list[Param] = field(default_factory=list)
    sets: dict[str, Any] = field(default_factory=dict)

    def params_dict(self) -> list[dict[str, Any]]:
        """The parameters as the plan keeps them (Optuna's distributions are made from it)."""
        return [
            {"key": p.key, "values": list(p.values) or None, "low": p.low, "high": p.high,
             "log": p.log, "step": p.step, "num": p.num, "integer": p.integer}
            for p in self.params
        ]  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "profile": self.profile, "search": self.search,
            "trials": self.trials, "max_minutes": self.max_minutes,
            "trial_devices": self.trial_devices, "devices": self.devices, "seed": self.seed,
            "parameters": [p.key for p in self.params], "set": self.sets,
        }  # fmt: skip


def load_sweep(path: str | Path) -> SweepSpec:
    """The sweep file read and judged in itself (every problem at once); the trials' profiles
    are judged by :func:`check_trials`."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SweepError([f"{where}: no such sweep file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise SweepError([f"{where}: cannot read it ({why})"]) from None
    try:
        doc = toml_loads(text)
    except TOMLDecodeError as e:
        raise SweepError([f"{where}: not valid TOML ({e})"]) from None
    problems: list[str] = []

    def bad(key: str, why: str, value: Any) -> None:
        problems.append(f"{where}: {key}: {why} (got {show(value)})")

    for section in doc:
        if section not in ("sweep", "objective", "pruning", "parameters", "set"):
            bad(section, "unknown section; expected [sweep], [objective], [pruning], "
                "[parameters], [set]", section)  # fmt: skip
    sweep = _table(doc, "sweep", bad)
    objective = _table(doc, "objective", bad)
    for key in sweep:
        if key not in SWEEP_KEYS:
            bad(f"sweep.{key}", f"unknown key; expected one of {', '.join(SWEEP_KEYS)}", key)
    for key in objective:
        if key not in OBJECTIVE_KEYS:
            bad(f"objective.{key}", f"unknown key; expected one of {', '.join(OBJECTIVE_KEYS)}",
                key)  # fmt: skip

    spec = SweepSpec(path=path, name=path.stem, profile="")
    name = sweep.get("name", path.stem)
    if not isinstance(name, str) or not name.strip() or "/" in name:
        bad("sweep.name", "expected a name without '/'", name)
    else:
        spec.name = name.strip()
    base = sweep.get("profile")
    if not isinstance(base, str) or not base:
        bad("sweep.profile", "expected the base profile: a name or a TOML file", base)
    else:
        # A file named relative to the sweep file, as a user reads it; else a profile's name.
        local = path.parent / base
        try:
            here = local.suffix == ".toml" and local.is_file()
            spec.profile = str(local.resolve() if here else find_profile(base))
        except (ProfileError, FileNotFoundError, OSError) as e:
            why = e.problems[0] if isinstance(e, ProfileError) else str(e)
            bad("sweep.profile", f"no such profile ({why})", base)
    search = sweep.get("search", "grid")
    if search not in SEARCHES:
        bad("sweep.search", f"expected one of {', '.join(SEARCHES)}", search)
    else:
        spec.search = search  # judged as asked for below, Optuna or not
        if search == "tpe" and not _optuna():
            bad("sweep.search", 'tpe needs Optuna: pip install "gpu-console[sweep]"', search)
    trials = sweep.get("trials")
    if trials is not None and (type(trials) is not int or not 1 <= trials <= MAX_TRIALS):
        bad("sweep.trials", f"expected a whole number from 1 to {MAX_TRIALS:,}", trials)
    elif trials is None and spec.search in ("random", "tpe"):
        bad("sweep.trials", f"a {spec.search} search needs its number of trials", None)
    else:
        spec.trials = trials
    minutes = sweep.get("max_minutes", 0)
    if type(minutes) not in (int, float) or minutes < 0:
        bad("sweep.max_minutes", "expected minutes >= 0 (0: no limit)", minutes)
    else:
        spec.max_minutes = float(minutes)
    per_trial = sweep.get("trial_devices", "cpu:1")
    if type(per_trial) is int and per_trial >= 1:
        spec.trial_devices = str(per_trial)
    elif isinstance(per_trial, str) and cpu_ranks(per_trial) is not None:
        spec.trial_devices = per_trial.strip().lower()
    else:
        bad("sweep.trial_devices", "expected cpu:N (N >= 1) or a number of GPUs >= 1", per_trial)
    devices = sweep.get("devices", "auto")
    if not isinstance(devices, str):
        bad("sweep.devices", "expected auto, GPU indices like 0,1, or cpu:N", devices)
    else:
        spec.devices = devices
    seed = sweep.get("seed", 0)
    if type(seed) is not int:
        bad("sweep.seed", "expected a whole number", seed)
    else:
        spec.seed = seed

    metric = objective.get("metric", "eval.loss")
    if not isinstance(metric, str) or not BEST_METRIC.fullmatch(metric):
        bad("objective.metric", "expected eval.<metric>, a metric of the eval events "
            "(e.g. eval.loss)", metric)  # fmt: skip
    else:
        spec.metric = metric
    direction = objective.get("direction", "auto")
    if direction not in DIRECTIONS:
        bad("objective.direction", f"expected one of {', '.join(DIRECTIONS)}", direction)
    elif direction == "auto":
        if "loss" in spec.metric.lower():
            spec.direction = "min"
        else:
            bad("objective.direction", f"auto guesses only for a loss; say min or max for "
                f"{spec.metric}", direction)  # fmt: skip
    else:
        spec.direction = direction
    use = objective.get("use", "last")
    if use not in USES:
        bad("objective.use", f"expected one of {', '.join(USES)}", use)
    else:
        spec.use = use

    pruning = _table(doc, "pruning", bad)
    for key in pruning:
        if key not in PRUNING_KEYS:
            bad(f"pruning.{key}", f"unknown key; expected one of {', '.join(PRUNING_KEYS)}", key)
    kind = pruning.get("kind", "none")
    if kind not in PRUNERS:
        bad("pruning.kind", f"expected one of {', '.join(PRUNERS)}", kind)
    else:
        spec.pruner = kind
    for key, least in (("startup_trials", 1), ("warmup_evals", 0)):
        value = pruning.get(key, getattr(spec, key))
        if type(value) is not int or value < least:
            bad(f"pruning.{key}", f"expected a whole number >= {least}", value)
        else:
            setattr(spec, key, value)

    params = doc.get("parameters", {})
    if not isinstance(params, dict) or not params:
        bad("parameters", "no parameters to sweep; name at least one profile key", params)
        params = {}
    for key, value in _flat(params):
        param = _param(f"parameters.{key}", key, value, spec.search, bad)
        if param is not None:
            spec.params.append(param)
    if spec.search == "grid" and spec.trials is None and spec.params:
        size = math.prod(p.count() for p in spec.params)
        if size > MAX_TRIALS:
            bad("parameters", f"a grid of {size:,} trials; at most {MAX_TRIALS:,}: narrow it, or "
                "take its first ones with sweep.trials", size)  # fmt: skip
    sets = doc.get("set", {})
    if not isinstance(sets, dict):
        bad("set", "expected a table of profile keys and values", sets)
        sets = {}
    spec.sets = dict(_flat(sets))
    for key in spec.sets.keys() & {p.key for p in spec.params}:
        bad(f"set.{key}", "swept in [parameters] too; keep one", spec.sets[key])
    for key in ("hardware.devices",):
        if key in spec.sets or key in {p.key for p in spec.params}:
            bad(key, "the sweep places each trial (sweep.trial_devices); leave it out", key)
    if problems:
        raise SweepError(problems)
    return spec


def _optuna() -> bool:
    from .study import available

    return available()


def _table(doc: dict, name: str, bad) -> dict:
    value = doc.get(name, {})
    if not isinstance(value, dict):
        bad(name, "expected a table", value)
        return {}
    return value


def _flat(table: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"train": {"lr": ...}}`` and ``{"train.lr": ...}`` alike as ``("train.lr", ...)``;
    a parameter's own table (values, range, ...) is a leaf."""
    out = []
    for key, value in table.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and not (value.keys() & set(PARAM_FORMS)):
            out += _flat(value, f"{full}.")
        else:
            out.append((full, value))
    return out


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _param(where: str, key: str, value: Any, search: str, bad) -> Param | None:
    if isinstance(value, list):
        value = {"values": value}
    if not isinstance(value, dict):
        bad(where, "expected a list of values, or {values = [...]}, {range = [low, high]}, "
            "{log_range = [low, high]}", value)  # fmt: skip
        return None
    unknown = set(value) - set(PARAM_FORMS)
    if unknown:
        bad(f"{where}.{sorted(unknown)[0]}", f"unknown key; expected {', '.join(PARAM_FORMS)}",
            sorted(unknown)[0])  # fmt: skip
        return None
    forms = [f for f in ("values", "range", "log_range") if f in value]
    if len(forms) != 1:
        bad(where, "expected exactly one of values, range, log_range", value)
        return None
    form = forms[0]
    if form == "values":
        values = value["values"]
        if not isinstance(values, list) or not values:
            bad(f"{where}.values", "expected a non-empty list", values)
            return None
        if len({show(v) for v in values}) != len(values):
            bad(f"{where}.values", "a value is listed twice", values)
            return None
        return Param(key, values=tuple(values))
    bounds = value[form]
    if not (isinstance(bounds, list) and len(bounds) == 2 and all(_number(b) for b in bounds)):
        bad(f"{where}.{form}", "expected [low, high], two numbers", bounds)
        return None
    low, high = bounds
    if not low < high:
        bad(f"{where}.{form}", "an empty range: low must be below high", bounds)
        return None
    log = form == "log_range"
    if log and low <= 0:
        bad(f"{where}.log_range", "a log range needs low > 0", bounds)
        return None
    step, num = value.get("step"), value.get("num")
    if log and step is not None:
        bad(f"{where}.step", "a log range's grid is num points, not a step", step)
        return None
    if not log and num is not None:
        bad(f"{where}.num", "a range's grid is its step, not num points", num)
        return None
    if step is not None and (not _number(step) or step <= 0 or step > high - low):
        bad(f"{where}.step", f"expected a step > 0 and at most {high - low:g}", step)
        return None
    if num is not None and (type(num) is not int or num < 2):
        bad(f"{where}.num", "expected a whole number of points >= 2", num)
        return None
    if search == "grid":
        integer = isinstance(low, int) and isinstance(high, int)
        if log and num is None:
            bad(f"{where}.num", "a grid over a log range needs num points", num)
            return None
        if not log and step is None and not integer:
            bad(f"{where}.step", "a grid over a range of floats needs its step", step)
            return None
    param = Param(key, low=low, high=high, log=log, step=step, num=num)
    if param.count() > MAX_POINTS:
        form = "num" if log else "step"
        bad(f"{where}.{form}", f"a grid of {param.count():,} values; at most {MAX_POINTS:,}",
            value.get(form))  # fmt: skip
        return None
    return param


def cpu_ranks(text: str) -> int | None:
    """N of a ``cpu:N`` device spec (devices.parse_devices's reading), else None."""
    try:
        spec = parse_devices(text)
    except DeviceSpecError:
        return None
    return spec.nproc if spec.kind == "cpu" else None


def trial_sets(fixed: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """A trial's ``--set``s: the sweep's fixed ones (``[set]``), then its own values."""
    return [f"{k}={toml_value(v)}" for k, v in {**fixed, **params}.items()]


def toml_value(v: Any) -> str:
    """A value as a ``--set`` reads it (a TOML literal)."""
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return json.dumps(v)


def check_keys(spec: SweepSpec) -> None:
    """Each [parameters] and [set] key, with its first value, against the base profile: a
    key it does not have, or a value its key refuses, blamed on the sweep file's line."""
    problems: list[str] = []
    first = {
        p.key: (f"parameters.{p.key}", p.values[0] if p.values else p.low) for p in spec.params
    }
    first.update({k: (f"set.{k}", v) for k, v in spec.sets.items()})
    for key, (where, value) in first.items():
        try:
            load_profile(spec.profile, [f"{key}={toml_value(value)}"])
        except ProfileError as e:
            for problem in e.problems:
                problems.append(f"{spec.path}: {where}: {_after_key(problem, key)}")
    if problems:
        raise SweepError(problems)


def _after_key(problem: str, key: str) -> str:
    """A profile problem (``--set: train.lrr: unknown key ...``) without its origin and key."""
    marker = f"{key}: "
    return problem.split(marker, 1)[1] if marker in problem else problem
