"""How long a checkpoint blocks training: asynchronous against synchronous writes.

    python benchmarks/checkpoint_blocking.py [--rounds R] [--checkpoints K] [--hidden H]
                                             [--layers L] [--devices cpu:2] [--json PATH]

One invocation runs the real CLI (console, supervisor, torchrun, engine) on the quickstart
MLP made wide enough for a few hundred MB of state (``--hidden 2048 --layers 8``: 25 M
parameters, a 0.28 GiB checkpoint of model and AdamW state), alternately (ABAB...) with
``checkpoint.async_write = true`` and ``false``, R rounds each, every run writing K interval
checkpoints (every ``--every`` steps, default 10, so a write usually ends before the next
one is due) and its end checkpoint. From every checkpoint event: ``blocked_s``
(training waited: the wait for a write still in flight, the copy of the state into host
memory, the gather of the ranks' RNG states; synchronous: the whole write), ``write_s`` (the
write: serialise, fsync, rename, LATEST) and ``bytes``. Printed: per mode the medians over all
checkpoints of blocked_s, write_s and blocked_s per GiB of checkpoint, and async / sync of
blocked_s per GiB. Interval checkpoints are measured apart from the end one, which waits for
the write before it (the run ends only once its checkpoint is on disk).

Issue 10's target is on a GPU (≤ 0.15 s blocked per GiB: a pinned device → host copy); on
the CPU the copy is a memory copy, so the figure here is what the host side costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from overhead import LoadMeter  # noqa: E402 - the same other-load measure as overhead.py

GIB = 1024**3


def run(mode: str, args, workdir: Path) -> dict:
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=workdir))
    steps = args.every * args.checkpoints + 2
    sets = [
        f"train.max_steps={steps}",
        "train.eval_every=0",
        "task.eval_samples=0",
        f"task.hidden_dim={args.hidden}",
        f"task.num_layers={args.layers}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.keep_last=2",
        f"checkpoint.async_write={mode}",
        "train.warmup_steps=1",
    ]
    argv = [sys.executable, "-m", "gpu_console", "run", "quickstart", "--headless"]
    argv += ["--runs-dir", str(runs_dir), "--devices", args.devices, "--precision", "fp32"]
    for item in sets:
        argv += ["--set", item]
    try:
        with LoadMeter() as load:
            t0 = time.perf_counter()
            done = subprocess.run(argv, cwd=workdir, capture_output=True, text=True)
            wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        (run_dir,) = [p for p in runs_dir.iterdir() if p.is_dir()]
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
    events = [json.loads(line) for line in lines]
    ckpts = [e for e in events if e["kind"] == "checkpoint"]
    steps_ev = [e for e in events if e["kind"] == "step"]
    return {
        "mode": mode,
        "wall_s": wall,
        "other_load_cores": load.cores,
        "step_time_s": statistics.median(e["step_time_s"] for e in steps_ev),
        "checkpoints": [
            {k: e[k] for k in ("step", "reason", "bytes", "blocked_s", "waited_s", "write_s")}
            for e in ckpts
        ],
    }


def summary(results: list[dict]) -> dict:
    out = {}
    for mode in ("true", "false"):
        for which in ("interval", "end"):
            cs = [c for r in results if r["mode"] == mode for c in r["checkpoints"]]
            cs = [c for c in cs if c["reason"] == which]
            if not cs:
                continue
            out[f"{mode}/{which}"] = {
                "n": len(cs),
                "gib": statistics.median(c["bytes"] for c in cs) / GIB,
                "blocked_s": statistics.median(c["blocked_s"] for c in cs),
                "waited_s": statistics.median(c["waited_s"] for c in cs),
                "copy_s": statistics.median(c["blocked_s"] - c["waited_s"] for c in cs),
                "write_s": statistics.median(c["write_s"] for c in cs),
                "blocked_s_per_gib": statistics.median(
                    c["blocked_s"] / c["bytes"] * GIB for c in cs
                ),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--checkpoints", type=int, default=4, help="interval checkpoints per run")
    ap.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        for i in range(args.rounds):
            for mode in ("true", "false"):
                r = run(mode, args, Path(tmp))
                results.append(r)
                blocked = ", ".join(f"{c['blocked_s']:.3f}" for c in r["checkpoints"])
                load = r["other_load_cores"]
                print(
                    f"round {i + 1} async_write={mode:5}: wall {r['wall_s']:.1f} s, step "
                    f"{r['step_time_s']:.3f} s, blocked_s [{blocked}], other load "
                    f"{'?' if load is None else f'{load:.2f}'} cores",
                    flush=True,
                )
    s = summary(results)
    print(f"\n{'mode/checkpoint':<16} {'n':>3} {'GiB':>6} {'blocked_s':>10} {'waited_s':>9} "
          f"{'copy_s':>7} {'write_s':>8} {'blocked s/GiB':>14}")  # fmt: skip
    for key, v in s.items():
        mode, which = key.split("/")
        name = f"{'async' if mode == 'true' else 'sync'} {which}"
        print(f"{name:<16} {v['n']:>3} {v['gib']:>6.3f} {v['blocked_s']:>10.3f} "
              f"{v['waited_s']:>9.3f} {v['copy_s']:>7.3f} {v['write_s']:>8.3f} "
              f"{v['blocked_s_per_gib']:>14.3f}")  # fmt: skip
    if "true/interval" in s and "false/interval" in s:
        ratio = s["true/interval"]["blocked_s_per_gib"] / s["false/interval"]["blocked_s_per_gib"]
        print(f"\ninterval checkpoints: async blocks {ratio:.3f} × what sync blocks")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": s}, indent=2) + "\n")


if __name__ == "__main__":
    main()
