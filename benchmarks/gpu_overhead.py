"""The engine against a hand-written DDP loop on GPUs: steps/s ratio and MFU of both.

    python benchmarks/gpu_overhead.py [--devices 0] [--rounds 3] [--steps 300] [--json PATH]
    python benchmarks/gpu_overhead.py --smoke      # CPU, tiny model: checks the script only
    python benchmarks/gpu_overhead.py --deterministic   # the cost of train.deterministic
    python benchmarks/gpu_overhead.py --compile         # engine + train.compile vs eager loop
    python benchmarks/gpu_overhead.py --checkpoint-every 100   # + checkpoint blocked s/GiB

One invocation runs, alternately and ``--rounds`` times each (engine, plain, engine, ...):

  engine   ``python -m gpu_console run benchmarks/encoder110m.toml --headless --devices D``:
           the real CLI, supervisor, torchrun, engine and events;
  plain    ``python -m torch.distributed.run --nproc-per-node N --standalone
           benchmarks/plain_ddp.py --kind transformer --device cuda --precision bf16``: the
           same task, data, GPUs and settings (bf16 autocast, fused AdamW, clip_grad_norm,
           warmup + cosine schedule, DDP arguments, TF32 and cuDNN settings, pinned batches)
           in a minimal loop that logs nothing.

The model (``benchmarks/encoder110m.toml``) is issue 9's: an encoder of about 110M parameters,
d_model 1024, 8 layers, seq 512, batch 32 per GPU. Both sides are timed the same way as in
``overhead.py``: rank 0's steady state from the end of the first ~10% of steps (a log step)
to the end of the last one (the engine from the ``t`` of its step events, written after the
log step's sync; the plain loop from ``perf_counter`` after ``torch.cuda.synchronize()``).

Printed: per round the steps/s of both and their ratio (engine / plain); the median and
range of the ratios (target >= 0.99); the MFU of both (the task's FLOPs per sample × samples/s
over the GPUs' dense bf16 peak, gpu_console/peaks.py) and the engine's own reported MFU.

``--deterministic``: the engine runs with ``train.deterministic = true`` (deterministic kernels,
no TF32, no cuDNN autotuning), the plain loop as before with the profile's defaults: the ratio
is then what determinism costs (times the engine's own overhead, measured without the flag).

``--compile``: the engine runs with ``train.compile = true`` against the same plain eager
loop (issue 10: target >= 1.12; a hand-written compiled loop reached 1.16 on an H100). The
compiling first step falls in the untimed first ~10% (its seconds are printed).

``--checkpoint-every K``: the engine also writes a checkpoint every K steps (the plain loop
writes none, so the ratio then includes what checkpoints cost); printed: the median seconds
training was blocked per checkpoint (``blocked_s``, from the checkpoint events), per GiB of
checkpoint, and the background write's ``write_s`` (issue 10: <= 0.15 s blocked per GiB).

``--smoke`` (= ``--devices cpu:2 --small --steps 40 --rounds 1``) runs the same code on CPU
with a tiny encoder in fp32, to check the script where there is no GPU; its ratio means
nothing about GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import (
    LoadMeter,
    _check,
    entry,
    fmt_spread,
    spread,
    steady_rate,
    write_json,
)

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "plain_ddp.py"
PROFILE = HERE / "encoder110m.toml"
TARGET = 0.99
COMPILE_TARGET = 1.12
SMALL = [  # --small: the same architecture, small enough for a CPU
    "task.vocab_size=128",
    "task.d_model=64",
    "task.n_heads=4",
    "task.n_layers=2",
    "task.seq_len=32",
    "task.train_samples=2048",
    "data.batch_size=8",
]


@dataclasses.dataclass
class Setup:
    devices: str  # --devices as the engine takes it: "0", "0,1" or "cpu:N"
    nproc: int
    cuda: bool
    precision: str
    steps: int
    warm: int
    global_batch: int
    flops_per_sample: float
    engine_sets: list[str]
    plain_args: list[str]
    env: dict[str, str]  # the plain loop's (the GPUs the engine gets, as CUDA_VISIBLE_DEVICES)


def make_setup(
    devices: str,
    steps: int,
    small: bool,
    deterministic: bool = False,
    compile_: bool = False,
    checkpoint_every: int = 0,
) -> Setup:
    """Resolve the profile once; both sides get the same values from it."""
    from gpu_console.engine.optim_build import resolve_impl
    from gpu_console.profile import load_profile
    from gpu_console.tasks.transformer import TransformerTask

    cuda = not devices.startswith("cpu")
    if cuda:
        ids = [int(i) for i in devices.split(",")]
        nproc = len(ids)
    else:
        nproc = int(devices.partition(":")[2] or 1)
    base = load_profile(str(PROFILE))
    log_every = base.train.log_every
    sets = [f"train.max_steps={steps}", f"train.warmup_steps={min(20, steps // 10)}"]
    # The plain loop's AdamW decays every parameter (one group): the same update here.
    sets.append("train.weight_decay_params=all")
    sets += SMALL if small else []
    p = load_profile(str(PROFILE), sets)
    warm = max(log_every, math.ceil(steps * 0.1 / log_every) * log_every)
    if warm >= steps:
        sys.exit(f"gpu_overhead.py: --steps {steps} leaves nothing to time after step {warm}")
    precision = "bf16" if cuda else "fp32"
    d = p.distributed
    ddp = {
        "static_graph": d.static_graph,
        "bucket_cap_mb": d.bucket_cap_mb,
        "find_unused_parameters": d.find_unused_parameters,
        "broadcast_buffers": d.broadcast_buffers,
        "gradient_as_bucket_view": d.gradient_as_bucket_view,
    }
    device = "cuda" if cuda else "cpu"
    plain_args = [
        "--kind=transformer",
        f"--device={device}",
        f"--precision={precision}",
        f"--optimizer-impl={resolve_impl(p.train.optimizer_impl, device)}",
        f"--steps={steps}",
        f"--warmup-steps={warm}",
        f"--batch-size={p.data.batch_size}",
        f"--lr={p.train.lr}",
        f"--weight-decay={p.train.weight_decay}",
        f"--lr-warmup={p.train.warmup_steps}",
        f"--clip={p.train.clip_grad_norm}",
        f"--seed={p.train.seed}",
        f"--data-seed={p.data.seed}",
        f"--task={json.dumps(dataclasses.asdict(p.task))}",
        f"--ddp={json.dumps(ddp)}",
    ]
    if p.hardware.tf32:
        plain_args.append("--tf32")
    if p.hardware.cudnn_benchmark:
        plain_args.append("--cudnn-benchmark")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        granted = visible.split(",") if visible else [str(i) for i in range(max(ids) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(granted[i] for i in ids)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    return Setup(
        devices,
        nproc,
        cuda,
        precision,
        steps,
        warm,
        p.data.batch_size * nproc,
        TransformerTask(p.task).flops_per_sample(),
        # The plain loop keeps the profile's defaults (TF32, autotuning): the baseline.
        sets
        + (["train.deterministic=true"] if deterministic else [])
        + (["train.compile=true"] if compile_ else [])
        + ([f"checkpoint.every_steps={checkpoint_every}"] if checkpoint_every else []),
        plain_args,
        env,
    )


def run_engine(s: Setup, workdir: Path) -> dict:
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=workdir))
    argv = [sys.executable, "-m", "gpu_console", "run", str(PROFILE), "--headless"]
    argv += ["--runs-dir", str(runs_dir), "--devices", s.devices, "--precision", s.precision]
    for item in s.engine_sets:
        argv += ["--set", item]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not s.cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    with LoadMeter() as load:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=workdir)
    wall = time.perf_counter() - t0
    _check(proc, "engine run")
    (run_dir,) = [p for p in runs_dir.iterdir() if p.is_dir()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    shutil.rmtree(runs_dir, ignore_errors=True)
    start = next(e for e in events if e["kind"] == "start")
    window = [e for e in events if e["kind"] == "step" and e["step"] > s.warm]
    reported = [e["mfu"] for e in window if "mfu" in e]
    ckpts = [e for e in events if e["kind"] == "checkpoint" and e.get("reason") == "interval"]
    first = next((e for e in events if e["kind"] == "step"), {})
    return {
        **steady_rate(events, s.warm, s.steps),
        "wall_s": wall,
        "other_load_cores": load.cores,
        "reported_mfu": statistics.median(reported) if reported else None,
        "mfu_not_shown": start.get("mfu_not_shown"),
        "compile_s": first.get("compile_s"),
        "recompiles": max((e.get("recompiles") or 0 for e in window), default=0),
        "checkpoints": [
            {k: e.get(k) for k in ("step", "bytes", "blocked_s", "waited_s", "write_s")}
            for e in ckpts
        ],
    }


def run_plain(s: Setup, workdir: Path) -> dict:
    out = Path(tempfile.mkstemp(prefix="plain-", suffix=".json", dir=workdir)[1])
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={s.nproc}"]
    argv += ["--standalone", str(PLAIN), *s.plain_args, f"--out={out}"]
    t0 = time.perf_counter()
    with LoadMeter() as load:
        proc = subprocess.run(argv, capture_output=True, text=True, env=s.env, cwd=workdir)
    wall = time.perf_counter() - t0
    _check(proc, "plain loop")
    result = json.loads(out.read_text())
    out.unlink()
    return {**result, "wall_s": wall, "other_load_cores": load.cores}


def peak_total(s: Setup, device_name: str) -> tuple[float | None, str]:
    """The GPUs' dense peak at the run's precision, or why there is none. ``device_name``
    comes from the plain loop's rank 0: this process never touches CUDA (a context here
    would hold GPU memory through both sides' runs)."""
    if not s.cuda:
        return None, "CPU run: MFU not shown"
    from gpu_console.peaks import UnknownPeak, peak_for

    try:
        peak = peak_for(device_name, s.precision)
    except UnknownPeak as e:
        return None, str(e)
    return peak.flops * s.nproc, peak.describe()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="0", help="GPU indices (0 or 0,1), or cpu:N")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--small", action="store_true", help="a tiny encoder (for a CPU)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="--devices cpu:2 --small --steps 40 --rounds 1: checks the script without a GPU",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="the engine with train.deterministic = true against the default plain loop",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="the engine with train.compile = true against the plain eager loop",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="the engine also checkpoints every K steps: blocked seconds per GiB",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    if a.smoke:
        a.devices, a.small, a.steps, a.rounds = "cpu:2", True, 40, 1

    import torch

    s = make_setup(a.devices, a.steps, a.small, a.deterministic, a.compile, a.checkpoint_every)
    target = COMPILE_TARGET if a.compile else TARGET
    print(
        f"gpu_overhead: {'small encoder' if a.small else 'encoder110m'}, "
        + ("engine deterministic, " if a.deterministic else "")
        + ("engine compiled, " if a.compile else "")
        + (f"engine checkpoints every {a.checkpoint_every}, " if a.checkpoint_every else "")
        + f"--devices "
        f"{s.devices}, {s.precision}, {a.steps} steps (timed after step {s.warm}), "
        f"{a.rounds} rounds; torch {torch.__version__}",
        flush=True,
    )
    peak: float | None = None
    peak_from = where = ""

    def mfu(steps_per_s: float) -> float | None:
        return s.flops_per_sample * steps_per_s * s.global_batch / peak if peak else None

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rounds: list[dict] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuc-gpu-overhead-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            engine = run_engine(s, work)
            plain = run_plain(s, work)
            if r == 0:
                peak, peak_from = peak_total(s, plain["device"])
                where = f"{s.nproc} × {plain['device']}"
                print(f"  {where}; peak: {peak_from}", flush=True)
            ratio = engine["steps_per_s"] / plain["steps_per_s"]
            rounds.append({"engine": engine, "plain": plain, "ratio": ratio})
            print(
                f"  round {r + 1}: engine {engine['steps_per_s']:7.2f} steps/s "
                f"(MFU {pct(mfu(engine['steps_per_s']))}, reported "
                f"{pct(engine['reported_mfu'])}), plain {plain['steps_per_s']:7.2f} steps/s "
                f"(MFU {pct(mfu(plain['steps_per_s']))}), ratio {ratio:.3f}",
                flush=True,
            )
    bench_s = time.perf_counter() - t_start

    ratios = spread([x["ratio"] for x in rounds])
    eng = spread([x["engine"]["steps_per_s"] for x in rounds])
    pla = spread([x["plain"]["steps_per_s"] for x in rounds])
    ok = ratios["median"] >= target
    print()
    print(f"engine steps/s  {fmt_spread(eng, '7.2f')}   MFU {pct(mfu(eng['median']))}")
    print(f"plain  steps/s  {fmt_spread(pla, '7.2f')}   MFU {pct(mfu(pla['median']))}")
    print(
        f"ratio (engine / plain, per round) {fmt_spread(ratios, '5.3f')} over {a.rounds} rounds"
        + (
            " (engine deterministic: what determinism costs; no target)"
            if a.deterministic
            else f"; target {target}: {'met' if ok else 'NOT met'}"
        )
        + ("" if s.cuda else " (CPU: says nothing about GPUs)")
    )
    if a.compile:
        firsts = [x["engine"]["compile_s"] for x in rounds]
        recompiles = [x["engine"]["recompiles"] for x in rounds]
        print(f"compiling first step, per round (s): {firsts}; recompiles: {recompiles}")
    ckpts = [c for x in rounds for c in x["engine"]["checkpoints"] if c.get("bytes")]
    per_gib = None
    if ckpts:
        gib = [c["bytes"] / 2**30 for c in ckpts]
        blocked = statistics.median(c["blocked_s"] or 0.0 for c in ckpts)
        per_gib = statistics.median(
            (c["blocked_s"] or 0.0) / g for c, g in zip(ckpts, gib, strict=True)
        )
        write = statistics.median(c["write_s"] or 0.0 for c in ckpts)
        print(
            f"checkpoints: {len(ckpts)} of {statistics.median(gib):.2f} GiB; training blocked "
            f"{blocked:.3f} s each ({per_gib:.3f} s/GiB; target 0.15), write {write:.2f} s"
        )
    print(f"benchmark time {bench_s:.0f} s")
    if a.json:
        report = {
            "devices": s.devices,
            "where": where,
            "small": a.small,
            "deterministic": a.deterministic,
            "compile": a.compile,
            "checkpoint_every": a.checkpoint_every,
            "checkpoint_blocked_s_per_gib": per_gib,
            "precision": s.precision,
            "steps": a.steps,
            "timed_from_step": s.warm,
            "rounds": rounds,
            "ratio": ratios,
            "steps_per_s": {"engine": eng, "plain": pla},
            "flops_per_sample": s.flops_per_sample,
            "peak": peak_from,
            "mfu": {"engine": mfu(eng["median"]), "plain": mfu(pla["median"])},
            "torch": torch.__version__,
            "benchmark_s": bench_s,
        }
        write_json(a.json, report)
    return 0


if __name__ == "__main__":
    entry(main, "gpu_overhead.py")
