"""Profiles: TOML in, one typed dataclass per section out (no torch).

``load_profile`` reads a file, applies ``--set`` overrides, and validates every section at
once, raising :class:`ProfileError` with every problem as ``FILE: section.key: what (got V)``.
``Profile.to_toml`` writes the fully resolved profile that lands in a run's ``run.toml``, so
a run directory reproduces its run.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import schema
from .batching import IN_EPOCHS
from .schema import opt
from .tasks import BUILTIN, WITH_BLOCKS, is_import_path
from .toml_text import TOMLDecodeError
from .toml_text import loads as toml_loads


class ProfileError(Exception):
    """A profile (or override) that cannot be used; ``problems`` are full one-line messages."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _devices_check(value: str) -> str | None:
    from .devices import DeviceSpecError, parse_devices

    try:
        parse_devices(value)
    except DeviceSpecError as e:
        return str(e)
    return None


BEST_METRIC = re.compile(r"eval\.[A-Za-z0-9_][A-Za-z0-9_.\-/]*")


def _best_metric_check(value: str) -> str | None:
    if value == "" or BEST_METRIC.fullmatch(value):
        return None
    return "expected eval.<metric>, a metric of the eval events (e.g. eval.loss), or empty"


def _eval_at_check(value: list[int]) -> str | None:
    if any(type(n) is not int or n < 1 for n in value):
        return "expected step numbers >= 1 (e.g. [1, 500])"
    return None


def _betas_check(value: list[float]) -> str | None:
    if len(value) != 2 or not all(0.0 <= b < 1.0 for b in value):
        return "expected two numbers in [0, 1)"
    return None


# Upper bounds of values that become a wait, a clock's deadline or a number of processes. A
# timeout is a datetime.timedelta and a deadline on gloo's and NCCL's clocks (nanoseconds in 64
# bits: 292 years from boot): 1e30 s overflowed in the ranks. A week is beyond any wait that
# ends well.
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_GRACE_S = 24 * 3600  # the supervisor's and torchrun's wait before SIGKILL
MAX_WORKERS = 1024  # processes per rank
MAX_RESTARTS = 1000  # a worker group that fails this often will not succeed next time


@dataclass
class ProfileMeta:
    name: str = opt("", "profile name (default: the file name)")
    description: str = opt("", "one line shown by `gpu-console profiles`")


@dataclass
class DataConfig:
    batch_size: int | Literal["auto"] = opt(
        64,
        "samples per rank per micro-batch (grad_accum micro-batches make a step), or auto: "
        "the largest that fits, searched at start on every rank "
        "(docs/performance.md: Auto batch size)",
        min=1,
    )
    num_workers: int = opt(
        0, "DataLoader worker processes per rank (at most 1024)", min=0, max=MAX_WORKERS
    )
    pin_memory: bool = opt(True, "page-locked host batches (CUDA only)")
    prefetch_factor: int = opt(
        2, "batches each worker loads ahead (num_workers > 0; at most 1024)", min=1, max=1024
    )
    persistent_workers: bool = opt(True, "keep DataLoader workers between epochs")
    seed: int = opt(
        0,
        "order seed (shuffle: each epoch reshuffles from it; random: per rank and batch); "
        "seeds workers' draws per batch",
    )
    order: Literal["shuffle", "sequential", "contiguous", "random"] = opt(
        "shuffle",
        "training order: shuffle each epoch, sequential, contiguous per-rank streams "
        "(truncated BPTT), or random with replacement (docs/tasks.md: Data order)",
    )
    drop_last: bool = opt(
        True,
        "training drops each epoch's ragged tail; false: each rank's last batch of the epoch "
        "is smaller (shuffle and sequential orders)",
    )
    eval_batch_size: int = opt(0, "samples per rank per eval batch (0 = data.batch_size)", min=0)
    auto_batch_headroom: float = opt(
        0.10,
        "batch_size = auto on GPUs: the fraction of each GPU's memory a candidate must leave free",
        min=0.0,
        max=0.9,
    )


