"""A GPU nearly full, the CUDA allocator retrying: warnings from the log steps' rows
(engine/memory_watch.py). The allocator's numbers are faked where the engine reads them
(``metrics.memory_sample``, its one reading of the device), on a one-rank run in this process."""

from __future__ import annotations

import pytest
from conftest import events_of, fast_profile
from harness import run_engine

from gpu_console.engine import step_log
from gpu_console.engine.exchange import Row
from gpu_console.engine.memory_watch import MemoryWatch

pytestmark = pytest.mark.quick

GIB = 2**30


def row(used_gib: float, total_gib: float = 80, retries: int = 0) -> Row:
    return Row(1.0, 1.0, 8, 0, 1, 2, 3, retries, int(used_gib * GIB), int(total_gib * GIB), 0, 0, 0)


def test_nearly_full_is_said_once_until_it_falls_back_and_ranks_together_are_one_line():
    said: list[str] = []
    watch = MemoryWatch(0.95, said.append)
    watch.check(10, [row(70), row(70)])
    assert said == []
    watch.check(20, [row(77), row(76.5)])  # 96.2 % and 95.6 %
    assert said == [
        "GPU memory nearly full at step 20: ranks 0, 1 96.2% of 80.0 GiB in use "
        "(hardware.memory_warn_fraction = 0.95); next the allocator retries, then a rank runs "
        "out: a smaller data.batch_size, train.activation_checkpointing or bf16 make room"
    ]
    watch.check(30, [row(79), row(79)])
    watch.check(40, [row(73), row(73)])  # 91.2 %: not 5 points below
    watch.check(50, [row(77), row(77)])
    assert len(said) == 1
    watch.check(60, [row(70), row(79)])  # rank 0 fell to 87.5 %, rank 1 stays
    watch.check(70, [row(77), row(79)])
    assert len(said) == 2 and said[1].startswith("GPU memory nearly full at step 70: rank 0 96.2%")
    off = MemoryWatch(0.0, said.append)
    off.check(10, [row(80)])
    assert len(said) == 2


def test_allocator_retries_are_said_at_the_first_then_each_time_they_double():
    said: list[str] = []
    watch = MemoryWatch(0.0, said.append)  # the fraction off: retries are said anyway
    for step, retries in [(10, 0), (20, 1), (30, 1), (40, 2), (50, 3), (60, 4), (70, 7)]:
        watch.check(step, [row(40, retries=retries)])
    steps = [m.split("by step ")[1].split(" ")[0] for m in said]
    assert steps == ["20", "40", "60"], said
    assert said[2].startswith(
        "the CUDA caching allocator retried allocations by step 60 (rank 0: 4 in all)"
    )
    MemoryWatch(0.95, said.append).check(10, [row(0, total_gib=0)])  # a CPU row: nothing said
    assert len(said) == 3


def test_a_run_says_it_in_its_events_and_its_steps_carry_the_gpus_numbers(tmp_path, monkeypatch):
    readings = iter(range(1, 1000))

    def gpu_like(device):  # allocated, reserved, peak; retries, in use, total
        n = next(readings)
        used = 70 * GIB if n < 3 else 78 * GIB
        return [GIB, 2 * GIB, 3 * GIB, 0 if n < 4 else n, used, 80 * GIB]

    monkeypatch.setattr(step_log, "memory_sample", gpu_like)
    profile = fast_profile(tmp_path, max_steps=6)
    run = run_engine(tmp_path, profile, "train.log_every=1")
    warnings = [e["message"] for e in events_of(run, "log") if e["level"] == "warning"]
    assert [m.split(":")[0] for m in warnings] == [
        "GPU memory nearly full at step 3",
        "the CUDA caching allocator retried allocations by step 4 (rank 0",
    ], warnings
    memory = events_of(run, "step")[-1]["memory"]
    assert memory == [
        {"rank": 0, "allocated": GIB, "reserved": 2 * GIB, "peak": 3 * GIB,
         "device_used": 78 * GIB, "device_total": 80 * GIB, "alloc_retries": 6}
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_reading_is_the_allocators_and_the_devices():
    import torch

    from gpu_console.engine.metrics import memory_sample

    device = torch.device("cuda", 0)
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    allocated, reserved, peak, retries, used, total = memory_sample(device)
    assert allocated >= held.numel() and reserved >= allocated and peak >= allocated
    assert retries >= 0 and total == torch.cuda.get_device_properties(device).total_memory
    assert reserved <= used <= total
