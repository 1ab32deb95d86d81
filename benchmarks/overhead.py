"""The engine's overhead against a plain hand-written DDP loop, and the CLI's start-up cost.

    python benchmarks/overhead.py [--steps N] [--rounds R] [--json PATH]

One invocation runs, alternately and R times each (ABAB...):

  engine       ``python -m gpu_console run quickstart --headless`` (the real CLI, supervisor,
               torchrun, events), mlp task, 2 CPU ranks, fp32;
  plain        ``python -m torch.distributed.run --nproc-per-node 2 --standalone
               benchmarks/plain_ddp.py``: the same model, data and training settings in a
               minimal DDP loop;

each with its ranks pinned (rank i on its own cores, as many threads) and unpinned
(torchrun's default: one thread, no affinity), the plain loop with the engine's AdamW
implementation and the engine summing gradients with gloo as the plain loop does; plus the
engine as the profile sets it (its CPU ranks sum gradients through shared memory) and the
plain loop as PyTorch and torchrun leave it (unpinned, AdamW's own default implementation).
Both are measured the same way: rank 0's steady-state steps/s from the end of the first
~10% of steps to the end of the last one, startup excluded (the engine from the wall-clock
``t`` of its ``step`` events, the plain loop from its own ``perf_counter``). Periodic eval
and checkpoints are off in the engine runs: the plain loop does neither, and their cost is
not the loop's.

Pairs compared (ratios are per round, engine / plain, then the median over rounds):

  equal settings, pinned     engine (cpu_affinity = true, cpu_reduce = gloo)  / plain --pin
                                                                   target >= 0.97
  equal settings, unpinned   engine (cpu_affinity = false, cpu_reduce = gloo) / plain
                                                                   target >= 0.97
  defaults                   engine (profile defaults: shared-memory reduce)  / plain defaults
                                                                   target >= 1.3

Each run also records the other load on the machine while it ran (busy cores not ours);
the pairs are summarised over all rounds and over the quiet ones (``--retry-noisy N``
waits for an idle machine and repeats disturbed runs).

Plus: the wall time of ``python -m gpu_console --help`` (median of 5) and whether
``import gpu_console.cli`` imports torch (``python -X importtime``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "plain_ddp.py"
NPROC = 2
TARGET_EQUAL = 0.97
TARGET_DEFAULTS = 1.3
QUIET_CORES = 0.1  # other load below which a run counts as undisturbed


# -- environment -----------------------------------------------------------------------------


def bench_env() -> dict[str, str]:
    """The caller's environment without thread settings, so torchrun's defaults apply."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(var, None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    return env


class RunFailed(RuntimeError):
    pass


