"""The engine's fixed cost per step, on a model whose step takes a few milliseconds on CPU.

    python benchmarks/tiny_step.py [--steps N] [--rounds R] [--ranks 1,2] [--json PATH]
                                   [--paired | --no-paired] [--paired-steps N]
                                   [--size issue|small]

``overhead.py`` measures the engine on a step long enough that a fixed cost per step hides
in it. Here the step is small, so whatever the engine does around each step shows: the
built-in transformer task at d_model 64, two layers, 32 tokens, 8 sequences a rank (about
5 ms a step on one CPU thread here, issue 26's case), or with ``--size small`` at d_model 32,
one layer, 16 tokens (about 1.4 ms). One invocation runs R
rounds of both sides for every rank count in ``--ranks``: one rank side by side on two cores
(``--paired``, the default with two cores or more: each side's time per step is taken over
the span both trained, ``--paired-steps`` steps each), else alternately (ABAB...):

  engine   ``python -m gpu_console run transformer --headless --devices cpu:N``, the real CLI,
           supervisor, torchrun and events, with ``train.log_every`` (default 10),
           eval and checkpoints off, ``distributed.cpu_affinity = false`` and
           ``cpu_reduce = "gloo"``;
  plain    ``benchmarks/plain_ddp.py --kind transformer`` under torchrun with the same model,
           data, optimizer, schedule and clipping: a plain model on one rank, DDP on two.

Both sides run one thread per rank (``OMP_NUM_THREADS=1``) and are timed the same way as in
``overhead.py``: rank 0's steady state, startup excluded. Printed: the time per step of each
side, the ratio engine / plain per round (median, min-max) against the targets (1.05 on one
rank, 1.10 on two), and the difference in milliseconds per step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (  # noqa: E402  (a sibling script, not a package)
    RunFailed,
    bench_env,
    entry,
    fmt_spread,
    make_setup,
    run_engine,
    run_plain,
    spread,
    write_json,
)

PROFILE = "transformer"
_DATA = ("task.dropout=0.0", "task.train_samples=4096", "task.eval_samples=0", "data.batch_size=8")
# Issue 26 asks for a step of about 5-10 ms on CPU; "small" is the case this script first
# ran, whose step is now about 1.4 ms on this machine: a fixed cost shows three times as much.
SIZES = {
    "issue": ("task.d_model=64", "task.n_heads=4", "task.n_layers=2", "task.seq_len=32", *_DATA),
    "small": ("task.d_model=32", "task.n_heads=2", "task.n_layers=1", "task.seq_len=16", *_DATA),
}
TARGETS = {1: 1.05, 2: 1.10}  # engine time per step / plain time per step


def one_thread_env() -> dict[str, str]:
    return {**bench_env(), "OMP_NUM_THREADS": "1"}


def run_pair(setup, work: Path, engine_core: int, plain_core: int) -> dict[str, dict]:
    """One rank: the engine and the plain loop at the same time, each on its own core, each
    side's time per step taken over the span of wall-clock time both were training.

    This machine's speed moves by up to half from one run to the next (other guests of its
    host), which made one-rank ratios of alternate runs spread from 0.8 to 1.5; side by
    side, both meet the same moments of the host. The plain loop starts once the engine
    trains (the engine's console, supervisor and torchrun take longer to start); then the
    engine's console and supervisor may run on either core (``_float_helpers``)."""
    before = set(work.glob("runs-*"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        engine = pool.submit(run_engine, setup, False, work, one_thread_env(), cpus={engine_core})
        deadline = time.monotonic() + 600
        while not engine.done() and time.monotonic() < deadline and not _training(work, before):
            time.sleep(0.05)
        _float_helpers(work, before, set(os.sched_getaffinity(0)))
        plain = pool.submit(run_plain, setup, False, work, env=one_thread_env(), cpus={plain_core})
        done = {"engine": engine.result(), "plain": plain.result()}
    lo = max(done["engine"]["step_t"][0][1], done["plain"]["step_t"][0][1])
    hi = min(done["engine"]["step_t"][-1][1], done["plain"]["step_t"][-1][1])
    for res in done.values():
        inside = [(step, t) for step, t in res["step_t"] if lo <= t <= hi]
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            raise RunFailed(
                "tiny_step.py: the two sides never trained at the same time; give --paired-steps "
                "more steps"
            )
        (s0, t0), (s1, t1) = inside[0], inside[-1]
        res["paired_ms"] = (t1 - t0) * 1000 / (s1 - s0)
        res["paired_s"] = t1 - t0
    return done


def _ms(res: dict) -> float:
    """A run's milliseconds a step: over the span both sides trained when paired, else over
    its whole timed window."""
    return res.get("paired_ms", 1000 / res["steps_per_s"])


def _float_helpers(work: Path, before: set[Path], cores: set[int]) -> None:
    """The engine's console and supervisor free to run on any core, as they are when there
    are more cores than ranks (on the rank's core they took 3-4 % of it, and evicted its
    caches each time they woke). Each side's rank and torchrun agent stay on its core."""
    for runs in set(work.glob("runs-*")) - before:
        pids = []
        for status in runs.glob("*/status.json"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(json.loads(status.read_text())["pids"]["supervisor"]))
        for proc in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
                if b"gpu_console" in cmd and b"run" in cmd and str(runs).encode() in cmd:
                    pids.append(int(proc.name))
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(task.name), cores)


def _training(work: Path, before: set[Path]) -> bool:
    """Whether the engine run started after ``before`` was taken has written a step event."""
    for runs in set(work.glob("runs-*")) - before:
        for events in runs.glob("*/events.jsonl"):
            try:
                if '"kind":"step"' in events.read_text():
                    return True
            except OSError:
                pass
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side per rank count")
    ap.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    ap.add_argument("--log-every", type=int, default=10, help="the engine's step-event interval")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--paired-steps",
        type=int,
        default=6000,
        help="steps of each side in a paired run: enough for the plain loop's training to "
        "fall inside the engine's",
    )
    ap.add_argument(
        "--paired",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one rank: run both sides at the same time, each on a core of its own, swapped "
        "each round (default: on with 2 or more cores)",
    )
    ap.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="issue",
        help="issue: a step of about 5 ms on one CPU thread (issue 26's case); small: about "
        "1.4 ms, where a fixed cost per step shows most",
    )
    a = ap.parse_args()
    tiny = SIZES[a.size]
    ranks = [int(n) for n in a.ranks.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    paired = a.paired if a.paired is not None else len(cores) >= 2
    if paired and len(cores) < 2:
        sys.exit("tiny_step.py: --paired needs two cores")

    import torch  # only for the report

    setups = {
        n: make_setup(
            PROFILE, a.paired_steps if n == 1 and paired else a.steps, a.log_every, tiny, nproc=n
        )
        for n in ranks
    }
    print(
        f"tiny_step: {PROFILE} task, size {a.size} ({', '.join(tiny)}), ranks {a.ranks}, fp32, "
        f"one thread a rank, {', '.join(f'{setups[n].steps} steps on {n}' for n in ranks)}, "
        f"log_every {a.log_every}, {a.rounds} rounds"
        f"{', one rank paired' if paired and 1 in ranks else ''}; torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[str, list[dict]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuc-tiny-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            for n in ranks:
                if n == 1 and paired:
                    done = run_pair(setups[n], work, cores[r % 2], cores[(r + 1) % 2])
                else:
                    done = {
                        "engine": run_engine(setups[n], False, work, one_thread_env()),
                        "plain": run_plain(setups[n], False, work, env=one_thread_env()),
                    }
                for side, res in done.items():
                    results.setdefault(f"{side} {n}", []).append(res)
                    if "paired_ms" in res:
                        where = f"{res['paired_s']:.2f} s side by side"
                    else:
                        where = f"other load {res['other_load_cores'] or 0:.2f} cores"
                    print(
                        f"  round {r + 1}  {side} {n} rank{'s' if n > 1 else ' '} "
                        f"{_ms(res):7.3f} ms/step  "
                        f"({res['measured_steps']} steps in {res['seconds']:.2f} s, {where})",
                        flush=True,
                    )
    bench_s = time.perf_counter() - t_start

    print()
    print(
        f"{'ranks':<6} {'engine ms/step':<24} {'plain ms/step':<24} "
        f"{'engine / plain (min–max)':<26} {'target':>6}  ok  {'+ms/step':>8}"
    )
    pairs = []
    robust = []
    for n in ranks:
        eng, pla = results[f"engine {n}"], results[f"plain {n}"]
        # Each run's median ms a step over its log intervals: a burst of the host's noise
        # (here seconds long, slowing either side by up to half) moves it only when it
        # covers half a run; every cost the engine pays each step or each log step is in it.
        w_e = [statistics.median(x["window_ms"]) for x in eng]
        w_p = [statistics.median(x["window_ms"]) for x in pla]
        w_ratio = spread([e / p for e, p in zip(w_e, w_p, strict=True)])
        robust.append((n, spread(w_e), spread(w_p), w_ratio))
        ms_e = spread([_ms(x) for x in eng])
        ms_p = spread([_ms(x) for x in pla])
        ratio = spread([_ms(e) / _ms(p) for e, p in zip(eng, pla, strict=True)])
        extra = ms_e["median"] - ms_p["median"]
        ok = ratio["median"] <= TARGETS.get(n, 1.10)
        pairs.append(
            {
                "ranks": n,
                "paired": n == 1 and paired,
                "engine_ms": ms_e,
                "plain_ms": ms_p,
                "ratio": ratio,
                "extra_ms": extra,
                "target": TARGETS.get(n, 1.10),
                "meets_target": ok,
                "final_loss": {"engine": eng[-1]["final_loss"], "plain": pla[-1]["final_loss"]},
                "window_median_ms": {"engine": spread(w_e), "plain": spread(w_p)},
                "window_median_ratio": w_ratio,
                "meets_target_window_median": w_ratio["median"] <= TARGETS.get(n, 1.10),
            }
        )
        print(
            f"{n:<6} {fmt_spread(ms_e, '6.3f'):<24} {fmt_spread(ms_p, '6.3f'):<24} "
            f"{fmt_spread(ratio, '5.3f'):<26} {TARGETS.get(n, 1.10):>6.2f}  "
            f"{'yes' if ok else 'NO '} {extra:8.3f}"
        )
    print("each run's median over its log intervals (robust to the host's bursts):")
    for n, ms_e, ms_p, ratio in robust:
        ok = ratio["median"] <= TARGETS.get(n, 1.10)
        print(
            f"{n:<6} {fmt_spread(ms_e, '6.3f'):<24} {fmt_spread(ms_p, '6.3f'):<24} "
            f"{fmt_spread(ratio, '5.3f'):<26} {TARGETS.get(n, 1.10):>6.2f}  "
            f"{'yes' if ok else 'NO '} {ms_e['median'] - ms_p['median']:8.3f}"
        )
    print(f"benchmark time {bench_s:.0f} s, load {os.getloadavg()[0]:.2f}")
    if a.json:
        report = {
            "profile": PROFILE,
            "size": a.size,
            "task": tiny,
            "steps": a.steps,
            "log_every": a.log_every,
            "rounds": a.rounds,
            "paired": paired,
            "torch": torch.__version__,
            "benchmark_s": bench_s,
            "runs": results,
            "pairs": pairs,
        }
        write_json(a.json, report)
    return 0


if __name__ == "__main__":
    entry(main, "tiny_step.py")
