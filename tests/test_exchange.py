"""The ranks' numbers ride with the gradients' all-reduce (gpu_console/engine/exchange.py).

Checked three ways: the table's encoding survives the sum exactly; under real torchrun
(3 ranks, so the world size is not a power of two), the hook's gradients are bit for bit
every rank's own added in rank order, with a table or without and in DDP's first buckets as
in its rebuilt ones (plain DDP's ring all-reduce: the same to rounding), and every rank's row
arrives; and in runs, log steps make no collective of their own (the harness,
tests/harness.py) while control checks between sparse log steps of a live run still answer
(real torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import (
    DDP_STEP,
    deadline,
    events_of,
    fast_profile,
    read_status,
    repo_pythonpath,
    the_run,
    wait_for,
)
from harness import run_engine

from gpu_console.engine.exchange import WIDTH, Row, decode, encode_ints
from gpu_console.events import append_control


def _table(world: int, rank: int, floats: list[float], ints: list[int]) -> torch.Tensor:
    table = torch.zeros(world, WIDTH)
    table[rank] = torch.tensor(floats + encode_ints(ints))
    return table


def test_rows_survive_the_sum_exactly():
    """Summing every rank's table (what the all-reduce does) gathers the rows, big ints exact."""
    big = [2**45 + 12345, 2**40 + 1, 3 * 2**33 + 7, 0, 1, 9, 141 * 2**30, 2**37, 4, 1,
           2**31 + 5, 1000]  # fmt: skip
    rows_in = [
        ([0.1234567, 12.5], big),
        ([float("nan"), 3.0], [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0]),
        ([2.5, float("inf")], [10**12, 0, 7, 7, 7, 0, 0, 0, 2, 0, 123456789, 3]),
    ]
    total = sum(_table(3, r, f, i) for r, (f, i) in enumerate(rows_in))
    rows = decode(total)
    assert rows[0] == Row(torch.tensor(0.1234567).item(), 12.5, *big)
    assert rows[1].samples == 1 and rows[1].peak == 5 and rows[1].last_loss != rows[1].last_loss
    assert rows[2].samples == 10**12 and rows[2].next_check == 123456789
    assert rows[2].cmd_arg == 3
    assert (rows[0].alloc_retries, rows[0].device_used, rows[0].device_total) == (
        9, 141 * 2**30, 2**37,
    )  # fmt: skip
    assert rows[2].loss_sum == float("inf")


WORKER = (
    r"""
import json, os, sys
from gpu_console.engine.signals import die_with_parent
die_with_parent()
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from gpu_console.engine.exchange import Exchange

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}

"""
    + DDP_STEP
    + r"""

def in_rank_order(seed, dtype):
    # every rank's own gradients, scaled as DDP scales them, added in rank order
    mine = grads(model(dtype), seed, dtype) * (1.0 / world)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    total = every[0].clone()
    for part in every[1:]:
        total.add_(part)
    return total

def same_to_rounding(a, b, seed, dtype):
    # Two orders of one sum of world terms differ by at most 2 (world - 1) eps times the
    # sum of the terms' magnitudes: a gradient whose terms cancel has a large relative error
    # in either order (an rtol alone fails on some machines' gloo order), never this one.
    mine = (grads(model(dtype), seed, dtype) * (1.0 / world)).abs()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    bound = 2 * (world - 1) * torch.finfo(dtype).eps * torch.stack(every).sum(0)
    return bool(((a - b).abs() <= bound).all()) and not torch.equal(bound, torch.zeros_like(bound))

for dtype, name in ((torch.float32, "f32"), (torch.float64, "f64")):
    plain = DDP(model(dtype))
    hooked = DDP(model(dtype))
    ex = Exchange(rank, world, torch.device("cpu"))
    hooked.register_comm_hook(None, ex.hook)
    # A step without a table (DDP's first buckets, in parameter order): the rank-ordered sum,
    # bit for bit, and plain DDP's to rounding.
    plain_1, hooked_1 = grads(plain, 1, dtype), grads(hooked, 1, dtype)
    ordered = torch.equal(hooked_1, in_rank_order(1, dtype))
    close = same_to_rounding(plain_1, hooked_1, 1, dtype)
    # A step with a table (DDP's rebuilt buckets, in arrival order, the table after them):
    # still the same bits, and every rank's row arrives.
    ref = grads(plain, 2, dtype)
    ex.prepare([torch.tensor(0.5 + rank), torch.tensor(10.0 * rank)],
               [100 + rank, 2**40 + rank, rank, 2 * rank, 3 * rank, 0, 0, 0, rank % 2, 0, 0, 0])
    got = grads(hooked, 2, dtype)
    rows = ex.gather()
    out[name] = {
        "bitwise_without_table": ordered and close,
        "bitwise_with_table": torch.equal(got, in_rank_order(2, dtype)),
        "close_with_table": same_to_rounding(ref, got, 2, dtype),
        "rows": [[r.last_loss, r.loss_sum, r.samples, r.tokens, r.reserved, r.cmd] for r in rows],
        "counts": ex.counts(),
    }
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
os._exit(0)  # past torch 2.13/gloo's occasional abort at interpreter teardown (as the engine)
"""
)


