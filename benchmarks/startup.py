"""How long from the command to the first training step: gpu-console against plain scripts.

    python benchmarks/startup.py [--rounds R] [--steps N] [--json PATH]

One invocation runs, alternately and R times each (default 4 rounds of 60 steps, about a
minute and a half on a 2-core machine), the same training (the quickstart MLP on CPU, see
``plain_start.py``):

  python         ``python benchmarks/plain_start.py``: a plain script, one process
  torchrun 1     ``python -m torch.distributed.run --nproc-per-node 1 --standalone
                 benchmarks/plain_start.py``: the same script under plain torchrun (gloo)
  torchrun 2     the same with ``--nproc-per-node 2``
  gpu-console 1  ``python -m gpu_console run quickstart --headless --devices cpu:1``: the real
                 CLI, supervisor, torchrun and engine
  gpu-console 2  the same with ``--devices cpu:2``

Every time is wall-clock seconds since the benchmark started the command (just before its
``Popen``). The first step: when the first optimizer step was done (the plain script stamps it,
the engine reports it in its first step event). End-to-end: until the command exited. The
stages (``gpu_console/timings.py``): when each was reached, from the engine's start event and
the plain script's own stamps. CPU-s: the CPU seconds of every process the command
started (reaped children's rusage: for gpu-console the console, supervisor, torchrun agent and
ranks), what a launch costs a busy machine, and the test suite's main cost. Printed: medians
over the rounds (min-max), gpu-console's difference to the plain script and to plain torchrun
(its CPU as a ratio), and the targets of issue 16 (one rank within 1.5 s of the plain script,
two within 0.5 s of plain torchrun).

The engine runs with the quickstart's defaults except what the plain script does not do:
``train.max_steps=N``, no eval (``train.eval_every=0``, ``task.eval_samples=0``), no
checkpoints (``checkpoint.every_steps=0``, ``checkpoint.at_end=false``).

Other work on the machine slows everything, unevenly: each run records the other load it saw
(busy cores not this benchmark's), and the report says how loaded the machine was; each pair
is also summarised over its quiet rounds only (both runs under 0.1 cores of other load).
Compare the differences, measured in the same invocation, rather than absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import LoadMeter, children_cpu_s  # noqa: E402 - as overhead.py measures

PLAIN = HERE / "plain_start.py"
CONFIGS = ("python", "torchrun 1", "torchrun 2", "gpu-console 1", "gpu-console 2")
STAGES = (
    "created",
    "supervisor",
    "torchrun",
    "rank",
    "imports",
    "process_group",
    "built",
    "ddp",
    "first_step",
    "end",
    "exit",
)
LEGEND = {
    "created": "the CLI made the run directory (meta.json and the supervisor next)",
    "supervisor": "the supervisor's code runs",
    "torchrun": "the supervisor starts torchrun",
    "rank": "rank 0's first line (plain: the script's)",
    "imports": "torch, the engine and the task imported",
    "process_group": "init_process_group returned (rendezvous, gloo)",
    "built": "model, optimizer and data built",
    "ddp": "DDP wrapped (the engine: FLOPs counted, checkpoint group, shared-memory reduce)",
    "first_step": "the first optimizer step done",
    "end": "the last step done",
    "exit": "the command exited (end-to-end)",
}
TARGET_ONE_RANK_S = 1.5  # gpu-console 1 - python, first step
TARGET_TWO_RANKS_S = 0.5  # gpu-console 2 - torchrun 2, first step
QUIET_CORES = 0.1  # other load below which a run counts as undisturbed


class RunFailed(RuntimeError):
    pass


def bench_env() -> dict[str, str]:
    """The caller's environment without thread settings: each side's own defaults apply."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(argv: list[str], workdir: Path) -> tuple[float, float, float | None, float]:
    """(unix time just before the start, seconds to the exit, other load in cores, CPU
    seconds of every process the command started)."""
    t0 = time.time()
    cpu0 = children_cpu_s()
    with LoadMeter() as load:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=bench_env(), cwd=workdir, timeout=600
        )
    wall = time.time() - t0
    cpu = children_cpu_s() - cpu0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RunFailed(f"{' '.join(argv[:6])}... exited with {proc.returncode}:\n{tail}")
    return t0, wall, load.cores, cpu


