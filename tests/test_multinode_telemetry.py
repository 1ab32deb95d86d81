"""Every node's GPUs, from any node's run directory.

On several nodes each node has its own run directory and its own supervisor recording that
node's GPUs into that directory's telemetry.jsonl; each node's first rank writes nodes.json
(every node's host and run directory). Where the runs directory is shared, every reader
(the fold behind the headless summary, ``ls --json`` and the run screen) folds
every node's file and marks each GPU with its host and node.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from conftest import deadline, fast_profile, read_status, run_dirs, start_nodes
from test_telemetry_supervisor import fake_env

from gpu_console.runs import NODES, read_nodes, write_nodes
from gpu_console.state import TelemetryFold, gpu_figures
from gpu_console.telemetry.recorder import Recorder
from gpu_console.tui.devices import DeviceFeed
from gpu_console.tui.widgets.devices import devices_text


def machine_env(machine: int) -> dict[str, str]:
    return fake_env("nvml_run_fake:node_gpus") | {"FAKE_NVML_MACHINE": str(machine)}


def uuids_in(run: Path) -> set[str]:
    lines = [json.loads(x) for x in (run / "telemetry.jsonl").read_text().splitlines()]
    return {g["uuid"] for x in lines if x["kind"] == "sample" for g in x["gpus"]}


def test_two_nodes_sharing_a_runs_directory_show_both_nodes_gpus(procs, runs_dir, tmp_path):
    profile = fast_profile(tmp_path, max_steps=40)
    consoles, _ = start_nodes(
        procs, profile, [runs_dir, runs_dir], envs=[machine_env(0), machine_env(1)]
    )
    outs = []
    for console in consoles:
        out, err = console.communicate(timeout=deadline(180))
        assert console.returncode == 0, out + err
        outs.append(out)
    runs = run_dirs(runs_dir)
    assert len(runs) == 2  # one run directory per node, side by side
    host = socket.gethostname()
    nodes = read_nodes(runs[0])
    assert read_nodes(runs[1]) == nodes
    assert [(n["node"], n["host"]) for n in nodes] == [(0, host), (1, host)]
    assert {n["run_dir"] for n in nodes} == {str(r.resolve()) for r in runs}
    # Each supervisor recorded its own node's GPU (the rank's), with its machine's UUID.
    node_uuids = {n["node"]: uuids_in(Path(n["run_dir"])) for n in nodes}
    assert (
        all(len(u) == 1 for u in node_uuids.values()) and len(set.union(*node_uuids.values())) == 2
    )

    listed = procs.cli("ls", "--json", "--runs-dir", str(runs_dir), env=machine_env(0))
    assert listed.returncode == 0, listed.stderr
    for row in json.loads(listed.stdout):
        gpus = row["gpus"]
        assert [(g["node"], g["host"], g["index"]) for g in gpus] == [(0, host, 0), (1, host, 0)]
        for g in gpus:
            assert {g["uuid"]} == node_uuids[g["node"]]
            assert g["samples"] >= 1 and g["util_mean"] == 87

    # Each console's headless summary names every node's GPU by node and host.
    for out in outs:
        rows = [line for line in out.splitlines() if line.startswith("GPU ")]
        assert len(rows) == 2, out
        assert f"GPU 0, node 0 ({host})" in rows[0] and f"GPU 0, node 1 ({host})" in rows[1]
    assert all(read_status(run)["state"] == "finished" for run in runs)


# -- the fold, on run directories written here -------------------------------------------


def sample(t: float, uuid: str, util: int) -> dict:
    gpu = {"index": 0, "uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "util_gpu": util}
    return {"v": 1, "t": t, "kind": "sample", "gpus": [gpu]}


def node_dir(root: Path, name: str, uuid: str, util: int) -> Path:
    run = root / name
    run.mkdir(parents=True)
    lines = [sample(100.0 + i, uuid, util) for i in range(3)]
    (run / "telemetry.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def two_node_run(root: Path) -> tuple[list[Path], list[dict]]:
    runs = [node_dir(root, "a", "GPU-a", 80), node_dir(root, "b", "GPU-b", 40)]
    nodes = [
        {"node": i, "host": f"host-{i}", "run_dir": str(r.resolve()), "rank": i}
        for i, r in enumerate(runs)
    ]
    for r in runs:
        write_nodes(r, nodes)
    return runs, nodes


def test_the_fold_reads_every_nodes_file_from_either_directory(tmp_path):
    runs, _ = two_node_run(tmp_path)
    for run in runs:
        gpus = gpu_figures(run)
        assert [(g["node"], g["host"], g["uuid"], g["util_mean"]) for g in gpus] == [
            (0, "host-0", "GPU-a", 80),
            (1, "host-1", "GPU-b", 40),
        ]
    # Read incrementally: a sample another node writes later is folded at the next poll.
    fold = TelemetryFold(runs[0])
    assert fold.poll()
    with open(runs[1] / "telemetry.jsonl", "a") as f:
        f.write(json.dumps(sample(103.0, "GPU-b", 40)) + "\n")
    assert fold.poll()
    assert [g["samples"] for g in fold.gpus()] == [3, 4]


def test_a_directory_that_is_not_the_runs_is_not_read(tmp_path):
    runs, nodes = two_node_run(tmp_path)
    # Node 1's path, seen from here, holds another run (an unshared disk): not this one's.
    write_nodes(runs[1], [{**n, "host": "elsewhere"} for n in nodes])
    assert [g["node"] for g in gpu_figures(runs[0])] == [0]
    # Missing altogether: the same.
    (runs[1] / NODES).unlink()
    assert [g["uuid"] for g in gpu_figures(runs[0])] == ["GPU-a"]


def test_a_single_machines_gpus_say_its_host_and_node_0(tmp_path):
    run = node_dir(tmp_path, "one", "GPU-x", 50)
    (run / "meta.json").write_text(json.dumps({"host": "box", "sessions": [{"host": "box"}]}))
    assert [(g["node"], g["host"]) for g in gpu_figures(run)] == [(0, "box")]


def test_the_recorder_folds_and_summarises_its_own_node_only(tmp_path):
    runs, _ = two_node_run(tmp_path)
    rec = Recorder(runs[0], sample=lambda: sample(104.0, "GPU-a", 80))
    rec._open()
    rec._setup()
    rec.finish()
    rec._close()
    summary = json.loads((runs[0] / "telemetry.jsonl").read_text().splitlines()[-1])
    assert summary["kind"] == "summary"
    assert [g["uuid"] for g in summary["gpus"]] == ["GPU-a"]


def test_the_run_screen_lists_the_other_nodes_gpus_by_node_and_host(tmp_path):
    runs, _ = two_node_run(tmp_path)
    feed = DeviceFeed(runs[0])
    feed.update(live=False, last_step={})
    text = devices_text(feed.view("cpu", {}, {}), 120).plain
    assert "GPU 0, node 0 (host-0)" in text and "GPU 0, node 1 (host-1)" in text
    assert "util 80 %" in text and "util 40 %" in text