@dataclass
class TrainConfig:
    max_steps: int = opt(
        300, "optimizer steps in the whole run (0: until stopped, no end and no ETA)", min=0
    )
    max_epochs: int = opt(
        0,
        "epochs to train in place of max_steps (0: max_steps); the launch turns them into "
        "steps for the run's ranks and batch, and run.toml holds the steps",
        min=0,
    )
    lr: float = opt(1e-3, "peak learning rate (before lr_scaling)", gt=0.0)
    optimizer: Literal["adamw", "adam", "sgd"] = opt(
        "adamw", "the optimizer (a task's configure_optimizers() replaces it)"
    )
    weight_decay: float = opt(
        0.01, "weight decay (adamw: decoupled; adam, sgd: L2 added to the gradient)", min=0.0
    )
    betas: list[float] = opt(
        [0.9, 0.999], "adamw, adam: the moments' decay rates [beta1, beta2]", check=_betas_check
    )
    eps: float = opt(1e-8, "adamw, adam: added to the denominator", gt=0.0)
    momentum: float = opt(0.0, "sgd: momentum", min=0.0, max=1.0)
    nesterov: bool = opt(False, "sgd: Nesterov momentum (needs momentum > 0)")
    weight_decay_params: Literal["matrices", "all"] = opt(
        "matrices",
        "what decays: matrices (>= 2-D weights; no bias, norm, embedding or the model's "
        "no_weight_decay()) or all",
    )
    optimizer_impl: Literal["auto", "fused", "foreach", "for-loop"] = opt(
        "auto",
        "optimizer kernel: auto (fused where torch has one for the device, foreach under "
        "FSDP's fp16 scaler), fused, foreach, for-loop",
    )
    warmup_steps: int = opt(
        0, "linear warmup from 0 to lr (a shorter --set train.max_steps clamps it)", min=0
    )
    schedule: Literal["constant", "linear", "cosine"] = opt(
        "cosine", "learning-rate decay after warmup"
    )
    min_lr_ratio: float = opt(0.0, "floor of the decay, as a fraction of lr", min=0.0, max=1.0)
    min_lr: float = opt(
        0.0, "floor of the decay as an lr (scaled like lr); the higher floor wins", min=0.0
    )
    lr_decay_steps: int = opt(
        0, "steps the decay takes after warmup, then the floor (0 = until max_steps)", min=0
    )
    grad_accum: int = opt(1, "micro-batches per optimizer step", min=1)
    clip_grad_norm: float = opt(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp64"] = opt(
        "auto",
        "auto: bf16 where supported, fp16 + GradScaler on older GPUs, fp32 on CPU; fp64: "
        "the model and its batches' floating tensors in float64, losses reported unrounded",
    )
    loss_scale_init: float = opt(
        65536.0,
        "fp16 on a GPU: the GradScaler's first loss scale (torch's default, 2**16); lower it "
        "for a model whose first steps overflow (each overflow skips a step and halves it)",
        gt=0.0,
        max=2.0**40,
    )
    eval_every: int = opt(0, "evaluate every N steps (0 = only at the end)", min=0)
    eval_every_epochs: int = opt(
        0, "evaluate every N epochs in place of eval_every (turned into steps at launch)", min=0
    )
    eval_at: list[int] = opt(
        [],
        "evaluate after these steps too (e.g. [1, 500]), beside eval_every and the end; "
        "steps past max_steps are never reached",
        check=_eval_at_check,
    )
    eval_at_start: bool = opt(
        False,
        "evaluate at step 0, before the first update (a resume: only one that turns it on)",
    )
    early_stop_metric: str = opt(
        "",
        "stop early when this eval metric, named as eval.<metric> (e.g. eval.loss), has not "
        "improved for early_stop_patience evals in a row: the run ends finished, with its end "
        "checkpoint (empty = off)",
        check=_best_metric_check,
    )
    early_stop_mode: Literal["auto", "min", "max"] = opt(
        "auto",
        "early_stop_metric: lower (min) or higher (max) is better; auto = min for *loss* metrics",
    )
    early_stop_patience: int = opt(
        3, "early_stop_metric: evals in a row without an improvement that stop the run", min=1
    )
    early_stop_min_delta: float = opt(
        0.0,
        "early_stop_metric: the least change that counts as an improvement (0 = any)",
        min=0.0,
    )
    log_every: int = opt(
        10, "steps between step events (their numbers ride with the gradients' all-reduce)", min=1
    )
    seed: int = opt(0, "model-init and dropout seed (rank r uses seed + r for dropout)")
    nan_policy: Literal["stop", "skip", "ignore"] = opt(
        "stop",
        "non-finite gradient: stop (checkpoint last finite state), skip the update, or ignore",
    )
    nan_skip_limit: int = opt(
        100,
        "nan_policy = skip: fail the run when this many updates in a row were skipped (0 = never)",
        min=0,
    )
    deterministic: bool = opt(
        False,
        "reproducible GPU runs: deterministic kernels, CUBLAS_WORKSPACE_CONFIG, no cuDNN "
        "autotuning, no TF32 (slower; docs/reproducibility.md)",
    )
    compile: (
        bool | Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    ) = opt(
        False,
        "torch.compile the model in place: false, true (mode default) or a mode "
        "(docs/performance.md: Compile)",
    )
    measure_flops: bool | Literal["auto"] = opt(
        "auto",
        "measure a task's FLOPs (one extra forward and backward before step 1) when it does "
        "not declare them: auto (only where MFU is shown: a GPU in the peak table), true, false",
    )
    activation_checkpointing: Literal["none", "blocks", "selective"] = opt(
        "none",
        "recompute activations in backward: none, blocks (each block's), selective (keeps "
        "matmul outputs); needs the task's blocks() (docs/performance.md: Activation "
        "checkpointing)",
    )

    def early_stop_direction(self) -> str:
        """``min`` or ``max`` (validation made sure ``auto`` resolves)."""
        return "min" if self.early_stop_mode == "auto" else self.early_stop_mode