def run_plain(nproc: int | None, steps: int, workdir: Path) -> dict:
    """The plain script, alone (``nproc`` None) or under plain torchrun."""
    out = workdir / "plain.json"
    argv = [sys.executable]
    if nproc is not None:
        argv += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    argv += [str(PLAIN), f"--steps={steps}", f"--out={out}"]
    t0, wall, load, cpu = _run(argv, workdir)
    found = json.loads(out.read_text())
    out.unlink()
    marks = found["marks"]
    stages = {("rank" if k == "started" else k): t - t0 for k, t in marks.items()}
    return {
        "stages": stages | {"exit": wall},
        "other_load_cores": load,
        "cpu_s": cpu,
        "loss": found["loss"],
    }


def run_engine(nproc: int, steps: int, workdir: Path) -> dict:
    """The real CLI, headless; the stages from the run's events."""
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=workdir))
    sets = [
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "task.eval_samples=0",
        "checkpoint.every_steps=0",
        "checkpoint.at_end=false",
        f"train.warmup_steps={min(20, steps // 10)}",
    ]
    argv = [sys.executable, "-m", "gpu_console", "run", "quickstart", "--headless"]
    argv += ["--runs-dir", str(runs_dir), "--devices", f"cpu:{nproc}", "--precision", "fp32"]
    for item in sets:
        argv += ["--set", item]
    try:
        t0, wall, load, cpu = _run(argv, workdir)
        (run_dir,) = [p for p in runs_dir.iterdir() if p.is_dir()]
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
    events = [json.loads(line) for line in lines]
    start = next(e for e in events if e["kind"] == "start")
    steps_ev = [e for e in events if e["kind"] == "step"]
    timings = start.get("timings")
    if not timings:
        raise RunFailed("the start event has no timings (an engine without them?)")
    launched = timings["launched"]
    stages = {k: launched + v - t0 for k, v in timings["stages"].items()}
    first = next((e["timings"]["first_step"] for e in steps_ev if "timings" in e), None)
    if first is not None:
        stages["first_step"] = launched + first - t0
    stages["end"] = steps_ev[-1]["t"] - t0
    stages["exit"] = wall
    return {"stages": stages, "other_load_cores": load, "cpu_s": cpu, "loss": steps_ev[-1]["loss"]}


def run_config(name: str, steps: int, workdir: Path) -> dict:
    kind, _, n = name.partition(" ")
    if kind == "python":
        return run_plain(None, steps, workdir)
    if kind == "torchrun":
        return run_plain(int(n), steps, workdir)
    return run_engine(int(n), steps, workdir)


# -- report ----------------------------------------------------------------------------------


def is_quiet(run: dict) -> bool:
    """Nothing else kept a core busy while it ran (as overhead.py counts)."""
    return run["other_load_cores"] is not None and run["other_load_cores"] < QUIET_CORES


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def stage_median(runs: list[dict], stage: str) -> float | None:
    return median([r["stages"][stage] for r in runs if stage in r["stages"]])


def spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):5.2f} ({min(xs):.2f}-{max(xs):.2f})"