def test_hook_matches_plain_ddp_and_gathers_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    # torchrun ends on its own; its ranks die with it (PR_SET_PDEATHSIG) if it is killed.
    proc = subprocess.run(
        [*argv, str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected_rows = [
        [0.5 + r, 10.0 * r, 100 + r, 2**40 + r, 2 * r, r % 2] for r in range(3)
    ]  # fmt: skip
    for rank in range(3):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        f32, f64 = result["f32"], result["f64"]
        for res in (f32, f64):
            assert res["bitwise_without_table"] and res["bitwise_with_table"]
            assert res["close_with_table"]
            assert res["rows"] == expected_rows
        assert f32["counts"] == {"carried": 1, "separate": 0}
        # float64 gradients cannot carry the float32 table: one collective of its own.
        assert f64["counts"] == {"carried": 0, "separate": 1}


def test_log_steps_make_no_collective_of_their_own(tmp_path):
    run = run_engine(tmp_path, fast_profile(tmp_path, max_steps=30, ranks=2), ranks=2)
    steps = events_of(run, "step")
    assert [e["step"] for e in steps] == list(range(1, 31))  # log_every = 1
    finished = events_of(run, "status")[-1]
    assert finished["state"] == "finished"
    assert finished["exchanges"] == {"carried": 30, "separate": 0}
    assert all(e["loss"] == e["loss"] and len(e["memory"]) == 2 for e in steps)


def test_control_between_sparse_log_steps_still_answers(procs, runs_dir, tmp_path):
    """No log step for a million steps: checks come on the control interval instead."""
    profile = fast_profile(tmp_path, max_steps=1_000_000, ranks=2)
    text = profile.read_text().replace("log_every = 1\n", "log_every = 1000000\n")
    profile.write_text(text)
    console = procs.start("run", str(profile), "--headless", "--runs-dir", str(runs_dir))
    run = wait_for(lambda: the_run(runs_dir), what="the run directory")
    wait_for(
        lambda: any(e["state"] == "running" for e in events_of(run, "status")),
        what="the run to be running",
    )

    def acks(cid):
        return [e["state"] for e in events_of(run, "control") if e["id"] == cid]

    cid = append_control(run, "checkpoint")
    wait_for(lambda: acks(cid) == ["received", "done"], what="checkpoint acknowledged")
    assert [c["reason"] for c in events_of(run, "checkpoint")] == ["request"]
    cid = append_control(run, "stop")
    out, err = console.communicate(timeout=deadline(120))
    assert console.returncode == 0, out + err
    assert acks(cid) == ["received", "done"]
    stopped = events_of(run, "status")[-1]
    assert stopped["state"] == "stopped" and read_status(run)["state"] == "stopped"
    assert not events_of(run, "step")
    assert stopped["exchanges"]["carried"] == 0 and stopped["exchanges"]["separate"] >= 2


def test_one_rank_gathers_its_own_row_with_no_collective():
    """One rank's sum is its own table: no process group is needed (none exists here), and the
    row built from host numbers on CPU carries the losses' float32 values exactly."""
    import torch.distributed as dist

    from gpu_console.engine.exchange import Exchange

    assert not dist.is_initialized()
    ex = Exchange(0, 1, torch.device("cpu"))
    loss = torch.tensor(0.1234567, dtype=torch.float32)
    total = 2.5000001  # a host number (the CPU window's loss sum): rounded once, to float32
    ints = [8, 128, 2**40 + 3, 2**40 + 3, 2**41, 5, 2**36, 2**37, 0, 0, 11, 0]
    ex.prepare([loss, total], ints, [0.75, 8])
    (row,) = ex.gather()
    assert row.last_loss == loss.item()
    assert row.loss_sum == torch.tensor(total, dtype=torch.float32).item()
    assert (row.samples, row.tokens, row.allocated, row.peak) == (8, 128, 2**40 + 3, 2**41)
    assert (row.alloc_retries, row.device_used, row.device_total) == (5, 2**36, 2**37)
    assert row.next_check == 11 and row.extra == [0.75, 8.0]
    assert ex.counts() == {"carried": 0, "separate": 1}
    assert ex.control_only((3, 1, 20, 7))[0].cmd == 3  # a control check: the same, no group