@dataclass
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = opt("auto", "auto: nccl on GPUs, gloo on CPU")
    strategy: Literal["ddp", "fsdp"] = opt(
        "ddp",
        "ddp: every rank holds the whole model (on one rank, no DDP wrapper at all); "
        "fsdp: FSDP2 shards it over the ranks",
    )
    fsdp_reshard_after_forward: bool = opt(
        True, "fsdp: free gathered parameters after forward (less memory, one more all-gather)"
    )
    fsdp_cpu_offload: bool = opt(False, "fsdp: keep sharded parameters and optimizer state on CPU")
    static_graph: bool = opt(False, "DDP static_graph: the graph never changes between steps")
    bucket_cap_mb: float = opt(
        25.0, "DDP gradient bucket size in MiB (at most 1048576, 1 TiB)", gt=0.0, max=2**20
    )
    find_unused_parameters: bool = opt(False, "DDP: look for parameters without gradients")
    broadcast_buffers: bool = opt(True, "DDP: broadcast buffers from rank 0 each forward")
    gradient_as_bucket_view: bool = opt(True, "DDP: gradients alias the buckets (less memory)")
    sync_batchnorm: bool | Literal["auto"] = opt(
        "auto",
        "BatchNorm layers as SyncBatchNorm (batch statistics over every rank; DDP): auto: "
        "where the run has several CUDA ranks; true: always (GPUs only); false: never. On CPU "
        "ranks BatchNorm stays plain (torch's SyncBatchNorm runs on GPUs only)",
    )
    lr_scaling: Literal["none", "linear", "sqrt"] = opt(
        "none", "scale lr by world size: none, linear or sqrt"
    )
    max_restarts: int = opt(
        0,
        "torchrun restarts of the worker group before failing (at most 1000)",
        min=0,
        max=MAX_RESTARTS,
    )
    collective_timeout_s: float = opt(
        300.0,
        "after every rank's first step: a collective that waits longer fails (a hung step; "
        "at most 604800, a week)",
        gt=0.0,
        max=MAX_TIMEOUT_S,
    )
    startup_timeout_s: float = opt(
        1800.0,
        "until every rank's first step is done (process group, compile, auto batch size, "
        "checkpoint load, the first step): a collective that waits longer fails (at most "
        "604800, a week)",
        gt=0.0,
        max=MAX_TIMEOUT_S,
    )
    env: dict[str, str] = opt(
        {},
        'variables each rank sets before torch starts, e.g. { NCCL_DEBUG = "INFO" } (NCCL, '
        "gloo); numbers as written, booleans as 1 or 0; not the ones the console or torchrun "
        "set (CUDA_VISIBLE_DEVICES, RANK, MASTER_ADDR, TORCHELASTIC_*, GPU_CONSOLE_*, ...), "
        "nor those read only as a process starts (LD_*, PYTHON*: export them in the shell)",
    )
    shutdown_grace_s: float = opt(
        30.0,
        "seconds between SIGTERM and SIGKILL on stop (at most 86400, a day)",
        gt=0.0,
        max=MAX_GRACE_S,
    )
    cpu_reduce: Literal["shared-memory", "gloo"] = opt(
        "shared-memory",
        "CPU ranks on one machine sum gradients through shared memory (else gloo, said why)",
    )
    cpu_affinity: bool = opt(
        False, "CPU ranks: pin each rank to its own cores (threads match each rank's share anyway)"
    )


