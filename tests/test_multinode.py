"""Two "machines" on this one: two torchrun agents on 127.0.0.1, one CPU rank each (two where
a test needs gloo's sum over more than two ranks).

Each node runs the same command with its own runs directory, as on a cluster without a
shared file system. torchrun's c10d rendezvous (hosted by whichever agent binds the
endpoint first) assigns the global ranks; the node that gets rank 0 holds the checkpoints,
and both consoles show the global loss.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import (
    deadline,
    events_of,
    fast_profile,
    only_run,
    paced_profile,
    read_status,
    run_dirs,
    start_nodes,
    wait_for,
)
from conftest import test_env as cli_env


def test_two_nodes_train_one_run_through_a_c10d_rendezvous(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=20)
    dirs = [runs_dir / "node0", runs_dir / "node1"]
    consoles, endpoint = start_nodes(procs, profile, dirs, node_ranks=True)
    outs = []
    for console in consoles:
        out, err = console.communicate(timeout=deadline(180))
        assert console.returncode == 0, out + err
        outs.append(out)
    runs = [only_run(d) for d in dirs]
    for node, run in enumerate(runs):
        argv = json.loads((run / "meta.json").read_text())["torchrun"]
        for flag in ("--nnodes=2", f"--node-rank={node}", f"--rdzv-endpoint={endpoint}"):
            assert flag in argv  # unchanged, for torchrun
        assert "--rdzv-backend=c10d" in argv
        assert read_status(run)["state"] == "finished"
        start = events_of(run, "start")[0]
        assert (start["world_size"], start["nodes"]) == (2, 2)

    # Both consoles saw the same global losses: the mean over both ranks, one per step.
    losses = [[e["loss"] for e in events_of(run, "step")] for run in runs]
    assert len(losses[0]) == 20 and losses[0] == losses[1]
    for out in outs:
        assert "started: 2 × cpu ranks" in out and "node " in out and " of 2" in out
        assert "finished (max_steps reached)" in out

    # The node whose rank is 0 wrote the checkpoints; the other one says where they are.
    with_ckpt = [r for r in runs if (r / "checkpoints" / "LATEST").is_file()]
    assert len(with_ckpt) == 1
    starts = [events_of(r, "start")[0] for r in runs]
    assert {s["rank_0"]["run_dir"] for s in starts} == {str(with_ckpt[0].resolve())}
    assert sorted(s["node"] for s in starts) == [0, 1]


def test_stop_from_either_node_stops_both(procs, runs_dir, tmp_path):
    from gpu_console.events import append_control

    profile = fast_profile(tmp_path, max_steps=1_000_000)
    dirs = [runs_dir / "node0", runs_dir / "node1"]
    consoles, _ = start_nodes(procs, profile, dirs)
    runs = [wait_for(lambda d=d: run_dirs(d) and only_run(d), what="a run directory") for d in dirs]
    wait_for(lambda: all(events_of(r, "step") for r in runs), what="steps on both nodes")
    # The node without rank 0 takes the command: every node's first rank reads its file.
    rank_0_dir = events_of(runs[0], "start")[0]["rank_0"]["run_dir"]
    other = next(r for r in runs if str(r.resolve()) != rank_0_dir)
    cid = append_control(other, "stop")
    for console in consoles:
        out, err = console.communicate(timeout=deadline(120))
        assert console.returncode == 0, out + err
    assert [e["state"] for e in events_of(other, "control") if e["id"] == cid] == [
        "received",
        "done",
    ]
    for run in runs:
        assert read_status(run)["state"] == "stopped"
    ckpts = [c for r in runs for c in events_of(r, "checkpoint") if c["reason"] == "stop"]
    assert len(ckpts) == 1  # written once, by rank 0's node


def test_several_nodes_need_a_rendezvous_endpoint(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=2)
    bad = procs.cli("run", str(profile), "--headless", "--nnodes", "2", "--runs-dir", str(runs_dir))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "gpu-console: --rdzv-endpoint: several nodes need HOST:PORT of the rendezvous"
    ]
    bad = procs.cli(
        "run",
        str(profile),
        "--headless",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "nohost",
        "--runs-dir",
        str(runs_dir),
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "gpu-console: --rdzv-endpoint: expected HOST:PORT (got 'nohost')"
    assert not runs_dir.exists() or not list(runs_dir.iterdir())


def test_two_nodes_stopped_and_resumed_train_as_if_never_stopped(procs, runs_dir, tmp_path):
    """Two nodes of two CPU ranks (gloo between them, four ranks: at two, a + b = b + a hides
    any order of the sum), stopped and resumed, against the same run uninterrupted: the same
    losses and final weights, bit for bit. gloo's ring all-reduce adds each element in an order
    set by its place in the bucket, and a resumed session's first step has DDP's first
    buckets (parameter order), the uninterrupted run's the rebuilt ones (arrival order)."""
    import torch

    from gpu_console.events import append_control

    steps = 24
    profile = paced_profile(tmp_path, max_steps=steps, ranks=2)
    # log_every = 2: the log table rides every other step's gradients, lengthening its bucket.
    profile.write_text(profile.read_text().replace("log_every = 1", "log_every = 2"))

    def nodes(runs, pace_s: float, *extra: str) -> list:
        envs = [cli_env(PACE_S=str(pace_s))] * 2
        consoles, _ = start_nodes(
            procs, profile, [runs, runs], node_ranks=True, envs=envs, cwd=tmp_path,
            devices="cpu:2", extra=extra,
        )  # fmt: skip
        return consoles

    def finish(consoles) -> None:
        for console in consoles:
            out, err = console.communicate(timeout=deadline(240))
            assert console.returncode == 0, out + err

    def rank_0(runs, before=()) -> Path | None:
        """The run directory of this session's rank 0, once its node's start event is in."""
        new = [r for r in run_dirs(runs) if r not in before]
        starts = [s for r in new for s in events_of(r, "start")]
        return Path(starts[0]["rank_0"]["run_dir"]) if len(new) == 2 and starts else None

    finish(nodes(runs_dir / "whole", 0))
    whole = rank_0(runs_dir / "whole")
    assert whole is not None

    cut = runs_dir / "cut"
    consoles = nodes(cut, 0.2)
    first = wait_for(lambda: rank_0(cut), what="the stopped session's start")
    wait_for(lambda: len(events_of(first, "step")) >= 1, what="the first logged step")
    append_control(first, "stop")
    finish(consoles)
    stop = [c["step"] for c in events_of(first, "checkpoint") if c["reason"] == "stop"]
    assert stop and stop[0] <= steps - 3, stop  # updates left to resume

    before = run_dirs(cut)
    finish(nodes(cut, 0, "--resume", str(first)))
    resumed = rank_0(cut, before)
    assert resumed is not None
    start = events_of(resumed, "start")[0]
    assert (start["world_size"], start["nodes"], start["start_step"]) == (4, 2, stop[0])
    assert "more than one machine" in start["reduce"]  # gloo between the nodes

    def losses(*runs: Path) -> dict[int, float]:
        return {e["step"]: e["loss"] for r in runs for e in events_of(r, "step")}

    expected = losses(whole)
    assert max(expected) == steps
    assert losses(first, resumed) == expected

    def final(run: Path) -> dict:
        latest = (run / "checkpoints" / "LATEST").read_text().strip()
        return torch.load(run / "checkpoints" / latest / "state.pt", weights_only=False)

    a, b = final(whole), final(resumed)
    assert a["step"] == b["step"] == steps
    for key in ("model", "optimizers"):
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
