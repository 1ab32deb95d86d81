"""CPU ranks on one machine sum gradients through shared memory (engine/shared_reduce.py).

Checked under real torchrun, at 2 ranks (gloo's own bits) and 3 (a world size that is not a
power of two), with chunks small enough that a tensor takes several rounds: sums agree with
gloo's and are the same bits on every rank; DDP's gradients through the hook are plain
DDP's; a rank that never arrives is named after the timeout; nothing is left in /dev/shm.
Then whole runs (the harness, tests/harness.py): the default reduces through shared memory
and learns bit for bit what ``cpu_reduce = "gloo"`` learns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DDP_STEP, events_of, fast_profile, repo_pythonpath
from harness import run_engine

from gpu_console.engine import shared_reduce
from gpu_console.engine.shared_reduce import SharedReduce, unavailable

pytestmark = pytest.mark.skipif(
    unavailable("cpu", 2, 2) is not None, reason="this machine cannot reduce through /dev/shm"
)


def test_where_shared_memory_is_not_used_says_why(monkeypatch, tmp_path):
    assert unavailable("cpu", 2, 2) is None
    assert "not on CPU" in unavailable("cuda", 2, 2)
    assert "one rank" in unavailable("cpu", 1, 1)
    assert "more than one machine" in unavailable("cpu", 4, 2)
    monkeypatch.setattr(shared_reduce.platform, "machine", lambda: "aarch64")
    assert "x86-64" in unavailable("cpu", 2, 2)
    monkeypatch.undo()
    monkeypatch.setattr(shared_reduce, "SHM", str(tmp_path / "missing"))
    assert "not writable" in unavailable("cpu", 2, 2)


def test_ranks_that_rule_it_out_themselves_make_no_collective():
    # No process group here: a collective would raise. On GPUs it would be NCCL's, and NCCL
    # refuses the CPU tensors this one uses.
    gpus = SimpleNamespace(rank=0, world_size=2, local_world_size=2, device=torch.device("cuda"))
    assert SharedReduce.create(gpus, 1.0, "test") == (None, "the ranks are not on CPU")
    nodes = SimpleNamespace(rank=0, world_size=4, local_world_size=2, device=torch.device("cpu"))
    assert SharedReduce.create(nodes, 1.0, "test")[1] == "the ranks are on more than one machine"


WORKER = (
    r"""
import json, os, sys, glob
from types import SimpleNamespace
from gpu_console.engine.signals import die_with_parent
die_with_parent()
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from gpu_console.engine import shared_reduce
from gpu_console.engine.exchange import Exchange

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
shared_reduce.CHUNK = int(sys.argv[2])  # small: a tensor takes several rounds
label = sys.argv[3]
d = SimpleNamespace(rank=rank, world_size=world, local_world_size=world, device=torch.device("cpu"))
shared, why = shared_reduce.SharedReduce.create(d, 60.0, label)
out = {"why": why}

def same_everywhere(t):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return all(torch.equal(parts[0], p) for p in parts)

sums = []
for n in (1, shared_reduce.CHUNK - 1, shared_reduce.CHUNK, 3 * shared_reduce.CHUNK + 5):
    g = torch.Generator().manual_seed(1000 * n + rank)
    x = torch.randn(n, generator=g)
    before = x.clone()
    got = shared.all_reduce(x)
    ref = x.clone()
    dist.all_reduce(ref)
    sums.append({
        "n": n,
        "input_unchanged": torch.equal(x, before),
        "bitwise_gloo": torch.equal(got, ref),
        "close_gloo": torch.allclose(got, ref, rtol=1e-6, atol=1e-6),
        "same_everywhere": same_everywhere(got),
    })
out["sums"] = sums

"""
    + DDP_STEP
    + r"""

for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64")):
    plain = DDP(model(dtype))
    hooked = DDP(model(dtype))
    ex = Exchange(rank, world, torch.device("cpu"), shared)
    hooked.register_comm_hook(None, ex.hook)
    ref, got = grads(plain, 1, dtype), grads(hooked, 1, dtype)
    ex.prepare([torch.tensor(0.5 + rank), torch.tensor(10.0 * rank)],
               [100 + rank, 2**40 + rank, rank, 2 * rank, 3 * rank, 0, 0, 0, rank % 2, 0, 0, 0])
    ref2, got2 = grads(plain, 2, dtype), grads(hooked, 2, dtype)
    rows = ex.gather()
    out[name] = {
        "bitwise": torch.equal(ref, got) and torch.equal(ref2, got2),
        "close": torch.allclose(ref, got, rtol=1e-5, atol=1e-7)
        and torch.allclose(ref2, got2, rtol=1e-5, atol=1e-7),
        "same_everywhere": same_everywhere(got) and same_everywhere(got2),
        "rows": [[r.last_loss, r.loss_sum, r.samples, r.tokens, r.reserved, r.cmd] for r in rows],
        "counts": ex.counts(),
    }