@dataclass
class CheckpointConfig:
    every_steps: int = opt(0, "checkpoint every N steps (0 = never on an interval)", min=0)
    keep_last: int = opt(3, "complete checkpoints to keep (0 = keep all)", min=0)
    on_stop: bool = opt(True, "checkpoint when the run is stopped or signalled")
    at_end: bool = opt(
        True, "checkpoint when max_steps is reached (reason end, also where an interval falls)"
    )
    keep_best: str = opt(
        "",
        "keep the checkpoint of the best eval so far, named as eval.<metric> (e.g. eval.loss); "
        "never pruned by keep_last; checkpoints/BEST names it (empty = off)",
        check=_best_metric_check,
    )
    best_mode: Literal["auto", "min", "max"] = opt(
        "auto", "keep_best: lower (min) or higher (max) is better; auto = min for *loss* metrics"
    )
    async_write: bool = opt(
        True,
        "write checkpoints in the background: training waits only for a copy of the state "
        "in host memory (false = training waits for the whole write)",
    )

    def best_direction(self) -> str:
        """``min`` or ``max`` (validation made sure ``auto`` resolves)."""
        return "min" if self.best_mode == "auto" else self.best_mode


@dataclass
class HardwareConfig:
    devices: str = opt(
        "auto",
        "auto (all GPUs granted to you, else CPU), GPU indices like '0,1', 'cpu' or 'cpu:N'",
        check=_devices_check,
    )
    oversubscribe: bool = opt(
        False, "allow cpu:N above this machine's usable cores (ranks then share cores)"
    )
    memory_fraction: float = opt(1.0, "cap of each GPU's memory for this process", gt=0.0, max=1.0)
    cudnn_benchmark: bool = opt(True, "let cuDNN pick the fastest kernels")
    tf32: bool = opt(True, "TF32 matmuls on Ampere and newer")
    memory_warn_fraction: float = opt(
        0.95,
        "warn when a GPU's memory in use (every process's) reaches this fraction of its "
        "total, judged at log steps (0 = off); allocator retries are always said",
        min=0.0,
        max=1.0,
    )
    memory_snapshot_on_oom: bool = opt(
        False,
        "on CUDA, record allocations and write a memory snapshot into the run directory when a "
        "rank runs out of memory (no effect on CPU)",
    )


WANDB_KEYS = {"project": str, "mode": str, "entity": str}


def _wandb_check(value: dict[str, Any]) -> str | None:
    if not value:
        return None  # off
    unknown = sorted(set(value) - set(WANDB_KEYS))
    if unknown:
        return f"unknown key {unknown[0]!r}; the keys are project, mode and entity"
    if not isinstance(value.get("project"), str) or not value["project"]:
        return 'needs project = "..." (the W&B project the run is logged into)'
    if value.get("mode", "offline") not in ("offline", "online"):
        return f"mode: 'offline' or 'online' (got {value['mode']!r})"
    if "entity" in value and not isinstance(value["entity"], str):
        return "entity: a string (your W&B user or team)"
    return None


@dataclass
class LoggingConfig:
    tensorboard: bool = opt(
        True,
        "TensorBoard scalars in RUN/tensorboard/ while the run trains (needs the tensorboard "
        "package: pip install 'gpu-console[tensorboard]'; without it the launch says so and "
        "the run trains)",
    )
    wandb: dict[str, Any] = opt(
        {},
        'mirror the run to Weights & Biases: { project = "...", mode = "offline" or '
        '"online", entity = "..." } (needs the wandb package; never required: a missing '
        "package, login or network turns it off and the run trains); empty = off",
        check=_wandb_check,
    )


@dataclass
class ClusterConfig:
    requeue_signal: Literal["USR1", "TERM", "none"] = opt(
        "USR1",
        "under SLURM: the signal that means 'the time limit is near' (sbatch "
        "--signal=USR1@120): every rank checkpoints at the next step, and the run's SLURM "
        "job is requeued (scontrol requeue) to continue it with --resume auto; none: never "
        "requeue (the signal still stops the run with a checkpoint)",
    )


