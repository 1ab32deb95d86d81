"""The sweep's Optuna study (the optional ``sweep`` extra): the only importer of optuna.

Where Optuna is installed, every trial of a sweep is also a trial of an Optuna study stored in
the sweep's directory (``optuna.db``, SQLite), so Optuna's own API and ``optuna-dashboard``
read it: ``optuna.load_study(study_name=SWEEP_NAME, storage="sqlite:///SWEEP/optuna.db")``.
Grid and random trials enter it as enqueued (their values fixed by the plan); a ``tpe`` search
asks it for each trial's values as slots free up (Optuna's TPE, seeded). Each eval is reported
as an intermediate value, each end told: finished with its objective, pruned, or failed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

STORAGE = "optuna.db"


def available() -> bool:
    """Whether Optuna can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec("optuna") is not None
    except (ImportError, ValueError):
        return False


def storage_url(sweep_dir: Path) -> str:
    return f"sqlite:///{(Path(sweep_dir) / STORAGE).absolute()}"


def distributions(params: list[dict[str, Any]]) -> dict[str, Any]:
    """Optuna's distribution of each swept key (the plan's parameters)."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    out: dict[str, Any] = {}
    for p in params:
        if p.get("values") is not None:
            out[p["key"]] = CategoricalDistribution(list(p["values"]))
        elif p["integer"]:
            step = int(p["step"]) if p.get("step") is not None and not p["log"] else 1
            out[p["key"]] = IntDistribution(int(p["low"]), int(p["high"]), log=p["log"], step=step)
        else:
            step = p.get("step") if not p["log"] else None
            out[p["key"]] = FloatDistribution(p["low"], p["high"], log=p["log"], step=step)
    return out


class Study:
    """The sweep's study, created on first use and loaded after (a resumed driver's)."""

    def __init__(self, sweep_dir: Path, plan: dict[str, Any]):
        import optuna

        optuna.logging.set_verbosity(logging.WARNING)
        self.optuna = optuna
        direction = "minimize" if plan["objective"]["direction"] == "min" else "maximize"
        sampler = (
            optuna.samplers.TPESampler(seed=plan["sweep"].get("seed", 0))
            if plan["sweep"]["search"] == "tpe"
            else None
        )
        self.study = optuna.create_study(
            storage=storage_url(sweep_dir), study_name=Path(sweep_dir).name,
            direction=direction, sampler=sampler, load_if_exists=True,
        )  # fmt: skip
        self.dists = distributions(plan["params"])
        self.asked: dict[int, Any] = {}  # this driver's trials, to report evals to
        self.numbers: dict[int, int] = {  # sweep trial → Optuna trial number
            int(t.user_attrs["sweep_trial"]): t.number
            for t in self.study.get_trials(deepcopy=False)
            if "sweep_trial" in t.user_attrs
        }

    def begin(self, n: int, params: dict[str, Any] | None) -> dict[str, Any]:
        """Trial ``n`` in the study (once): with ``params`` as given, or (None) as the
        sampler chooses them. Returns the trial's values."""
        if n in self.numbers:
            return self.study.get_trials(deepcopy=False)[self.numbers[n]].params
        if params is not None:
            self.study.enqueue_trial(params)
        trial = self.study.ask(self.dists)
        trial.set_user_attr("sweep_trial", n)
        self.numbers[n] = trial.number
        self.asked[n] = trial
        return dict(trial.params)

    def report(self, n: int, step: int, value: float) -> None:
        """An eval of a trial this driver began (a taken-back one's go unreported: Optuna
        reaches a trial's reports only through the object ``ask`` returned)."""
        trial = self.asked.get(n)
        if trial is None:
            return
        with contextlib.suppress(Exception):  # a step reported twice, a race with the end
            trial.report(value, step)

    def end(self, n: int, state: str, value: float | None) -> None:
        number = self.numbers.get(n)
        if number is None:
            return
        states = self.optuna.trial.TrialState
        if state == "finished" and value is not None:
            self.study.tell(number, value, skip_if_finished=True)
        elif state == "pruned":
            self.study.tell(number, state=states.PRUNED, skip_if_finished=True)
        elif state == "failed" or state == "finished":
            self.study.tell(number, state=states.FAIL, skip_if_finished=True)
