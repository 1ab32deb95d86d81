"""``train.compile`` against eager on the transformer profile, 2 CPU ranks, one invocation.

    python benchmarks/compile_cpu.py [--steps N] [--rounds R] [--json PATH]

Runs the real CLI (``gpu-console run transformer --headless --devices cpu:2 --precision
fp32``) alternately with ``train.compile = false`` and ``true`` (ABAB...), eval and
checkpoints off, and reports each run's steady-state steps/s (rank 0's step events from the
end of the first ~10% of steps, so start-up and the compiling first step are excluded), the
compiled / eager ratio per round (median), and the compiled runs' first-step seconds
(``compile_s``: the first round's is a cold compile unless the inductor cache already holds
it, later rounds' come from the cache).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(runs_dir: Path, compile_on: bool, steps: int, log_every: int) -> dict:
    name = f"{'compiled' if compile_on else 'eager'}-{len(list(runs_dir.glob('*')))}"
    args = [
        sys.executable, "-m", "gpu_console", "run", "transformer", "--headless",
        "--devices", "cpu:2", "--precision", "fp32", "--runs-dir", str(runs_dir),
        "--name", name,
        "--set", f"train.max_steps={steps}", "--set", f"train.log_every={log_every}",
        "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=0",
        "--set", "checkpoint.at_end=false", "--set", "task.eval_samples=0",
        "--set", f"train.compile={'true' if compile_on else 'false'}",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    (run_dir,) = runs_dir.glob(name + "-*")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    step_events = [e for e in events if e["kind"] == "step"]
    warm = math.ceil(steps * 0.1 / log_every) * log_every
    first = next(e for e in step_events if e["step"] >= warm)
    last = step_events[-1]
    rate = (last["step"] - first["step"]) / (last["t"] - first["t"])
    return {
        "compile": compile_on,
        "steps_per_s": rate,
        "compile_s": step_events[0].get("compile_s"),
        "recompiles": last.get("recompiles"),
        "final_loss": last["loss"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(REPO))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            eager = run(Path(tmp), False, a.steps, a.log_every)
            compiled = run(Path(tmp), True, a.steps, a.log_every)
            ratio = compiled["steps_per_s"] / eager["steps_per_s"]
            rows.append({"round": r + 1, "eager": eager, "compiled": compiled, "ratio": ratio})
            print(
                f"round {r + 1}: eager {eager['steps_per_s']:.1f} steps/s, compiled "
                f"{compiled['steps_per_s']:.1f} steps/s (first step {compiled['compile_s']:.1f} s,"
                f" {compiled['recompiles']} recompiles): compiled / eager {ratio:.2f}×",
                flush=True,
            )
    median = statistics.median(r["ratio"] for r in rows)
    print(f"compiled / eager, median over {len(rows)} rounds: {median:.2f}×")
    if a.json:
        a.json.write_text(json.dumps({"rounds": rows, "median_ratio": median}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