SECTIONS: dict[str, type] = {
    "profile": ProfileMeta,
    "data": DataConfig,
    "train": TrainConfig,
    "distributed": DistributedConfig,
    "checkpoint": CheckpointConfig,
    "hardware": HardwareConfig,
    "logging": LoggingConfig,
    "cluster": ClusterConfig,
}


@dataclass
class Profile:
    profile: ProfileMeta = field(default_factory=ProfileMeta)
    task_kind: str = "mlp"
    task: Any = None  # the task's own config dataclass
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Lines the user should read about how the profile was resolved (the CLI prints them on
    # stderr); not part of run.toml.
    notes: list[str] = field(default_factory=list, compare=False)
    # The run's own name (``--name``, or a resumed run's): its directory's and meta.json's
    # ``name``, never run.toml's, whose ``[profile] name`` stays the profile's (``ls --profile``).
    run_name: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"profile": schema.to_dict(self.profile)}
        task = {"kind": self.task_kind}
        task.update(self.task if isinstance(self.task, dict) else schema.to_dict(self.task))
        out["task"] = task
        for name in SECTIONS:
            if name == "profile":
                continue
            out[name] = schema.to_dict(getattr(self, name))
        for epochs_key, steps_key in IN_EPOCHS.items():  # not yet steps: the epochs stand
            if out["train"][epochs_key]:
                del out["train"][steps_key]
        return out

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(_without_none(self.to_dict()))


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: an optional key at None is left out (read back, its default)."""
    return {
        k: _without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None
    }


def parse_toml(path: Path) -> dict[str, Any]:
    try:
        # utf-8-sig: a byte-order mark some editors write (Windows Notepad) is read past.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ProfileError([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise ProfileError([f"{path}: a directory, not a TOML file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError([f"{path}: cannot read ({e.__class__.__name__}: {e})"]) from None
    try:
        return toml_loads(text)
    except TOMLDecodeError as e:
        raise ProfileError([f"{path}: not valid TOML: {e}"]) from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=VALUE`` → (section, key, value). VALUE is read as TOML, else a string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise ProfileError([f"--set: expected SECTION.KEY=VALUE (got {text!r})"])
    raw = raw.strip()
    try:
        value = toml_loads(f"v = {raw}")["v"]
    except TOMLDecodeError:
        value = raw
    section, name = section.strip(), name.strip()
    if not isinstance(value, str) and _is_string_key(section, name):
        value = raw  # --set hardware.devices=0 means the string "0", as --devices 0 does
    return section, name, value


def _is_string_key(section: str, key: str) -> bool:
    """Whether ``section.key`` of a profile section is a plain string (task keys excluded)."""
    import typing

    cls = SECTIONS.get(section)
    return cls is not None and typing.get_type_hints(cls).get(key) is str


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], set[str]]:
    """Apply ``--set`` overrides; also return the ``section.key`` names they touched."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    touched: set[str] = set()
    for text in overrides:
        section, key, value = parse_override(text)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ProfileError([f"--set: {section}: is not a section (got {text!r})"])
        outer, dot, inner = key.partition(".")
        if dot and isinstance(data[section].get(outer, {}), dict):
            # task.config.n_layer=4: one entry of a table key, the rest of the table kept.
            table = data[section].get(outer, {})
            data[section][outer] = _with_entry(table, inner.split("."), value, text)
            touched.add(f"{section}.{key}")  # the entry: its problem is blamed on --set
            key = outer
        else:
            data[section][key] = value
        touched.add(f"{section}.{key}")
    return data, touched


def _with_entry(table: dict[str, Any], path: list[str], value: Any, text: str) -> dict[str, Any]:
    """A copy of ``table`` with the entry at ``path`` set; the tables on the way are copied
    too (the profile's own are left as they were)."""
    head, *rest = path
    out = dict(table)
    if not rest:
        out[head] = value
        return out
    inner = out.get(head, {})
    if not isinstance(inner, dict):
        raise ProfileError([f"--set: {head}: is not a table (got {text!r})"])
    out[head] = _with_entry(inner, rest, value, text)
    return out


