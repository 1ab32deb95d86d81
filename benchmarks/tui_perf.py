"""The console's three budgets (issue 4), each beside a baseline measured in the same run.

    python benchmarks/tui_perf.py                # about a minute here; --json PATH to keep
    python benchmarks/tui_perf.py --terminal headless --rounds 5

1. First frame: from spawning the process to the launch screen's first frame (and to its
   data: profiles, resolved TOML, devices), beside a bare Textual app with one Static.
   Target: < 0.5 s.
2. Attach to a run of 1,000,000 events (a ~300 MB events.jsonl written here, a live run):
   from spawning ``attach`` to the run screen showing step 1,000,000 (and to the background
   backfill of every eval and checkpoint), beside parsing the file line by line with
   ``json.loads`` (what a naive reader would do first). Target: < 2 s.
3. CPU of the console attached to a run that logs 50 steps a second (a writer process
   appends step events), beside the same console on a run that logs nothing. Target: < 10 %
   of one core.

The console runs in a real terminal (a tmux pane of 100×32) when tmux is installed, else
headless (Textual's headless driver: everything but the terminal writes). Rounds alternate
the two sides (ABAB…); medians are printed, with min–max.

Both sides mark their first frame alike: once the app is ready, in the callback after the
next refresh. The probe imports no screen the console would not import before that frame.
The children run with their bytecode cached in a folder of the benchmark's, even where
PYTHONDONTWRITEBYTECODE is set (as an installed package has its bytecode), after one
uncounted start of each side: otherwise every start would compile the console's sources
while Textual's come compiled from site-packages.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The synthetic run directories live with the tests (tests/synthetic.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


# -- the child: one console process, reporting what it saw to a file -------------------------


def child(args: argparse.Namespace) -> None:
    out = open(args.out, "a")  # noqa: SIM115 - lives as long as the process

    def mark(event: str, **extra) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), **extra}) + "\n")
        out.flush()

    mark("pid", pid=os.getpid())
    headless = args.terminal == "headless"
    if args.mode == "baseline-frame":
        from textual.app import App
        from textual.widgets import Static

        class Bare(App):
            def compose(self):
                yield Static("hello")

            def on_ready(self) -> None:
                self.call_after_refresh(lambda: (mark("frame"), self.exit()))

        Bare().run(headless=headless)
        return

    from gpu_console.tui.app import ConsoleApp

    def showing(screen: object, name: str) -> bool:
        # By class name: importing the run screen here would charge its import to the frame.
        return any(cls.__name__ == name for cls in type(screen).__mro__)

    class Probe(ConsoleApp):
        seen: set[str] = set()

        def on_ready(self) -> None:
            # The first frame is marked as the bare app marks its own (the app is ready, then
            # the refresh after it); a probe then polls for what comes later.
            self.call_after_refresh(self.once, "frame")
            if args.mode == "cpu":  # no probe timer of its own: it would be measured too
                self.set_timer(args.seconds, self.exit)
                return
            self.set_interval(0.005, self.probe)

        def once(self, event: str, **extra) -> None:
            if event not in self.seen:
                self.seen.add(event)
                mark(event, **extra)

        def probe(self) -> None:
            s = self.screen
            if args.mode == "first-frame" and showing(s, "LaunchScreen"):
                if s.preview and s._devices_ready and "frame" in self.seen:
                    self.call_after_refresh(self.once, "data")
                    self.call_after_refresh(self.exit)
            elif args.mode == "attach" and showing(s, "RunScreen") and s.snapshot:
                if s.updates >= 1:
                    self.call_after_refresh(self.once, "shown", step=s.snapshot.step)
                if s.snapshot.complete:
                    self.call_after_refresh(self.once, "backfilled")
                    self.call_after_refresh(self.exit)

    runs = Path(args.run_dir).parent if args.run_dir else Path(tempfile.mkdtemp()) / "runs"
    app = Probe(runs_dir=runs, run_dir=Path(args.run_dir) if args.run_dir else None)
    app.run(headless=headless)
    mark("exit")


# -- the parent -----------------------------------------------------------------------------------


def spawn(mode: str, terminal: str, extra: list[str], timeout: float = 120.0) -> list[dict]:
    """Run one child; return its marks (times relative to the spawn)."""
    out = Path(tempfile.mkdtemp()) / "marks.jsonl"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--out", str(out),
            "--terminal", terminal, *extra]  # fmt: skip
    env = child_env()
    t0 = time.time()
    if terminal == "tmux":
        socket = str(out.parent / "tmux.sock")
        cmd = " ".join(shlex.quote(a) for a in argv)
        subprocess.run(["tmux", "-S", socket, "new-session", "-d", "-x", "100", "-y", "32", cmd],
                       env=env, check=True)  # fmt: skip
        proc = None
    else:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            marks = _marks(out)
            if any(m["event"] == "exit" for m in marks) or (proc and proc.poll() is not None):
                break
            if mode == "baseline-frame" and any(m["event"] == "frame" for m in marks):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"{mode}: no exit within {timeout:.0f}s: {_marks(out)}")
    finally:
        if terminal == "tmux":
            subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)
        elif proc is not None:
            proc.wait(30)
    return [{**m, "dt": m["t"] - t0} for m in _marks(out)]


PYCACHE = Path(tempfile.gettempdir()) / "gpu-console-tui-perf-pycache"


def child_env() -> dict[str, str]:
    """The children's environment: bytecode cached (in a folder of this benchmark's, not in
    the tree) even where PYTHONDONTWRITEBYTECODE is set, as an installed package has it;
    otherwise every start would compile the console's sources again, and the bare app's
    (Textual's, in site-packages) not."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONPYCACHEPREFIX=str(PYCACHE))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def warm_up(terminal: str) -> None:
    """Compile the console's modules and run each side once, not counted: the first start
    of each would pay for compiling and for a cold file cache."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "gpu_console")],
                   env=child_env(), check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    spawn("baseline-frame", terminal, [])
    spawn("first-frame", terminal, [])


def _marks(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def at(marks: list[dict], event: str) -> float:
    return next(m["dt"] for m in marks if m["event"] == event)


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"


def first_frame(terminal: str, rounds: int) -> dict:
    console, data, bare = [], [], []
    for _ in range(rounds):
        m = spawn("first-frame", terminal, [])
        console.append(at(m, "frame"))
        data.append(at(m, "data"))
        bare.append(at(spawn("baseline-frame", terminal, []), "frame"))
    ratio = statistics.median(console) / statistics.median(bare)
    print(f"first frame    console  {stats(console)}")
    print(f"               + data   {stats(data)}")
    print(f"               bare Textual app {stats(bare)}   ratio {ratio:.2f}")
    return {"console_s": console, "data_s": data, "bare_s": bare}


def live_status(run: Path, pid: int) -> None:
    from synthetic import write_status  # tests/synthetic.py

    write_status(run, {"state": "running", "pids": {"supervisor": pid, "workers": []},
                       "started": time.time() - 60})  # fmt: skip


def attach(terminal: str, rounds: int, events: int) -> dict:
    import synthetic  # tests/synthetic.py

    run = Path(tempfile.mkdtemp()) / "runs" / "big-20260101-000000"
    run.mkdir(parents=True)
    (run / "run.toml").write_text("")
    t = time.perf_counter()
    size = synthetic.write_big_events(run / "events.jsonl", events)
    print(f"attach         {events:,} events, {size / 2**20:,.0f} MiB written in "
          f"{time.perf_counter() - t:.1f} s")  # fmt: skip
    live_status(run, os.getpid())  # this process plays the supervisor: the run is live
    shown, backfilled = [], []
    for _ in range(rounds):
        m = spawn("attach", terminal, ["--run-dir", str(run)])
        shown.append(at(m, "shown"))
        backfilled.append(at(m, "backfilled"))
        step = next(x["step"] for x in m if x["event"] == "shown")
    t = time.perf_counter()
    with open(run / "events.jsonl", "rb") as f:
        n = sum(1 for line in f if json.loads(line))
    naive = time.perf_counter() - t
    print(f"               shown    {stats(shown)}  (step {step:,})")
    print(f"               + every eval and checkpoint {stats(backfilled)}")
    print(f"               json.loads of every line: {naive:.2f} s ({n:,} lines)")
    shutil.rmtree(run.parent.parent, ignore_errors=True)
    return {"shown_s": shown, "backfilled_s": backfilled, "naive_parse_s": naive}


WRITER = """
import json, sys, time
path, rate, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
mem = [{"rank": r, "allocated": 341741568, "reserved": 352321536, "peak": 343932928}
       for r in range(2)]
step, start = 1000, time.monotonic()
with open(path, "a") as f:
    while time.monotonic() - start < seconds:
        if rate > 0:
            step += 1
            f.write(json.dumps({"v": 1, "t": round(time.time(), 3), "kind": "step",
                "step": step, "loss": 0.5 + 1 / step, "lr": 1e-3, "grad_norm": 0.5,
                "samples_per_s": 16000.0, "step_time_s": 1 / rate, "memory": mem},
                separators=(",", ":")) + "\\n")
            f.flush()
            next_at = start + (step - 1000) / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
        else:
            time.sleep(0.1)
"""


def cpu(terminal: str, rounds: int, seconds: float, rate: float) -> dict:
    import synthetic  # tests/synthetic.py

    results: dict[str, list[float]] = {"50/s": [], "idle": []}
    for _ in range(rounds):
        for label, r in (("50/s", rate), ("idle", 0.0)):
            base = Path(tempfile.mkdtemp())
            run = synthetic.write_run(base / "runs" / "fast-20260101-000000", state="running",
                                      steps=1000, max_steps=10**7, log_every=1,
                                      checkpoint_every=0, eval_every=0)  # fmt: skip
            writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run / "events.jsonl"),
                                       str(r), str(seconds + 30)])  # fmt: skip
            live_status(run, writer.pid)
            out = Path(tempfile.mkdtemp()) / "marks.jsonl"
            try:
                results[label].append(_child_cpu(terminal, run, out, seconds))
            finally:
                writer.kill()
                writer.wait()
                shutil.rmtree(base, ignore_errors=True)
    busy, idle = results["50/s"], results["idle"]
    print(f"app CPU        50 steps/s  {statistics.median(busy):.1f} % of one core "
          f"(min {min(busy):.1f}, max {max(busy):.1f})")  # fmt: skip
    print(f"               idle run    {statistics.median(idle):.1f} % "
          f"(min {min(idle):.1f}, max {max(idle):.1f})")  # fmt: skip
    return {"busy_percent": busy, "idle_percent": idle}


def _child_cpu(terminal: str, run: Path, out: Path, seconds: float) -> float:
    """Spawn a console attached to ``run``; its CPU % over ``seconds`` after a 2 s warm-up."""
    import psutil

    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "cpu", "--out", str(out),
            "--terminal", terminal, "--run-dir", str(run),
            "--seconds", str(seconds + 4)]  # fmt: skip
    env = child_env()
    socket = str(out.parent / "tmux.sock")
    proc = None
    if terminal == "tmux":
        cmd = " ".join(shlex.quote(a) for a in argv)
        subprocess.run(["tmux", "-S", socket, "new-session", "-d", "-x", "100", "-y", "32", cmd],
                       env=env, check=True)  # fmt: skip
    else:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not any(m["event"] == "frame" for m in _marks(out)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no frame: {_marks(out)}")
            time.sleep(0.05)
        pid = next(m["pid"] for m in _marks(out) if m["event"] == "pid")
        p = psutil.Process(pid)
        time.sleep(2.0)  # warm-up: the first read and the sampler's first ticks
        c0, t0 = sum(p.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        c1, t1 = sum(p.cpu_times()[:2]), time.monotonic()
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        if terminal == "tmux":
            subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)
        elif proc is not None:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=10.0, help="CPU window (default 10)")
    default_terminal = "tmux" if shutil.which("tmux") else "headless"
    ap.add_argument("--terminal", choices=("tmux", "headless"), default=default_terminal)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=50.0, help="steps a second (default 50)")
    ap.add_argument("--only", choices=("frame", "attach", "cpu"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.child:
        args.mode = args.child
        child(args)
        return
    print(f"terminal: {args.terminal}; rounds: {args.rounds}; {os.cpu_count()} cores")
    report = {}
    warm_up(args.terminal)
    if args.only in (None, "frame"):
        report["first_frame"] = first_frame(args.terminal, args.rounds)
    if args.only in (None, "attach"):
        report["attach"] = attach(args.terminal, args.rounds, args.events)
    if args.only in (None, "cpu"):
        report["cpu"] = cpu(args.terminal, args.rounds, args.seconds, args.rate)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