class LoadMeter:
    """How many cores something other than this benchmark kept busy during a run.

    Machine-wide busy time (/proc/stat) minus the CPU time of this benchmark's reaped
    children, over the wall time: about 0 on a quiet machine. Linux only; None elsewhere.
    """

    def __enter__(self) -> LoadMeter:
        self.start = (_machine_busy_s(), children_cpu_s(), time.perf_counter())
        self.cores: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        busy0, ours0, t0 = self.start
        busy1, ours1, t1 = _machine_busy_s(), children_cpu_s(), time.perf_counter()
        if busy0 is not None and busy1 is not None:
            self.cores = max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / (t1 - t0))


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def wait_idle(timeout_s: float = 120.0, busy_below: float = 0.1) -> None:
    """Wait until the machine's cores are (almost) idle for a second, or the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b0, t0 = _machine_busy_s(), time.perf_counter()
        time.sleep(1.0)
        b1, t1 = _machine_busy_s(), time.perf_counter()
        if b0 is None or b1 is None or (b1 - b0) / (t1 - t0) < busy_below:
            return


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RunFailed(f"{what} exited with {proc.returncode}:\n{tail}")


# -- the two sides ---------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    profile: str
    steps: int
    log_every: int
    warm: int  # steps excluded from timing (a multiple of log_every)
    global_batch: int
    engine_sets: list[str]
    plain_args: list[str]
    affinity_default: bool
    optimizer_impl: str  # the engine's resolved AdamW implementation
    nproc: int = NPROC


def make_setup(
    profile_name: str,
    steps: int,
    log_every: int | None,
    extra_sets: tuple[str, ...] = (),
    nproc: int = NPROC,
) -> Setup:
    """Resolve the profile once; both sides get the same values from it (``extra_sets``:
    ``--set`` items applied to both, e.g. the task's size)."""
    from gpu_console.engine.optim_build import resolve_impl
    from gpu_console.profile import load_profile

    base = load_profile(profile_name, list(extra_sets))
    if base.task_kind not in ("mlp", "transformer"):
        sys.exit(f"overhead.py: the profile's task must be built in (got {base.task_kind!r})")
    log_every = log_every or base.train.log_every
    sets = [
        *extra_sets,
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        "train.eval_every=0",  # eval only after the last step, outside the timed window
        "checkpoint.every_steps=0",
        "checkpoint.at_end=false",
        # The plain loop's AdamW decays every parameter (one group): the same update here.
        "train.weight_decay_params=all",
    ]
    if base.train.warmup_steps > steps:
        sets.append(f"train.warmup_steps={steps // 10}")
    p = load_profile(profile_name, sets)
    if p.train.grad_accum != 1 or p.distributed.lr_scaling != "none":
        sys.exit("overhead.py: the plain loop assumes grad_accum = 1 and lr_scaling = 'none'")
    warm = max(log_every, math.ceil(steps * 0.1 / log_every) * log_every)
    if warm >= steps:
        sys.exit(f"overhead.py: --steps {steps} leaves nothing to time after {warm} warmup steps")
    d = p.distributed
    ddp = {
        "static_graph": d.static_graph,
        "bucket_cap_mb": d.bucket_cap_mb,
        "find_unused_parameters": d.find_unused_parameters,
        "broadcast_buffers": d.broadcast_buffers,
        "gradient_as_bucket_view": d.gradient_as_bucket_view,
    }
    plain_args = [
        f"--kind={base.task_kind}",
        f"--steps={steps}",
        f"--warmup-steps={warm}",
        f"--window={log_every}",
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
    return Setup(
        profile_name,
        steps,
        log_every,
        warm,
        p.data.batch_size * nproc,
        sets,
        plain_args,
        d.cpu_affinity,
        resolve_impl(p.train.optimizer_impl, "cpu"),
        nproc,
    )


def on_cores(argv: list[str], cpus: set[int] | None) -> list[str]:
    """``argv`` run with its whole process tree on ``cpus`` (None: wherever the OS likes)."""
    if cpus is None:
        return argv
    pin = (
        f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)}); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", pin, *argv]


def _run(
    argv: list[str], cpus: set[int] | None, env: dict[str, str] | None, workdir: Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        on_cores(argv, cpus),
        capture_output=True,
        text=True,
        env=env or bench_env(),
        cwd=workdir,
        timeout=900,
    )


def run_engine(
    s: Setup,
    affinity: bool | None,
    workdir: Path,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> dict:
    """The real CLI; ``affinity`` None leaves every setting at the profile's default, else
    the plain loop's settings: that placement and gradients summed by gloo. ``cpus``: the
    cores the whole run (console, supervisor, torchrun, ranks) is kept on."""
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=workdir))
    argv = [sys.executable, "-m", "gpu_console", "run", s.profile, "--headless"]
    argv += ["--runs-dir", str(runs_dir), "--devices", f"cpu:{s.nproc}", "--precision", "fp32"]
    sets = list(s.engine_sets)
    if affinity is not None:
        sets.append(f"distributed.cpu_affinity={str(affinity).lower()}")
        sets.append("distributed.cpu_reduce=gloo")
    for item in sets:
        argv += ["--set", item]
    t0 = time.perf_counter()
    with LoadMeter() as load:
        proc = _run(argv, cpus, env, workdir)
    wall = time.perf_counter() - t0
    _check(proc, "engine run")
    run_dirs = [p for p in runs_dir.iterdir() if p.is_dir()]
    if len(run_dirs) != 1:
        raise RunFailed(f"expected one run directory under {runs_dir}, found {len(run_dirs)}")
    events = [json.loads(line) for line in (run_dirs[0] / "events.jsonl").read_text().splitlines()]
    shutil.rmtree(runs_dir, ignore_errors=True)
    start = next(e for e in events if e["kind"] == "start")
    return {
        **steady_rate(events, s.warm, s.steps),
        "wall_s": wall,
        "other_load_cores": load.cores,
        "threads": start.get("threads"),
    }