def resolve(
    data: dict[str, Any],
    source: str,
    task_config: type | None = None,
    overridden: set[str] | frozenset[str] = frozenset(),
) -> Profile:
    """Validate a parsed profile; every problem is reported at once as ``source: ...``.

    ``task_config`` is the config class of a user task (found by the caller, which may have
    to import user code in a subprocess); built-in tasks are known here.
    """
    errors: list[str] = []
    built: dict[str, Any] = {}
    for name, value in data.items():
        if name != "task" and name not in SECTIONS:
            near = schema._near(name, [*SECTIONS, "task"])
            hint = f"; did you mean [{near}]?" if near else ""
            errors.append(f"{name}: unknown section{hint}")
        elif not isinstance(value, dict):
            errors.append(f"{name}: expected a [{name}] table (got {schema.show(value)})")
    for name, cls in SECTIONS.items():
        table = data.get(name, {})
        built[name] = schema.build(cls, table if isinstance(table, dict) else {}, name, errors)

    task_table = data.get("task", {})
    task_table = dict(task_table) if isinstance(task_table, dict) else {}
    kind = task_table.pop("kind", "mlp")
    task_cfg: Any = None
    if not isinstance(kind, str):
        errors.append(f"task.kind: expected a string (got {schema.show(kind)})")
    elif kind in BUILTIN:
        task_config = BUILTIN[kind][1]
    elif not is_import_path(kind):
        errors.append(
            f"task.kind: unknown task; built-ins are {', '.join(BUILTIN)}, or give an import "
            f"path like 'my_pkg.tasks:MyTask' (got {schema.show(kind)})"
        )
    if isinstance(kind, str) and task_config is not None:
        try:
            task_cfg = schema.build(task_config, task_table, "task", errors)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    elif isinstance(kind, str) and is_import_path(kind) and task_config is None:
        task_cfg = task_table  # validated later against the user's class

    errors += _determinism_conflicts(built, data.get("hardware"))
    errors += _best_mode_conflicts(built, overridden)
    errors += _early_stop_conflicts(built.get("train"), overridden)
    errors += _optimizer_conflicts(built.get("train"))
    errors += _data_conflicts(built.get("data"))
    errors += _blocks_conflicts(built.get("train"), kind)
    errors += _env_problems(built.get("distributed"))
    if errors:
        raise ProfileError([_blame(e, source, overridden) for e in errors])
    profile = Profile(task_kind=kind, task=task_cfg, **built)
    _epochs_or_steps(profile, data, source, overridden)
    if not profile.train.max_epochs:  # else the launch checks it, once it knows the steps
        _fit_warmup(profile, source, overridden)
    return profile


def _epochs_or_steps(
    profile: Profile, data: dict[str, Any], source: str, overridden: set[str] | frozenset[str]
) -> None:
    """Both given: the one given last wins (``--set`` over the file), as ``--set
    train.max_steps`` shortens a profile in epochs; both in one place contradict each other."""
    train = profile.train
    found = data.get("train")
    table = found if isinstance(found, dict) else {}
    for epochs_key, steps_key in IN_EPOCHS.items():
        epochs = getattr(train, epochs_key)
        if not epochs or steps_key not in table:
            continue
        by_set = f"train.{steps_key}" in overridden
        if by_set == (f"train.{epochs_key}" in overridden):
            problem = (
                f"train.{epochs_key}: give train.{epochs_key} or train.{steps_key}, not both "
                f"(got {epochs} and {getattr(train, steps_key)})"
            )
            raise ProfileError([_blame(problem, source, overridden)])
        if by_set:
            profile.notes.append(
                f"--set train.{steps_key}={getattr(train, steps_key)}: the profile's "
                f"train.{epochs_key} = {epochs} is left out"
            )
            setattr(train, epochs_key, 0)


def _fit_warmup(profile: Profile, source: str, overridden: set[str] | frozenset[str]) -> None:
    """A warmup longer than the run: clamped when ``--set train.max_steps`` shortened the
    profile's run (docs/commands.md's way to make a short run), refused when both values were asked
    for in one place (the file, or ``--set``): that is a contradiction, not a shortening.
    run.toml then holds the clamped value, the one the schedule uses."""
    train = profile.train
    if train.warmup_steps <= train.max_steps or not train.max_steps:  # 0: until stopped
        return
    if "train.max_steps" in overridden and "train.warmup_steps" not in overridden:
        profile.notes.append(
            f"--set train.max_steps={train.max_steps}: train.warmup_steps {train.warmup_steps}"
            f" → {train.max_steps} (the profile's warmup is longer than this run; the lr rises"
            " to its peak over the whole run)"
        )
        train.warmup_steps = train.max_steps
        return
    problem = (
        f"train.warmup_steps: must not exceed train.max_steps={train.max_steps} "
        f"(got {train.warmup_steps})"
    )
    raise ProfileError([_blame(problem, source, overridden)])


