"""The engine's fixed cost per step, on a model whose step takes a few milliseconds on CPU.

    python benchmarks/tiny_step.py [--steps N] [--rounds R] [--ranks 1,2] [--json PATH]

``overhead.py`` measures the engine on a step long enough that a fixed cost per step hides
in it. Here the step is small (the built-in transformer task at d_model 32, one layer,
16 tokens, 8 sequences a rank: about 13k parameters and a few milliseconds a step on one
CPU thread), so whatever the engine does around each step shows. One invocation runs,
alternately (ABAB...) and R times each, for every rank count in ``--ranks``:

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
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import (  # noqa: E402  (a sibling script, not a package)
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
TINY = (
    "task.d_model=32",
    "task.n_heads=2",
    "task.n_layers=1",
    "task.seq_len=16",
    "task.dropout=0.0",
    "task.train_samples=4096",
    "task.eval_samples=0",
    "data.batch_size=8",
)
TARGETS = {1: 1.05, 2: 1.10}  # engine time per step / plain time per step


def one_thread_env() -> dict[str, str]:
    return {**bench_env(), "OMP_NUM_THREADS": "1"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each side per rank count")
    ap.add_argument("--ranks", default="1,2", help="rank counts, comma-separated")
    ap.add_argument("--log-every", type=int, default=10, help="the engine's step-event interval")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    ranks = [int(n) for n in a.ranks.split(",")]

    import torch  # only for the report

    setups = {n: make_setup(PROFILE, a.steps, a.log_every, TINY, nproc=n) for n in ranks}
    print(
        f"tiny_step: {PROFILE} task ({', '.join(TINY)}), ranks {a.ranks}, fp32, one thread "
        f"a rank, {a.steps} steps (timed after step {setups[ranks[0]].warm}), log_every "
        f"{a.log_every}, {a.rounds} rounds; torch {torch.__version__}, "
        f"{len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[str, list[dict]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpuc-tiny-") as tmp:
        work = Path(tmp)
        for r in range(a.rounds):
            for n in ranks:
                for side in ("engine", "plain"):
                    if side == "engine":
                        res = run_engine(setups[n], False, work, one_thread_env())
                    else:
                        res = run_plain(setups[n], False, work, env=one_thread_env())
                    results.setdefault(f"{side} {n}", []).append(res)
                    print(
                        f"  round {r + 1}  {side} {n} rank{'s' if n > 1 else ' '} "
                        f"{1000 / res['steps_per_s']:7.3f} ms/step  "
                        f"({res['measured_steps']} steps in {res['seconds']:.2f} s, other load "
                        f"{res['other_load_cores'] or 0:.2f} cores)",
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
        ms_e = spread([1000 / x["steps_per_s"] for x in eng])
        ms_p = spread([1000 / x["steps_per_s"] for x in pla])
        ratio = spread([p["steps_per_s"] / e["steps_per_s"] for e, p in zip(eng, pla, strict=True)])
        extra = ms_e["median"] - ms_p["median"]
        ok = ratio["median"] <= TARGETS.get(n, 1.10)
        pairs.append(
            {
                "ranks": n,
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
            "task": TINY,
            "steps": a.steps,
            "log_every": a.log_every,
            "rounds": a.rounds,
            "torch": torch.__version__,
            "benchmark_s": bench_s,
            "runs": results,
            "pairs": pairs,
        }
        write_json(a.json, report)
    return 0


if __name__ == "__main__":
    entry(main, "tiny_step.py")