def report(results: dict[str, list[dict]], args, loads: tuple[str, str]) -> dict:
    cores = os.cpu_count()
    print()
    print(
        f"startup.py: {args.rounds} rounds of {args.steps} steps, the quickstart MLP on CPU; "
        "seconds from the command, median (min-max)"
    )
    other = [r["other_load_cores"] for rs in results.values() for r in rs]
    other = [x for x in other if x is not None]
    busy = f"{statistics.median(other):.2f} cores" if other else "unknown"
    print(
        f"machine: {cores} cores; load average {loads[0]} before, {loads[1]} after; other "
        f"load during the runs (median): {busy}. Other load slows every run: compare the "
        "differences"
    )
    print()
    print(f"{'':16}{'first step':>22}{'end-to-end':>22}{'CPU-s':>22}")
    for name in CONFIGS:
        first = [r["stages"]["first_step"] for r in results[name] if "first_step" in r["stages"]]
        ends = [r["stages"]["exit"] for r in results[name]]
        cpu = [r["cpu_s"] for r in results[name]]
        print(f"{name:16}{spread(first):>22}{spread(ends):>22}{spread(cpu):>22}")

    def paired(a: str, b: str, stage: str, ratio: bool = False, quiet: bool = False):
        """Per round: a - b (or a / b), so a round's noise hits both; ``quiet``: only the
        rounds where neither run saw other load."""
        out = []
        for ra, rb in zip(results[a], results[b], strict=False):
            if quiet and not (is_quiet(ra) and is_quiet(rb)):
                continue
            x, y = (
                (ra.get(stage), rb.get(stage))
                if stage == "cpu_s"
                else (ra["stages"].get(stage), rb["stages"].get(stage))
            )
            if x is not None and y is not None:
                out.append(x / y if ratio else x - y)
        return out

    summary = {}
    print()
    for engine, base, target in (
        ("gpu-console 1", "python", TARGET_ONE_RANK_S),
        ("gpu-console 1", "torchrun 1", None),
        ("gpu-console 2", "torchrun 2", TARGET_TWO_RANKS_S),
        ("gpu-console 2", "python", None),
    ):
        d = median(paired(engine, base, "first_step"))
        q = median(paired(engine, base, "exit", ratio=True))
        c = median(paired(engine, base, "cpu_s", ratio=True))
        quiet = paired(engine, base, "first_step", quiet=True)
        quiet_q = paired(engine, base, "exit", ratio=True, quiet=True)
        verdict = ""
        if target is not None and d is not None:
            verdict = f" (target <= {target:.1f} s: {'met' if d <= target else 'NOT met'})"
        calm = (
            f"; quiet rounds ({len(quiet)}): {median(quiet):+.2f} s, x{median(quiet_q):.2f}"
            if quiet
            else "; no quiet round"
        )
        print(
            f"{engine} against {base}: first step {'-' if d is None else f'{d:+.2f} s'}"
            f"{verdict}, end-to-end {'-' if q is None else f'x{q:.2f}'}, CPU "
            f"{'-' if c is None else f'x{c:.2f}'}{calm}"
        )
        summary[f"{engine} - {base}"] = {
            "first_step_s": d,
            "end_to_end_ratio": q,
            "cpu_ratio": c,
            "quiet_rounds": len(quiet),
            "quiet_first_step_s": median(quiet),
            "quiet_end_to_end_ratio": median(quiet_q),
        }

    print()
    print("When each stage was reached (median seconds from the command; - : no such stage)")
    print(f"{'':15}" + "".join(f"{n:>14}" for n in CONFIGS))
    table = {}
    for stage in STAGES:
        row = {n: stage_median(results[n], stage) for n in CONFIGS}
        table[stage] = row
        cells = "".join(f"{'-' if v is None else f'{v:.2f}':>14}" for v in row.values())
        print(f"{stage:15}{cells}")
    print()
    for stage in STAGES:
        print(f"  {stage:14} {LEGEND[stage]}")
    return {"pairs": summary, "stages": table}


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default=None, help="also write every run and the summary here")
    args = ap.parse_args()
    if args.steps < 10:
        sys.exit("startup.py: --steps must be at least 10 (the engine's first step event)")
    results: dict[str, list[dict]] = {n: [] for n in CONFIGS}
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        workdir = Path(tmp)
        # Untimed: page caches warm, torchrun's flags detected and cached.
        print("warming up (untimed): python, gpu-console 1", flush=True)
        run_config("python", 10, workdir)
        run_config("gpu-console 1", 10, workdir)
        for r in range(args.rounds):
            for name in CONFIGS:
                result = run_config(name, args.steps, workdir)
                results[name].append(result)
                s = result["stages"]
                load = result["other_load_cores"]
                print(
                    f"round {r + 1}/{args.rounds}  {name:14} first step "
                    f"{s.get('first_step', float('nan')):5.2f} s  exit {s['exit']:5.2f} s  "
                    f"CPU {result['cpu_s']:5.2f} s  "
                    f"other load {'?' if load is None else f'{load:.2f}'} cores",
                    flush=True,
                )
    summary = report(results, args, (before, load_average()))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, **summary}, indent=2))


if __name__ == "__main__":
    main()
