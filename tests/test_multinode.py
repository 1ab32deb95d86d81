"""Two "machines" on this one: two torchrun agents on 127.0.0.1, one CPU rank each.

Each node runs the same command with its own runs directory, as on a cluster without a
shared file system. torchrun's c10d rendezvous (hosted by whichever agent binds the
endpoint first) assigns the global ranks; the node that gets rank 0 holds the checkpoints,
and both consoles show the global loss.
"""

from __future__ import annotations

import json

from conftest import (
    deadline,
    events_of,
    fast_profile,
    only_run,
    read_status,
    run_dirs,
    start_nodes,
    wait_for,
)


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