def steady_rate(events: list[dict], warm: int, steps: int) -> dict:
    """The engine's steps/s from the wall-clock ``t`` of its step events at ``warm`` and at
    the last step (``warm``: a log step)."""
    window = [e for e in events if e["kind"] == "step" and e["step"] >= warm]
    if not window:
        raise RunFailed(f"no engine step event at or after step {warm}")
    first, last = window[0], window[-1]
    if first["step"] != warm or last["step"] != steps:
        raise RunFailed(f"engine step events cover {first['step']}..{last['step']}")
    measured = last["step"] - first["step"]
    seconds = last["t"] - first["t"]
    # The same window from the engine's own per-interval timing (excludes event writing).
    pairs = zip(window, window[1:], strict=False)
    inner = sum(e["step_time_s"] * (e["step"] - p["step"]) for p, e in pairs)
    return {
        "steps_per_s": measured / seconds,
        "steps_per_s_step_time": measured / inner,
        # ms a step in each log interval, from the events' wall clock (tiny_step.py's median)
        "window_ms": [
            (e["t"] - p["t"]) * 1000 / (e["step"] - p["step"])
            for p, e in zip(window, window[1:], strict=False)
        ],
        "measured_steps": measured,
        "seconds": seconds,
        "step_t": [(e["step"], e["t"]) for e in window],  # wall clock of each log step
        "final_loss": last["loss"],
    }


def run_plain(
    s: Setup,
    pin: bool,
    workdir: Path,
    pytorch_defaults: bool = False,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> dict:
    """The plain loop with the engine's settings, or as PyTorch and torchrun leave it
    (``cpus``: the cores its process tree is kept on)."""
    out = Path(tempfile.mkstemp(prefix="plain-", suffix=".json", dir=workdir)[1])
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={s.nproc}"]
    argv += ["--standalone", str(PLAIN), *s.plain_args, f"--out={out}"]
    if not pytorch_defaults:
        argv.append(f"--optimizer-impl={s.optimizer_impl}")
    if pin:
        argv.append("--pin")
    t0 = time.perf_counter()
    with LoadMeter() as load:
        proc = _run(argv, cpus, env, workdir)
    wall = time.perf_counter() - t0
    _check(proc, "plain loop")
    result = json.loads(out.read_text())
    out.unlink()
    return {
        "steps_per_s": result["steps_per_s"],
        "window_ms": result.get("window_ms", []),
        "measured_steps": result["measured_steps"],
        "seconds": result["seconds"],
        "wall_s": wall,
        "other_load_cores": load.cores,
        "final_loss": result["final_loss"],
        "step_t": result.get("step_t", []),
        "threads": result["threads"],
    }


# -- the CLI's own cost ----------------------------------------------------------------------


def help_time(repeats: int = 5) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "gpu_console", "--help"], capture_output=True, text=True
        )
        times.append(time.perf_counter() - t0)
        _check(proc, "gpu-console --help")
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def import_check() -> dict:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import gpu_console.cli"],
        capture_output=True,
        text=True,
    )
    _check(proc, "import gpu_console.cli")
    lines = [
        ln
        for ln in proc.stderr.splitlines()
        if ln.startswith("import time:") and ln.split("|")[1].strip().isdigit()  # no header
    ]
    names = [ln.rsplit("|", 1)[-1].strip() for ln in lines]
    cumulative = {n: int(ln.split("|")[1]) for ln, n in zip(lines, names, strict=True)}
    cli_us = cumulative.get("gpu_console.cli")
    return {
        "torch_imported": any(ln.rstrip().endswith("| torch") for ln in lines),
        "torch_modules": sorted(n for n in names if n == "torch" or n.startswith("torch.")),
        "modules": len(names),
        "cli_cumulative_ms": cli_us / 1000 if cli_us is not None else None,
    }


