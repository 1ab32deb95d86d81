"""What a resumed run does with each change to its profile: the one table (no torch).

``--resume RUN`` continues from RUN's newest checkpoint. Every key whose resolved value
differs from the run's run.toml (and the world size, against the session that ended) falls
in one class:

- ``applied``: in effect from the first resumed step. The engine builds its optimizer and
  schedule from the new profile and writes their settings over the restored state
  (engine/resume.py); the loop reads the rest (cadences, clipping, nan policy) every step.
- ``warning``: accepted, and the start says what it costs (the split of the data, the RNG
  streams or the shuffle order differ from an unchanged run: not bit-exact).
- ``refused``: the checkpoint cannot be loaded into it: the launch stops before anything is
  written. A changed ``[task]`` key (not ``task.kind``) is judged before launch
  (:func:`judge`): by the task's ``resume_keys`` where it declares the key, else by whether
  the checkpoint's model loads into the one the new keys build (resume_model.py).

Launch refuses, records the list in the session (meta.json), and the engine's ``start``
event carries it; the headless start lines print it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schema import show

APPLIED, WARNING, REFUSED = "applied", "warning", "refused"

_OPTIMIZER = "written over the restored optimizer's param groups"
_SCHEDULE = "the schedule's base lr and current lr are recomputed from it"
_EACH_STEP = "read by the loop at every step"
_SPLIT = (
    "the data continues at the next sample of the epoch's order (none skipped, none "
    "repeated), but batches, RNG streams and losses differ from an unchanged run"
)

# section.key (or section.* for a whole section) → (class, what it means on resume).
TABLE: dict[str, tuple[str, str]] = {
    "profile.*": (APPLIED, "a label"),
    "task.kind": (
        REFUSED,
        "the checkpoint's model was built by its task and cannot be loaded into another's; "
        "start a new run to change it",
    ),
    # Until judged (:func:`judge`): a changed key is refused only where the task says so
    # (its resume_keys) or the checkpoint's model does not load into the one it builds.
    "task.*": (
        REFUSED,
        "the checkpoint's model was built from the task's keys and cannot be loaded into "
        "another; start a new run to change it",
    ),
    "train.lr": (APPLIED, f"{_OPTIMIZER}; {_SCHEDULE}"),
    "train.weight_decay": (APPLIED, _OPTIMIZER),
    "train.optimizer_impl": (APPLIED, _OPTIMIZER),
    "train.warmup_steps": (APPLIED, _SCHEDULE),
    "train.schedule": (APPLIED, _SCHEDULE),
    "train.min_lr_ratio": (APPLIED, _SCHEDULE),
    "train.min_lr": (APPLIED, _SCHEDULE),
    "train.lr_decay_steps": (APPLIED, _SCHEDULE),
    "train.betas": (APPLIED, _OPTIMIZER),
    "train.eps": (APPLIED, _OPTIMIZER),
    "train.momentum": (APPLIED, _OPTIMIZER),
    "train.nesterov": (APPLIED, _OPTIMIZER),
    "train.optimizer": (
        REFUSED,
        "the checkpoint holds another optimizer's state (its moments or momentum buffers); "
        "start a new run to change it",
    ),
    "train.max_steps": (APPLIED, f"the run's end; {_SCHEDULE}"),
    "train.max_epochs": (
        APPLIED,
        f"the run's end, in steps for the resumed ranks and batch; {_SCHEDULE}",
    ),
    "train.clip_grad_norm": (APPLIED, _EACH_STEP),
    "train.nan_policy": (APPLIED, _EACH_STEP),
    "train.nan_skip_limit": (APPLIED, _EACH_STEP),
    "train.eval_every": (APPLIED, _EACH_STEP),
    "train.eval_every_epochs": (APPLIED, f"in steps for the resumed ranks and batch; {_EACH_STEP}"),
    "train.eval_at": (APPLIED, _EACH_STEP),
    "train.eval_at_start": (APPLIED, "turned on: this session evaluates before its first step"),
    "train.log_every": (APPLIED, _EACH_STEP),
    "train.early_stop_metric": (
        APPLIED,
        "at the next eval; another metric (or turned on) starts a new count, turned off the "
        "run trains to max_steps",
    ),
    "train.early_stop_mode": (APPLIED, "at the next eval; another direction starts a new count"),
    "train.early_stop_patience": (
        APPLIED,
        "at the next eval: the evals without an improvement so far count toward it",
    ),
    "train.early_stop_min_delta": (
        APPLIED,
        "from the next eval, against the best value so far",
    ),
    "train.weight_decay_params": (
        APPLIED,
        "the optimizer's parameter groups are built from it: the checkpoint's groups must "
        "match them (the ranks say so in one line when they do not)",
    ),
    "train.deterministic": (APPLIED, "set in every rank before CUDA starts"),
    "train.compile": (APPLIED, "compiled or not, the checkpoint's names are the same"),
    "train.measure_flops": (APPLIED, "counted once before the session's first step"),
    "train.activation_checkpointing": (APPLIED, "what is recomputed, not what is computed"),
    "train.precision": (APPLIED, "the weights are kept in fp32: autocast changes, they do not"),
    "train.loss_scale_init": (
        APPLIED,
        "the first scale of a GradScaler the checkpoint has none of (fp16 turned on); a "
        "restored scaler keeps the scale it learned",
    ),
    "train.grad_accum": (WARNING, f"the global batch changes; {_SPLIT}"),
    "train.seed": (
        WARNING,
        "the model is restored, not initialised; the RNG state comes from the checkpoint "
        "(the seed matters again only where ranks are reseeded: a world size change)",
    ),
    "data.batch_size": (WARNING, f"the global batch changes; {_SPLIT}"),
    "data.num_workers": (
        WARNING,
        "between none and some workers a task's random draws come from another stream "
        "(the rank's own, or seeds per batch): they differ from an unchanged run; between "
        "1 and more workers they are the same",
    ),
    "data.seed": (
        WARNING,
        "the epoch's order is drawn anew: until the epoch ends, samples may repeat or be skipped",
    ),
    "data.order": (
        WARNING,
        "the epoch's position (samples consumed) is kept in the new order: until the epoch "
        "ends, samples may repeat or be skipped, and a task's carried stream state no longer "
        "matches its rows",
    ),
    "data.drop_last": (
        APPLIED,
        "from the resume's position: the epoch under way keeps or drops its tail by the new "
        "setting",
    ),
    "data.eval_batch_size": (APPLIED, "the eval's batches (its metrics are per sample)"),
    "data.auto_batch_headroom": (
        APPLIED,
        "used only by a search at the start; a resume keeps the size the run chose",
    ),
    "data.pin_memory": (APPLIED, "how batches reach the GPU"),
    "data.prefetch_factor": (APPLIED, "how far workers load ahead"),
    "data.persistent_workers": (APPLIED, "whether workers live between epochs"),
    "distributed.lr_scaling": (APPLIED, f"{_OPTIMIZER}; {_SCHEDULE}"),
    "distributed.strategy": (
        REFUSED,
        "the checkpoint is stored as its strategy keeps it (whole under ddp, sharded under "
        "fsdp); start a new run to change it",
    ),
    "distributed.startup_timeout_s": (
        APPLIED,
        "this session's collectives wait that long until every rank's first step",
    ),
    "distributed.collective_timeout_s": (
        APPLIED,
        "this session's collectives wait that long after every rank's first step",
    ),
    "distributed.env": (APPLIED, "each rank of this session sets them before torch starts"),
    "distributed.*": (APPLIED, "how this session's ranks are set up"),
    "checkpoint.keep_best": (
        WARNING,
        "the best so far was judged by the old metric: the next eval starts a new best "
        "(the old one is kept until then)",
    ),
    "checkpoint.best_mode": (
        WARNING,
        "the best so far was judged the other way: the next eval starts a new best "
        "(the old one is kept until then)",
    ),
    "checkpoint.*": (APPLIED, _EACH_STEP),
    "hardware.*": (APPLIED, "how this session's ranks are placed and set up"),
    "logging.*": (APPLIED, "where this session's numbers are also written"),
    "cluster.*": (APPLIED, "read by this session's supervisor when a signal stops the run"),
    "world_size": (WARNING, f"{_SPLIT}; each rank's RNG is reseeded"),
}


def rule(key: str) -> tuple[str, str]:
    """The class of ``key`` and why. A key nobody classified is accepted with a warning."""
    section = key.split(".")[0]
    return TABLE.get(key) or TABLE.get(f"{section}.*") or (WARNING, "its effect is not known")


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    cls: str
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "class": self.cls,
                "why": self.why}  # fmt: skip

    def line(self) -> str:
        """``train.lr 0.003 → 0.5 (applied)``."""
        return line(self.as_dict())


def line(change: dict[str, Any]) -> str:
    """One change as the headless start lines print it (a dict as events carry it)."""
    text = f"{change.get('key')} {_show(change.get('old'))} → {_show(change.get('new'))}"
    cls = change.get("class")
    if cls == WARNING:
        return f"{text} (warning: {change.get('why')})"
    return f"{text} ({cls})"


def _show(value: Any) -> str:
    return "(none)" if value is None else show(value)


def _flat(profile: dict[str, Any]) -> dict[str, Any]:
    return {
        f"{section}.{key}": value
        for section, table in profile.items()
        if isinstance(table, dict)
        for key, value in table.items()
    }


def classify(
    old: dict[str, Any],
    new: dict[str, Any],
    old_world: int | None = None,
    new_world: int | None = None,
) -> list[Change]:
    """Every difference between a run's run.toml (``old``) and the profile it resumes with.

    Both are resolved profiles as ``Profile.to_dict`` writes them. A key the old run.toml
    does not hold (written by an older gpu-console) is not a change, except in ``[task]``,
    where a key of another task is one.
    """
    before, after = _flat(old), _flat(new)
    changes = []
    for key in [*after, *(k for k in before if k not in after)]:
        if key not in before and not key.startswith("task."):
            continue
        was, now = before.get(key), after.get(key)
        if was == now and type(was) is type(now):
            continue
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (was, now))
        if numbers and was == now:
            continue  # 1 and 1.0: the same number, as TOML may have written it
        changes.append(Change(key, was, now, *rule(key)))
    if old_world is not None and new_world is not None and old_world != new_world:
        changes.append(Change("world_size", old_world, new_world, *rule("world_size")))
    return changes


def refused(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.cls == REFUSED]


# A changed [task] key, judged (resume_model.py asks engine/model_match.py).
TASK_LOADS = (
    "the checkpoint's model loads into the one it builds (the same names and shapes); the "
    "data, or whatever else it sets, differ from an unchanged run"
)
TASK_DOES_NOT_LOAD = "the checkpoint's model does not load into the one it builds ({})"
TASK_ACCEPTS = "the task accepts a change of it (its resume_keys)"
TASK_REFUSES = "the task refuses a change of it (its resume_keys)"


def judged_keys(changes: list[Change]) -> list[Change]:
    """The changed ``[task]`` keys a resume judges (none while ``task.kind`` changed: another
    task's keys are refused with it)."""
    if any(c.key == "task.kind" for c in changes):
        return []
    return [c for c in changes if c.key.startswith("task.")]


def judge(changes: list[Change], verdicts: dict[str, Any]) -> list[Change]:
    """``changes`` with each judged key's class and why (``{key: [class, why]}``)."""
    out = []
    for c in changes:
        cls, why = verdicts.get(c.key) or (c.cls, c.why)
        out.append(Change(c.key, c.old, c.new, cls, why))
    return out