# The last case: every rank but 0 stays away; rank 0 must give up and say who.
shared.timeout_s = 1.0
if rank == 0:
    try:
        shared.all_reduce(torch.ones(3))
        out["timeout"] = None
    except RuntimeError as e:
        out["timeout"] = str(e)
dist.barrier()  # rank 0 is past create() by now, where it unlinks the file
out["left_in_shm"] = glob.glob(f"/dev/shm/gpu-console-{label}-*")
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
os._exit(0)  # past torch 2.13/gloo's occasional abort at interpreter teardown (as the engine)
"""
)


@pytest.mark.parametrize("world", [2, 3])
def test_sums_and_gradients_match_gloo_on_every_rank(tmp_path, world):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    label = f"test-{os.getpid()}-{world}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += [f"--nproc-per-node={world}", str(script), str(tmp_path), "1000", label]
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    # torchrun ends on its own; its ranks die with it (PR_SET_PDEATHSIG) if it is killed.
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected_rows = [
        [0.5 + r, 10.0 * r, 100 + r, 2**40 + r, 2 * r, r % 2] for r in range(world)
    ]  # fmt: skip
    for rank in range(world):
        res = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert res["why"] is None
        assert res["left_in_shm"] == []  # unlinked once every rank had mapped it
        for s in res["sums"]:
            assert s["input_unchanged"] and s["close_gloo"] and s["same_everywhere"], s
            if world == 2:  # a + b: gloo's own bits
                assert s["bitwise_gloo"], s
        f32, f64 = res["f32"], res["f64"]
        for r in (f32, f64):
            assert r["close"] and r["same_everywhere"]
            assert r["rows"] == expected_rows
        if world == 2:
            assert f32["bitwise"] and f64["bitwise"]
        assert f32["counts"] == {"carried": 1, "separate": 0}
        # float64 buckets go through gloo; the float32 table then has its own (shared) round.
        assert f64["counts"] == {"carried": 0, "separate": 1}
        if rank == 0:
            late = list(range(1, world))
            assert res["timeout"] and f"rank(s) {late} did not arrive within 1 s" in res["timeout"]
    assert not list(Path("/dev/shm").glob(f"gpu-console-{label}-*"))


DEATH_WORKER = r"""
import json, os, sys
from types import SimpleNamespace
from gpu_console.engine.signals import die_with_parent
die_with_parent()
import torch, torch.distributed as dist
from gpu_console.engine import shared_reduce

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
d = SimpleNamespace(rank=rank, world_size=world, local_world_size=world, device=torch.device("cpu"))
shared, _ = shared_reduce.SharedReduce.create(d, 300.0, sys.argv[2])
if rank == 1:
    os._exit(0)  # gone without a word, as a crashed rank is
try:
    shared.all_reduce(torch.ones(3))
    error = None
except RuntimeError as e:
    error = str(e)
with open(os.path.join(sys.argv[1], "rank-0.json"), "w") as f:
    json.dump({"error": error, "pid_of_1": shared._pids[1]}, f)
os._exit(0)  # no teardown: the peer of this process group is gone
"""


def test_a_rank_that_ends_is_noticed_from_its_pid_not_the_timeout(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(DEATH_WORKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv += [str(script), str(tmp_path), f"test-{os.getpid()}-death"]
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "rank-0.json").read_text())
    # Noticed well before the 300 s timeout: the subprocess deadline above is 120 s.
    assert res["error"] == (
        f"shared-memory all-reduce: rank 1 (pid {res['pid_of_1']}) ended while rank 0 waited for it"
    )


def _losses(run: Path) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in events_of(run, "step")]


def test_a_run_reduces_through_shared_memory_and_learns_what_gloo_learns(tmp_path):
    profile = fast_profile(tmp_path, max_steps=30, ranks=2)
    runs = {}
    for name, sets in (("default", []), ("gloo", ["distributed.cpu_reduce=gloo"])):
        runs[name] = run_engine(tmp_path, profile, *sets, ranks=2, runs_dir=tmp_path / name)
    shm, gloo = runs["default"], runs["gloo"]
    assert events_of(shm, "start")[0]["reduce"] == "shared memory"
    assert events_of(gloo, "start")[0]["reduce"] == "gloo (distributed.cpu_reduce = gloo)"
    assert len(_losses(shm)) == 30 and _losses(shm) == _losses(gloo)  # 2 ranks: a + b
    assert events_of(shm, "status")[-1]["exchanges"] == {"carried": 30, "separate": 0}
    assert not list(Path("/dev/shm").glob(f"gpu-console-{shm.name}-*"))