def _optimizer_conflicts(train: TrainConfig | None) -> list[str]:
    """Keys that are each valid but contradict each other."""
    if train is None:
        return []
    errors = []
    if train.nesterov and (train.optimizer != "sgd" or train.momentum <= 0):
        errors.append(
            "train.nesterov: needs train.optimizer = 'sgd' and train.momentum > 0 "
            f"(got optimizer {schema.show(train.optimizer)}, momentum {train.momentum:g})"
        )
    if train.min_lr > train.lr:
        errors.append(f"train.min_lr: must not exceed train.lr={train.lr:g} (got {train.min_lr:g})")
    if not train.max_steps and train.schedule != "constant" and not train.lr_decay_steps:
        errors.append(
            "train.max_steps: 0 (until stopped) needs a decay of its own length "
            f"(train.lr_decay_steps > 0) or train.schedule = 'constant' (got schedule "
            f"{schema.show(train.schedule)})"
        )
    return errors


def _data_conflicts(data: DataConfig | None) -> list[str]:
    """The stream orders cut the data into whole batches per rank: no ragged tail to keep."""
    if data is None or data.drop_last or data.order in ("shuffle", "sequential"):
        return []
    return [
        "data.drop_last: false needs data.order = 'shuffle' or 'sequential' (got order "
        f"{schema.show(data.order)})"
    ]


def _env_problems(dist: DistributedConfig | None) -> list[str]:
    """``distributed.env``: names only a rank's own variables, each value made text (run.toml
    then holds what the ranks set); one line per bad entry (network.py)."""
    from .network import env_problems

    if dist is None:
        return []
    dist.env, problems = env_problems(dist.env)
    return problems


def _blocks_conflicts(train: TrainConfig | None, kind: Any) -> list[str]:
    """Activation checkpointing needs a task that names its blocks (a user task's
    ``blocks`` is looked for where its class is loaded: launch.py)."""
    if train is None or train.activation_checkpointing == "none" or kind not in BUILTIN:
        return []
    if kind in WITH_BLOCKS:
        return []
    return [
        f"train.activation_checkpointing: task {kind!r} has no blocks to checkpoint (built-ins "
        f"with blocks: {', '.join(sorted(WITH_BLOCKS))}) (got {train.activation_checkpointing!r})"
    ]


# What ``train.deterministic`` turns off: each is a source of run-to-run differences on GPUs.
NOT_DETERMINISTIC = {
    "cudnn_benchmark": "cuDNN's autotuning may pick a different kernel each run",
    "tf32": "TF32 matmuls are not what deterministic mode promises",
}


def _determinism_conflicts(built: dict[str, Any], hardware: Any) -> list[str]:
    """``train.deterministic`` turns off what works against it; naming one of those as true
    in the profile or a ``--set`` is a contradiction, reported like any bad key."""
    train, hw = built.get("train"), built.get("hardware")
    if train is None or hw is None or not train.deterministic:
        return []
    given = hardware if isinstance(hardware, dict) else {}
    errors = []
    for key, why in NOT_DETERMINISTIC.items():
        if given.get(key) is True:
            errors.append(
                f"hardware.{key}: must be false with train.deterministic = true ({why}) (got true)"
            )
        setattr(hw, key, False)  # a default gives way: run.toml says what the run does
    return errors


def _best_mode_conflicts(built: dict[str, Any], overridden: set[str] | frozenset[str]) -> list[str]:
    """``best_mode = auto`` guesses only for loss-like metrics: an accuracy must say max.
    Blamed on the key given last: ``--set checkpoint.keep_best=…`` over a profile's auto."""
    ckpt = built.get("checkpoint")
    if ckpt is None or not ckpt.keep_best or ckpt.best_mode != "auto":
        return []
    if "loss" in ckpt.keep_best.lower():
        return []
    why = "auto means min, for metrics named *loss* only"
    if "checkpoint.keep_best" in overridden and "checkpoint.best_mode" not in overridden:
        return [
            f"checkpoint.keep_best: {ckpt.keep_best} needs checkpoint.best_mode = min or max "
            f"({why}) (got {ckpt.keep_best!r})"
        ]
    return [f"checkpoint.best_mode: say min or max for {ckpt.keep_best} ({why}) (got 'auto')"]