# -- summary ---------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _quiet(run: dict) -> bool:
    other = run.get("other_load_cores")
    return other is not None and other < QUIET_CORES


def fmt_spread(d: dict, spec: str) -> str:
    return f"{d['median']:{spec}}  ({d['min']:{spec}}–{d['max']:{spec}})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each configuration")
    ap.add_argument("--profile", default="quickstart", help="an mlp profile")
    ap.add_argument("--log-every", type=int, default=None, help="engine's (default: profile's)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--retry-noisy",
        type=int,
        default=0,
        metavar="N",
        help="on a shared machine: wait (up to 2 min) for it to go idle before each run, and "
        "run again, up to N times, a run that other load disturbed",
    )
    a = ap.parse_args()

    import torch  # only for the report: versions and what the machine offers

    s = make_setup(a.profile, a.steps, a.log_every)
    cores = len(os.sched_getaffinity(0))
    print(
        f"overhead: profile {a.profile}, mlp, {NPROC} CPU ranks, fp32, {a.steps} steps "
        f"(timed after step {s.warm}), {a.rounds} rounds; torch {torch.__version__}, "
        f"{cores} cores, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    # (label, side, placement); placement None: the engine as the profile sets it.
    configs: list[tuple[str, str, bool | None]] = [
        ("engine pinned", "engine", True),
        ("plain pinned", "plain", True),
        ("engine unpinned", "engine", False),
        ("plain unpinned", "plain", False),
        ("engine defaults", "engine", None),
        ("plain defaults", "defaults", False),
    ]
    default_label = "engine defaults"
    results: dict[str, list[dict]] = {label: [] for label, _, _ in configs}

    # The CLI's own cost first: a few seconds, and a broken CLI fails before the long part.
    helpt = help_time()
    imp = import_check()

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuc-overhead-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            for label, side, placement in configs:
                for attempt in range(a.retry_noisy + 1):
                    if a.retry_noisy:
                        wait_idle()
                    if side == "engine":
                        res = run_engine(s, placement, work)
                    else:
                        res = run_plain(s, bool(placement), work, side == "defaults")
                    res["attempts"] = attempt + 1
                    if _quiet(res) or attempt == a.retry_noisy:
                        break
                    print(
                        f"  round {r + 1}  {label:<16} disturbed "
                        f"({res['other_load_cores']:.2f} cores of other load): again",
                        flush=True,
                    )
                results[label].append(res)
                other = res["other_load_cores"]
                print(
                    f"  round {r + 1}  {label:<16} {res['steps_per_s']:8.1f} steps/s  "
                    f"({res['measured_steps']} steps in {res['seconds']:.2f} s, "
                    f"run {res['wall_s']:.1f} s, threads {res['threads']}, other load "
                    f"{'?' if other is None else f'{other:.2f}'} cores)",
                    flush=True,
                )
    bench_s = time.perf_counter() - t_start

    def ratios(num: str, den: str) -> list[float]:
        return [
            n["steps_per_s"] / d["steps_per_s"]
            for n, d in zip(results[num], results[den], strict=True)
        ]

    pairs = [
        ("equal settings, pinned", "engine pinned", "plain pinned", TARGET_EQUAL),
        ("equal settings, unpinned", "engine unpinned", "plain unpinned", TARGET_EQUAL),
        ("defaults", default_label, "plain defaults", TARGET_DEFAULTS),
    ]
    summary = {label: spread([r["steps_per_s"] for r in results[label]]) for label in results}
    pair_out = []
    for name, num, den, target in pairs:
        rs = ratios(num, den)
        quiet = [
            r
            for r, n, d in zip(rs, results[num], results[den], strict=True)
            if _quiet(n) and _quiet(d)
        ]
        pair_out.append(
            {
                "pair": name,
                "engine": num,
                "plain": den,
                "ratio": spread(rs),
                "ratio_of_medians": summary[num]["median"] / summary[den]["median"],
                "quiet_rounds": len(quiet),
                "ratio_quiet": spread(quiet) if quiet else None,
                "target": target,
                "meets_target": statistics.median(rs) >= target,
            }
        )

    # The same model, data and settings learn the same thing: a cheap check of "same".
    losses = {label: results[label][-1]["final_loss"] for label in results}

    print()
    print(f"{'configuration':<18} {'steps/s median (min–max)':<28} {'samples/s':>10}")
    for label, sp in summary.items():
        print(f"{label:<18} {fmt_spread(sp, '7.1f'):<28} {sp['median'] * s.global_batch:10,.0f}")
    print()
    print(
        f"{'pair (engine / plain)':<26} {'ratio median (min–max)':<26} {'target':>7}  ok   "
        f"quiet rounds only"
    )
    for p in pair_out:
        ok = "yes" if p["meets_target"] else "NO "
        q = p["ratio_quiet"]
        quiet = f"{fmt_spread(q, '5.3f')}  n={p['quiet_rounds']}" if q else "none"
        print(
            f"{p['pair']:<26} {fmt_spread(p['ratio'], '5.3f'):<26} {p['target']:>7.2f}  {ok}  "
            f"{quiet}"
        )
    print(
        f"(quiet: both runs of the round saw under {QUIET_CORES} cores of other load; the "
        "machine's other work slows the two sides unevenly)"
    )
    print(
        f"(equal settings: the engine sums gradients with gloo, as the plain loop does; "
        f"defaults: the engine as the profile sets it, AdamW {s.optimizer_impl}, "
        f"{'pinned' if s.affinity_default else 'unpinned'}, gradients summed through shared "
        "memory; 'plain defaults' is torchrun's placement and AdamW's own choice)"
    )
    same = math.isclose(losses["engine pinned"], losses["plain pinned"], rel_tol=1e-5)
    print(
        "final loss: "
        + ", ".join(f"{k} {v:.6f}" for k, v in losses.items())
        + f"  (engine and plain {'agree' if same else 'DIFFER'})"
    )
    print(f"benchmark time {bench_s:.0f} s, load {os.getloadavg()[0]:.2f}")

    print()
    print(
        f"python -m gpu_console --help: {helpt['median_s'] * 1000:.0f} ms median of 5 "
        f"({helpt['min_s'] * 1000:.0f}–{helpt['max_s'] * 1000:.0f} ms)"
    )
    torch_line = "yes: " + ", ".join(imp["torch_modules"][:5]) if imp["torch_imported"] else "no"
    print(
        f"import gpu_console.cli: imports torch: {torch_line}; {imp['modules']} modules, "
        f"{imp['cli_cumulative_ms']} ms cumulative"
    )

    if a.json:
        report = {
            "profile": a.profile,
            "steps": a.steps,
            "timed_from_step": s.warm,
            "log_every": s.log_every,
            "rounds": a.rounds,
            "nproc": NPROC,
            "cores": cores,
            "torch": torch.__version__,
            "benchmark_s": bench_s,
            "runs": results,
            "steps_per_s": summary,
            "pairs": pair_out,
            "final_loss": losses,
            "help": helpt,
            "import": imp,
        }
        write_json(a.json, report)
    return 0


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def entry(main, script: str) -> None:
    """Run a benchmark's ``main``: a run that failed is one line and exit 1."""
    try:
        sys.exit(main())
    except RunFailed as e:
        print(f"{script}: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    entry(main, "overhead.py")