def _early_stop_conflicts(
    train: TrainConfig | None, overridden: set[str] | frozenset[str]
) -> list[str]:
    """``train.early_stop_metric`` needs evals during the run (the end's eval alone can stop
    nothing), and a direction for a metric not named *loss* (as ``checkpoint.best_mode``).
    ``max_epochs`` and ``eval_every_epochs`` are turned into steps later: an eval every N
    epochs counts as evals during the run."""
    if train is None or not train.early_stop_metric:
        return []
    metric = train.early_stop_metric
    errors = []
    end = train.max_steps if train.max_steps and not train.max_epochs else None
    during = bool(train.eval_every_epochs) or any(
        end is None or n < end for n in [train.eval_every or None, *train.eval_at] if n
    )
    if not during:
        errors.append(
            f"train.early_stop_metric: needs evals during the run (train.eval_every, "
            f"train.eval_every_epochs or train.eval_at before train.max_steps; now only the "
            f"end's) (got {metric!r})"
        )
    if train.early_stop_mode == "auto" and "loss" not in metric.lower():
        why = "auto means min, for metrics named *loss* only"
        if "train.early_stop_metric" in overridden and "train.early_stop_mode" not in overridden:
            errors.append(
                f"train.early_stop_metric: {metric} needs train.early_stop_mode = min or max "
                f"({why}) (got {metric!r})"
            )
        else:
            errors.append(
                f"train.early_stop_mode: say min or max for {metric} ({why}) (got 'auto')"
            )
    return errors


def _blame(problem: str, source: str, overridden: set[str] | frozenset[str]) -> str:
    """Prefix a problem with where the value came from: the file, or ``--set``."""
    key = problem.split(":", 1)[0]
    # A bare section name (an unknown section) is --set's fault when a --set named it.
    by_set = key in overridden or (
        "." not in key and any(o.split(".", 1)[0] == key for o in overridden)
    )
    return f"--set: {problem}" if by_set else f"{source}: {problem}"


# -- finding profiles ------------------------------------------------------------------------

BUILTIN_DIR = Path(__file__).parent / "profiles"


def local_dir() -> Path:
    return Path.cwd() / "profiles"


def find_profile(name_or_path: str) -> Path:
    """A path to a TOML file, or NAME: ./profiles/NAME.toml first, then the built-ins."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or os.sep in name_or_path or path.is_file():
        if path.is_dir():
            raise ProfileError([f"{name_or_path}: a directory, not a profile file"])
        if not path.is_file():
            raise ProfileError([f"{name_or_path}: no such profile file"])
        return path
    for folder in (local_dir(), BUILTIN_DIR):
        candidate = folder / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    names = ", ".join(sorted({p.stem for p, _ in list_profiles()})) or "none"
    raise ProfileError([f"{name_or_path}: no such profile (known: {names})"])


def list_profiles() -> list[tuple[Path, str]]:
    """(path, origin) of every profile: local ones first, built-ins they do not shadow."""
    seen: set[str] = set()
    out: list[tuple[Path, str]] = []
    for folder, origin in ((local_dir(), "local"), (BUILTIN_DIR, "built-in")):
        if not folder.is_dir():
            continue
        paths = sorted(folder.glob("*.toml"), key=lambda p: (p.stem != "quickstart", p.stem))
        for p in paths:
            if p.stem not in seen:
                seen.add(p.stem)
                out.append((p, origin))
    return out


def load_profile(
    name_or_path: str, overrides: list[str] | None = None, task_config: type | None = None
) -> Profile:
    path = find_profile(name_or_path)
    data, touched = apply_overrides(parse_toml(path), overrides or [])
    profile = resolve(data, str(path), task_config, touched)
    if not profile.profile.name:
        profile.profile.name = path.stem
    return profile


def with_task_config(
    profile: Profile,
    task_config: type,
    source: str,
    overridden: set[str] | frozenset[str] = frozenset(),
) -> Profile:
    """Validate a user task's keys (a dict until its class is known) against its config."""
    if not isinstance(profile.task, dict):
        return profile
    errors: list[str] = []
    try:
        cfg = schema.build(task_config, profile.task, "task", errors)
    except (ValueError, TypeError) as e:
        errors.append(str(e))
    if errors:
        raise ProfileError([_blame(e, source, overridden) for e in errors])
    return dataclasses.replace(profile, task=cfg)
