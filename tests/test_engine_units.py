"""Fast in-process unit tests of the engine's pieces at their seams.

Schedules (also through a real ``LambdaLR``), precision resolution, the optimizer's
kernels, sharded resumable data, checkpoints in a one-process gloo group, the supervisor's
failure summary and the headless summary. No subprocesses, no network, no sleeps.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import pickle
import random
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from gpu_console import headless, summary, supervisor
from gpu_console.engine import checkpoint, precision
from gpu_console.engine import optim_build as optim
from gpu_console.engine.data import Batches, DataPosition, ShardSampler, make_loader
from gpu_console.engine.optim_set import Optimizers
from gpu_console.engine.refusal import Refused
from gpu_console.engine.schedule import lr_factor, scaled_lr
from gpu_console.profile import DataConfig, TrainConfig
from gpu_console.state import RunState
from gpu_console.tasks.base import TensorSet

pytestmark = pytest.mark.quick  # the loop between edits (tests/README.md)

# -- schedule -------------------------------------------------------------------------------


def train_cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_warmup_ramps_linearly_to_exactly_one_at_its_last_step(schedule):
    cfg = train_cfg(max_steps=20, warmup_steps=4, schedule=schedule, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # The decay starts from the peak: no dip or jump right after warmup.
    assert lr_factor(4, cfg) == pytest.approx(1.0)


def test_constant_schedule_holds_the_peak_after_warmup():
    cfg = train_cfg(max_steps=10, warmup_steps=2, schedule="constant", min_lr_ratio=0.3)
    assert [lr_factor(s, cfg) for s in range(2, 15)] == [1.0] * 13


def test_linear_decay_reaches_the_floor_at_max_steps_and_stays_there():
    cfg = train_cfg(max_steps=14, warmup_steps=4, schedule="linear", min_lr_ratio=0.1)
    assert lr_factor(4, cfg) == pytest.approx(1.0)
    assert lr_factor(9, cfg) == pytest.approx(0.55)  # half-way through the decay
    assert lr_factor(14, cfg) == pytest.approx(0.1)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    decay = [lr_factor(s, cfg) for s in range(4, 15)]
    steps = [a - b for a, b in zip(decay[:-1], decay[1:], strict=True)]
    assert all(d == pytest.approx(0.09) for d in steps)


def test_linear_decay_without_warmup_starts_at_the_peak():
    cfg = train_cfg(max_steps=10, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(0, cfg) == 1.0
    assert lr_factor(5, cfg) == pytest.approx(0.5)
    assert lr_factor(10, cfg) == pytest.approx(0.0)


@pytest.mark.parametrize("floor", [0.0, 0.2])
def test_cosine_is_half_way_at_the_middle_of_the_decay_and_ends_at_the_floor(floor):
    cfg = train_cfg(max_steps=24, warmup_steps=4, schedule="cosine", min_lr_ratio=floor)
    assert lr_factor(4, cfg) == pytest.approx(1.0)
    assert lr_factor(14, cfg) == pytest.approx((1 + floor) / 2)
    assert lr_factor(24, cfg) == pytest.approx(floor)
    assert lr_factor(50, cfg) == pytest.approx(floor)
    decay = [lr_factor(s, cfg) for s in range(4, 25)]
    assert all(a >= b for a, b in zip(decay[:-1], decay[1:], strict=True))
    # Cosine, not linear: slow at the start, faster in the middle.
    assert 1.0 - lr_factor(5, cfg) < lr_factor(13, cfg) - lr_factor(14, cfg)


def test_lambdalr_gives_the_optimizer_the_scheduled_lr_before_every_update():
    cfg = train_cfg(max_steps=12, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    peak = 0.05
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    seen = []
    for _ in range(cfg.max_steps):
        seen.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(2)
        opt.step()
        sched.step()
    expected = [peak * lr_factor(s, cfg) for s in range(cfg.max_steps)]
    assert seen == pytest.approx(expected)
    assert seen[0] == pytest.approx(peak / 3)  # the first update is not at lr 0
    assert seen[2] == pytest.approx(peak)
    assert opt.param_groups[0]["lr"] == pytest.approx(peak * 0.1)  # after the last step
    assert sched.get_last_lr()[0] == pytest.approx(peak * 0.1)


def test_lambdalr_resumed_from_its_state_dict_continues_the_same_sequence():
    cfg = train_cfg(max_steps=10, warmup_steps=2, schedule="linear", min_lr_ratio=0.0)

    def make():
        p = torch.nn.Parameter(torch.zeros(1))
        o = torch.optim.SGD([p], lr=1.0)
        return p, o, torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, cfg))

    p, opt, sched = make()
    for _ in range(4):
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    p2, opt2, sched2 = make()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr_factor(4, cfg))
    for s in range(4, 8):
        assert opt2.param_groups[0]["lr"] == pytest.approx(lr_factor(s, cfg))
        p2.grad = torch.ones(1)
        opt2.step()
        sched2.step()


def test_scaled_lr_by_world_size():
    assert scaled_lr(1e-3, 4, "none") == 1e-3
    assert scaled_lr(1e-3, 4, "linear") == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 4, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 2, "sqrt") == pytest.approx(1e-3 * math.sqrt(2))
    assert scaled_lr(1e-3, 1, "linear") == 1e-3


# -- precision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((9, 0), "bf16")],
)
def test_auto_precision_on_cuda_follows_compute_capability(capability, expected):
    assert precision.resolve("auto", "cuda", capability) == expected


def test_auto_precision_on_cpu_is_fp32_and_explicit_choices_stand():
    assert precision.resolve("auto", "cpu", None) == "fp32"
    assert precision.resolve("bf16", "cpu", None) == "bf16"
    assert precision.resolve("fp32", "cuda", (7, 0)) == "fp32"
    assert precision.resolve("fp16", "cuda", (9, 0)) == "fp16"
    assert precision.resolve("bf16", "cuda", (8, 6)) == "bf16"


def test_explicit_bf16_on_a_pre_ampere_gpu_is_an_error_naming_the_key():
    with pytest.raises(precision.PrecisionError) as info:
        precision.resolve("bf16", "cuda", (7, 5))
    msg = str(info.value)
    assert msg.startswith("train.precision:")
    assert "7.5" in msg and "8.0" in msg and "'bf16'" in msg
    assert isinstance(info.value, ValueError)


def test_bf16_on_cuda_with_unknown_capability_is_a_precision_error():
    with pytest.raises(precision.PrecisionError, match="train.precision"):
        precision.resolve("bf16", "cuda", None)


def test_grad_scaler_only_for_fp16_on_cuda():
    assert precision.make_scaler("bf16", "cuda") is None
    assert precision.make_scaler("fp32", "cuda") is None
    assert precision.make_scaler("fp16", "cpu") is None
    assert precision.make_scaler("bf16", "cpu") is None
    with warnings.catch_warnings():
        # Without a GPU, GradScaler("cuda") warns and disables itself; only its type matters.
        warnings.simplefilter("ignore")
        scaler = precision.make_scaler("fp16", "cuda")
    assert isinstance(scaler, torch.amp.GradScaler)


def test_the_first_loss_scale_is_train_loss_scale_init(monkeypatch):
    """fp16 on a GPU starts its GradScaler (DDP's, FSDP's sharded one) at the profile's
    scale; the default is torch's own."""
    import inspect

    from gpu_console.engine import fsdp
    from gpu_console.profile import TrainConfig

    torch_default = inspect.signature(torch.amp.GradScaler).parameters["init_scale"].default
    assert TrainConfig().loss_scale_init == torch_default == 2.0**16
    # GradScaler("cuda") turns itself off where CUDA is absent, forgetting its scale.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for make in (precision.make_scaler, fsdp.make_scaler):
        scaler = make("fp16", "cuda", 1024.0)
        assert scaler is not None and scaler.is_enabled() and scaler.get_scale() == 1024.0
        assert make("bf16", "cuda", 1024.0) is None


def test_autocast_fp32_is_a_null_context_and_leaves_matmuls_in_fp32():
    ctx = precision.autocast("fp32", "cpu")
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx:
        assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.float32


def test_autocast_bf16_on_cpu_runs_matmuls_in_bf16():
    ctx = precision.autocast("bf16", "cpu")
    assert isinstance(ctx, torch.autocast)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with ctx:
        out = a @ b
    assert a.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32  # only inside the context


# -- optimizer ------------------------------------------------------------------------------


def test_auto_optimizer_is_fused_on_cpu_and_cuda_and_explicit_choices_stand():
    assert optim.resolve_impl("auto", "cpu") == "fused"
    assert optim.resolve_impl("auto", "cuda") == "fused"
    for impl in ("fused", "foreach", "for-loop"):
        assert optim.resolve_impl(impl, "cpu") == impl


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_every_optimizer_impl_takes_the_same_adamw_step(impl):
    """The kernels differ; the update is AdamW's, to float rounding, whichever runs it."""

    def run(impl: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
        opt = optim.build(model.parameters(), 1e-2, 0.1, impl, "cpu")
        assert opt.defaults["fused"] is (True if impl == "fused" else None)
        assert opt.defaults["foreach"] is (None if impl == "fused" else impl == "foreach")
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        for _ in range(5):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [q.detach().clone() for q in model.parameters()]

    reference = run("for-loop")
    for got, want in zip(run(impl), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- data -----------------------------------------------------------------------------------


def shards(n: int, world: int, bs: int, seed: int, shuffle: bool, epoch: int = 0):
    out = []
    for r in range(world):
        s = ShardSampler(n, r, world, bs, seed, shuffle)
        s.set_position(epoch, 0)
        out.append(s.indices())
    return out


def test_train_shards_are_disjoint_equal_and_cover_world_times_per_rank():
    n, world, bs = 103, 3, 4
    parts = shards(n, world, bs, seed=7, shuffle=True)
    per_rank = ShardSampler(n, 0, world, bs, 7, True).per_rank
    assert per_rank == 32  # 34 per rank, whole batches only
    assert [len(p) for p in parts] == [per_rank] * world
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == world * per_rank
    assert set(flat) <= set(range(n))
    for r in range(world):
        s = ShardSampler(n, r, world, bs, 7, True)
        assert len(s) == len(s.indices()) == per_rank
        assert s.batches_per_epoch() == 8


def test_shuffle_order_is_a_function_of_seed_and_epoch():
    a = shards(64, 2, 4, seed=3, shuffle=True, epoch=0)
    b = shards(64, 2, 4, seed=3, shuffle=True, epoch=0)
    assert a == b
    assert a != shards(64, 2, 4, seed=3, shuffle=True, epoch=1)
    assert a != shards(64, 2, 4, seed=4, shuffle=True, epoch=0)
    # A different epoch is a different permutation, not a different subset only.
    assert sorted(a[0] + a[1]) == sorted(range(64))
    e1 = shards(64, 2, 4, seed=3, shuffle=True, epoch=1)
    assert sorted(e1[0] + e1[1]) == sorted(range(64))


@pytest.mark.parametrize("k", [0, 1, 3, 7, 8])
def test_set_position_yields_exactly_the_tail_after_k_batches(k):
    n, world, bs = 70, 2, 4
    for rank in range(world):
        full = ShardSampler(n, rank, world, bs, seed=11, train=True)
        full.set_position(2, 0)
        order = full.indices()
        s = ShardSampler(n, rank, world, bs, seed=11, train=True)
        s.set_position(2, k * bs * world)  # samples the whole run consumed
        assert list(s) == order[k * bs :]
        assert len(s) == len(order) - k * bs


def int_loader(n: int, bs: int, seed: int = 5, rank: int = 0, world: int = 1, train=True):
    data = TensorSet(torch.arange(n), torch.arange(n) * 10)
    cfg = DataConfig(batch_size=bs, seed=seed, num_workers=0)
    return make_loader(data, cfg, rank, world, train=train, cuda=False)


def test_batches_cross_epoch_boundaries_and_track_the_position():
    batches = Batches(int_loader(40, 8), DataPosition())
    positions, epochs = [], {0: [], 1: []}
    for _ in range(10):
        x, y = batches.next()
        assert torch.equal(y, x * 10)  # TensorSet rows stay together
        assert x.shape == (8,)
        positions.append((batches.position.epoch, batches.position.samples))
        epochs[batches.position.epoch].extend(x.tolist())
    assert positions == [(0, 8 * b) for b in range(1, 6)] + [(1, 8 * b) for b in range(1, 6)]
    assert sorted(epochs[0]) == list(range(40))
    assert sorted(epochs[1]) == list(range(40))
    assert epochs[0] != epochs[1]
    assert batches.position.state_dict() == {"epoch": 1, "samples": 40}


def test_batches_do_not_touch_the_global_torch_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    batches = Batches(int_loader(40, 8), DataPosition())
    for _ in range(7):  # across an epoch boundary: two iterators created
        batches.next()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("cut", [0, 2, 6, 7, 13])
def test_resumed_batches_continue_exactly_like_the_uninterrupted_ones(cut):
    # rank 1 of 2, 50 samples, batches of 4: 6 batches per epoch per rank.
    def loader():
        return int_loader(50, 4, seed=9, rank=1, world=2)

    total = 20
    uninterrupted = Batches(loader(), DataPosition())
    reference = [uninterrupted.next()[0] for _ in range(total)]

    first = Batches(loader(), DataPosition())
    for _ in range(cut):
        first.next()
    saved = json.loads(json.dumps(first.position.state_dict()))  # as a checkpoint holds it
    torch.manual_seed(999)  # a resumed process's global RNG is not the original's
    random.seed(999)
    resumed = Batches(loader(), DataPosition(**saved))
    tail = [resumed.next()[0] for _ in range(total - cut)]
    assert len(tail) == len(reference[cut:])
    for got, want in zip(tail, reference[cut:], strict=True):
        assert torch.equal(got, want)
    assert resumed.position == uninterrupted.position


@pytest.mark.parametrize(("n", "world", "bs"), [(10, 3, 4), (10, 4, 2), (17, 2, 5), (2, 3, 4)])
def test_eval_covers_every_sample_exactly_once_across_ranks(n, world, bs):
    seen = []
    for rank in range(world):
        for x, _ in int_loader(n, bs, rank=rank, world=world, train=False):
            seen.extend(x.tolist())
    assert sorted(seen) == list(range(n))


def test_eval_sampler_len_matches_what_it_yields():
    for rank in range(3):
        s = ShardSampler(10, rank, 3, 4, seed=0, train=False)
        assert len(s) == len(list(s))


def test_too_few_samples_for_one_batch_names_data_batch_size():
    with pytest.raises(Refused, match=r"^data\.batch_size: .*got 8") as refused:
        int_loader(10, 8, rank=0, world=2)
    assert refused.value.key == "data.batch_size"  # the ranks' refusal: state refused, exit 2
    # One full batch per rank is enough.
    assert len(list(int_loader(16, 8, rank=1, world=2))) == 1
    # Eval never drops samples, so it does not need a full batch.
    assert [x.tolist() for x, _ in int_loader(3, 8, rank=0, world=1, train=False)] == [[0, 1, 2]]


# -- checkpoints ------------------------------------------------------------------------------


@pytest.fixture
def gloo_group(tmp_path: Path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def small_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": seed,
        "data": {"epoch": 1, "batch": seed},
    }


def save(run_dir: Path, step: int, keep_last: int = 2, reason: str = "interval", state=None):
    """The outcome every rank gets: ``{"ok": True, "event": ...}`` or ``{"ok": False, ...}``."""
    return checkpoint.save(
        run_dir,
        step,
        reason,
        state if state is not None else small_state(step),
        {"rng": checkpoint.capture_rng(torch.device("cpu"))},
        keep_last,
        is_main=True,
    )


def ckpt_listing(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_save_keeps_the_last_n_and_latest_names_the_newest(gloo_group, tmp_path):
    run = tmp_path / "run"
    infos = [save(run, s) for s in (10, 20, 30)]
    assert ckpt_listing(run) == ["LATEST", "step-00000020", "step-00000030"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000030"
    assert checkpoint.find_latest(run) == run / "checkpoints" / "step-00000030"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert all(i["ok"] for i in infos)
    info = infos[-1]["event"]
    assert info["step"] == 30 and info["reason"] == "interval"
    assert info["path"] == str(run / "checkpoints" / "step-00000030")
    assert info["bytes"] == (run / "checkpoints" / "step-00000030" / "state.pt").stat().st_size
    meta = json.loads((run / "checkpoints" / "step-00000030" / "meta.json").read_text())
    assert meta["step"] == 30 and meta["world_size"] == 1 and meta["reason"] == "interval"


def test_load_gives_back_the_state_with_equal_tensors(gloo_group, tmp_path):
    run = tmp_path / "run"
    state = small_state(7)
    save(run, 7, state=state)
    loaded = checkpoint.load(checkpoint.find_latest(run))
    assert loaded["step"] == 7 and loaded["data"] == {"epoch": 1, "batch": 7}
    assert loaded["model"].keys() == state["model"].keys()
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    # The optimizer state loads into a fresh optimizer.
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(loaded["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(loaded["optimizer"])
    assert len(loaded["ranks"]) == 1 and "rng" in loaded["ranks"][0]


def tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def test_resume_maps_the_file_and_keeps_nothing_of_it(gloo_group, tmp_path, monkeypatch):
    run = tmp_path / "run"
    saved = small_state(7)
    before = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)]), lambda s: 1.0)
    before.last_epoch = 7
    save(run, 7, state={**saved, "scheduler": before.state_dict()})
    real_load = checkpoint.torch.load
    loaded: list[weakref.ref] = []

    def watched_load(*args, **kwargs):
        assert kwargs["mmap"] is True and kwargs["weights_only"] is True
        state = real_load(*args, **kwargs)
        loaded.extend(weakref.ref(t) for t in tensors_in(state))
        return state

    monkeypatch.setattr(checkpoint.torch, "load", watched_load)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    back = checkpoint.resume(
        checkpoint.find_latest(run), model, Optimizers.single(opt, sched), None, 0, 1
    )

    assert (back.step, back.data, back.ranks) == (7, {"epoch": 1, "batch": 7}, 1)
    assert back.rng is not None and sched.last_epoch == 7
    for k, v in saved["model"].items():
        assert torch.equal(model.state_dict()[k], v)
    moments, expected = tensors_in(opt.state_dict()["state"]), tensors_in(saved["optimizer"])
    assert len(moments) == len(expected) == 6  # step, exp_avg, exp_avg_sq of weight and bias
    assert all(torch.equal(a, b) for a, b in zip(moments, expected, strict=True))
    # Not one tensor of the loaded checkpoint outlives the call: the model copied its
    # weights, the optimizer holds copies of its state (on a CPU it would keep the mapped
    # tensors themselves), and the dict was dropped.
    del back
    gc.collect()
    assert len(loaded) > 5
    assert [r for r in loaded if r() is not None] == []


class NotATensor:
    pass


def test_load_uses_weights_only(gloo_group, tmp_path):
    run = tmp_path / "run"
    save(run, 1, state={"model": {}, "evil": NotATensor()})
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load(checkpoint.find_latest(run))


def test_rng_round_trips_through_a_checkpoint(gloo_group, tmp_path):
    cpu = torch.device("cpu")
    random.seed(41)
    torch.manual_seed(41)
    random.random(), torch.rand(1)  # somewhere mid-stream
    rank_state = {"rng": checkpoint.capture_rng(cpu)}
    expected_py = [random.random() for _ in range(5)]
    expected_torch = torch.rand(5)

    run = tmp_path / "run"
    checkpoint.save(run, 3, "end", {"model": {}}, rank_state, 2, is_main=True)
    random.seed(0)
    torch.manual_seed(0)
    loaded = checkpoint.load(checkpoint.find_latest(run))
    checkpoint.restore_rng(loaded["ranks"][0]["rng"], cpu)
    assert [random.random() for _ in range(5)] == expected_py
    assert torch.equal(torch.rand(5), expected_torch)


def test_rng_round_trips_in_memory():
    cpu = torch.device("cpu")
    state = checkpoint.capture_rng(cpu)
    a = (random.random(), torch.randn(3))
    random.seed(5)
    torch.manual_seed(5)
    checkpoint.restore_rng(state, cpu)
    b = (random.random(), torch.randn(3))
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])


def test_saving_the_same_step_twice_replaces_it(gloo_group, tmp_path):
    run = tmp_path / "run"
    save(run, 10, reason="interval", state={"model": {"w": torch.zeros(2)}})
    save(run, 10, reason="end", state={"model": {"w": torch.ones(2)}})
    assert ckpt_listing(run) == ["LATEST", "step-00000010"]
    path = checkpoint.find_latest(run)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["reason"] == "end"
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.ones(2))


def test_a_failed_save_leaves_the_previous_checkpoint_and_latest(gloo_group, tmp_path, monkeypatch):
    run = tmp_path / "run"
    save(run, 10)
    before = (run / "checkpoints" / "step-00000010" / "state.pt").read_bytes()

    real_save = torch.save

    def disk_full(obj, f, *a, **kw):
        # The checkpoint's file; gather_object pickles through torch.save too, into a buffer.
        if not isinstance(getattr(f, "name", None), str):
            return real_save(obj, f, *a, **kw)
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    # Not raised: every rank gets the outcome, the name LATEST still holds with it.
    assert save(run, 20) == {"ok": False, "error": "disk full", "latest": "step-00000010"}
    assert ckpt_listing(run) == ["LATEST", "step-00000010"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-00000010"
    assert (run / "checkpoints" / "step-00000010" / "state.pt").read_bytes() == before
    assert not list((run / "checkpoints").glob(".tmp-*"))
    monkeypatch.undo()
    assert checkpoint.load(checkpoint.find_latest(run))["step"] == 10


@pytest.mark.parametrize("fail_at", ["link", "rename"])
def test_a_failed_resave_of_the_same_step_keeps_a_complete_latest(
    gloo_group, tmp_path, monkeypatch, fail_at
):
    # Re-saving a step replaces the directory LATEST names: whatever step of that fails
    # (a kill, a full disk), LATEST must still name a complete, loadable checkpoint.
    run = tmp_path / "run"
    save(run, 10, state={"model": {"w": torch.zeros(2)}})
    real_rename, real_link = checkpoint.os.rename, checkpoint.os.link

    def failing_rename(src, dst):
        if fail_at == "rename" and Path(src).name.startswith(".link-"):
            raise OSError("killed here")
        return real_rename(src, dst)

    def failing_link(src, dst):
        if fail_at == "link" and Path(src).name == "meta.json":
            raise OSError("killed here")
        return real_link(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing_rename)
    monkeypatch.setattr(checkpoint.os, "link", failing_link)
    monkeypatch.setattr(checkpoint.shutil, "copy2", failing_link)  # the no-hard-link fallback
    outcome = save(run, 10, reason="end", state={"model": {"w": torch.ones(2)}})
    assert outcome["ok"] is False and outcome["error"] == "killed here"
    monkeypatch.undo()
    latest = checkpoint.find_latest(run)
    assert latest is not None
    assert torch.equal(checkpoint.load(latest)["model"]["w"], torch.ones(2))  # the new one
    # The next save cleans up, and LATEST moves on to a regular step directory.
    save(run, 20)
    assert ckpt_listing(run) == ["LATEST", "step-00000020"]


# -- supervisor -------------------------------------------------------------------------------


def write_error(run: Path, rank: int, message: str, ts: int, tb: str, attempt: int = 0) -> Path:
    d = run / "logs" / "default_abc" / f"attempt_{attempt}" / str(rank)
    d.mkdir(parents=True, exist_ok=True)
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": tb, "timestamp": str(ts)},
        }
    }
    path = d / "error.json"
    path.write_text(json.dumps(data))
    os.utime(path, (1_700_000_000 + ts, 1_700_000_000 + ts))  # written when it says it was
    return path


def test_failure_summary_picks_the_earliest_error_file(tmp_path):
    tb1 = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom'
    write_error(tmp_path, 0, "RuntimeError: later", 200, "Traceback ... later")
    write_error(tmp_path, 1, "RuntimeError: boom", 123, tb1)
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 1
    assert f["summary"] == "rank 1 failed: RuntimeError: boom"
    assert f["traceback"] == tb1
    assert f["exit_code"] == 1
    assert f["ranks"] == [0, 1]


def test_failure_summary_breaks_timestamp_ties_by_lowest_rank(tmp_path):
    write_error(tmp_path, 1, "RuntimeError: one", 123, "tb one")
    write_error(tmp_path, 0, "RuntimeError: zero", 123, "tb zero")
    (tmp_path / "logs" / "default_abc" / "attempt_0" / "2").mkdir()
    (tmp_path / "logs" / "default_abc" / "attempt_0" / "2" / "error.json").write_text("{torn")
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 0
    assert f["summary"] == "rank 0 failed: RuntimeError: zero"
    assert f["traceback"] == "tb zero"
    assert f["ranks"] == [0, 1]  # the unreadable file is skipped


def test_failure_summary_prefers_a_ranks_own_error_over_a_peers_broken_connection(tmp_path):
    # Rank 0 dies of its own error; rank 1 then sees the connection drop. Even if rank 1's
    # file is older, rank 0's error is the root cause.
    write_error(tmp_path, 1, "RuntimeError: Connection closed by peer [127.0.0.1]:1", 100, "t1")
    write_error(tmp_path, 0, "ValueError: bad batch", 101, "t0")
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 0
    assert f["summary"] == "rank 0 failed: ValueError: bad batch"
    assert f["ranks"] == [0, 1]


def test_failure_summary_accepts_a_plain_string_message(tmp_path):
    d = tmp_path / "logs" / "x" / "attempt_0" / "3"
    d.mkdir(parents=True)
    (d / "error.json").write_text(json.dumps({"message": "SystemExit: 3", "timestamp": "5"}))
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 3 and f["summary"] == "rank 3 failed: SystemExit: 3"
    assert f["traceback"] == ""


ROOT_CAUSE_LOG = """\
[default0]:step 3
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
gpu_console.engine FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_12:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 1234)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1234
============================================================
"""


def test_failure_summary_reads_torchruns_root_cause_without_error_files(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun.log").write_text(ROOT_CAUSE_LOG)
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 1
    assert f["exit_code"] == -9
    assert f["summary"] == "rank 1 exited with code -9 (killed by SIGKILL)"
    assert f["traceback"] == ""


def test_failure_summary_falls_back_to_torchruns_exit_code(tmp_path):
    f = supervisor.failure_summary(tmp_path, 7)
    assert f == {
        "source": "torchrun",
        "rank": None,
        "exit_code": 7,
        "summary": "torchrun exited with code 7",
        "traceback": "",
    }
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun.log").write_text("nothing useful\n")
    assert supervisor.failure_summary(tmp_path, 7)["summary"] == "torchrun exited with code 7"


def test_failure_summary_blames_the_killed_rank_not_its_shared_memory_peer(tmp_path):
    # CPU ranks summing through shared memory: rank 1 is SIGKILLed, rank 0 notices from its
    # pid and fails with an error file; torchrun's root cause is rank 1.
    waited = "RuntimeError: shared-memory all-reduce: rank 1 (pid 1234) ended while rank 0 waited"
    write_error(tmp_path, 0, waited + " for it", 100, "t0")
    (tmp_path / "logs" / "torchrun.log").write_text(ROOT_CAUSE_LOG)
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 1
    assert f["summary"] == "rank 1 exited with code -9 (killed by SIGKILL)"


def test_failure_summary_names_the_root_cause_when_several_ranks_failed(tmp_path):
    # The block exactly as torchelastic formats it: rank 1 SIGKILLed first, rank 0 later.
    later = ProcessFailure(local_rank=0, pid=111, exitcode=-15, error_file="/nonexistent")
    first = ProcessFailure(local_rank=1, pid=222, exitcode=-9, error_file="/nonexistent")
    first.timestamp, later.timestamp = 100, 200
    block = ChildFailedError("gpu_console.engine", {0: later, 1: first}).format_msg()
    assert "Root Cause" in block
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "torchrun.log").write_text(block + "\n")
    f = supervisor.failure_summary(tmp_path, 1)
    assert f["rank"] == 1
    assert f["summary"] == "rank 1 exited with code -9 (killed by SIGKILL)"


def test_is_engine_cmdline_matches_workers_not_torchrun():
    assert supervisor.is_engine_cmdline(
        ["/usr/bin/python3", "-u", "-m", "gpu_console.engine", "/r"]
    )
    assert supervisor.is_engine_cmdline(["python", "-m", "gpu_console.engine", "/r"])
    torchrun = [
        "/usr/bin/python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--module",
        "gpu_console.engine",
        "/r",
    ]
    assert not supervisor.is_engine_cmdline(torchrun)
    assert not supervisor.is_engine_cmdline(["python", "-m", "gpu_console.supervisor", "/r"])
    assert not supervisor.is_engine_cmdline(["python", "-m"])
    assert not supervisor.is_engine_cmdline([])


# -- headless -------------------------------------------------------------------------------


def state_of(name: str, **status) -> RunState:
    st = RunState()
    st.state = name
    st.apply_status({"ended": 1.0, "state": name, **status})
    return st


def test_exit_codes_follow_the_design():
    assert headless.exit_code(state_of("finished")) == 0
    assert headless.exit_code(state_of("stopped", checkpointed_on_stop=True)) == 0
    assert headless.exit_code(state_of("stopped", checkpointed_on_stop=False)) == 130
    assert headless.exit_code(state_of("stopped")) == 130
    assert headless.exit_code(state_of("failed")) == 1
    assert headless.exit_code(state_of("interrupted")) == 130
    assert headless.exit_code(state_of("killed")) == 137
    lost = RunState()
    lost.state = "lost"
    assert headless.exit_code(lost) == 1


def render(table) -> str:
    console = Console(record=True, width=100, color_system=None)
    console.print(table)
    return console.export_text()


def finished_state() -> RunState:
    st = RunState()
    events = [
        {"kind": "start", "t": 100.0, "world_size": 2, "device_type": "cpu"}
        | {"precision": "fp32", "task": "mlp", "params": 1234, "max_steps": 50},
        {"kind": "step", "t": 101.0, "step": 10, "loss": 2.5, "samples_per_s": 1000.0}
        | {"memory": [{"rank": 0, "peak": 3 * 1024**2}, {"rank": 1, "peak": 5 * 1024**2}]},
        {"kind": "step", "t": 102.0, "step": 50, "loss": 0.75, "samples_per_s": 3000.0}
        | {"memory": [{"rank": 0, "peak": 2 * 1024**2}, {"rank": 1, "peak": 6 * 1024**3}]},
        {"kind": "eval", "t": 103.0, "step": 50, "loss": 0.8125, "accuracy": 0.9375},
        {"kind": "checkpoint", "t": 104.0, "step": 50, "path": "/r/ck/step-00000050"}
        | {"reason": "end", "bytes": 10, "seconds": 0.1},
        {"kind": "status", "t": 105.0, "state": "finished", "reason": ""},
    ]
    for e in events:
        st.apply(e)
    st.apply_status({"state": "finished", "started": 100.0, "ended": 165.0})
    return st


def test_summary_table_of_a_finished_run(tmp_path):
    # The end checkpoint on disk (the summary names the one the disk has, as --resume takes
    # it): complete (its meta.json) and a whole torch file (a zip).
    ckpt = tmp_path / "quick-1" / "checkpoints" / "step-00000050"
    ckpt.mkdir(parents=True)
    torch.save({"step": 50}, ckpt / "state.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": 50, "reason": "end"}))
    (ckpt.parent / "LATEST").write_text(ckpt.name)
    text = render(summary.summary_table(finished_state(), tmp_path / "quick-1"))
    assert "quick-1: finished" in text
    lines = {line.strip() for line in text.splitlines()}

    def row(label: str) -> str:
        found = [ln for ln in lines if label in ln]
        assert found, f"no {label!r} row in\n{text}"
        return found[0]

    assert "50/50" in row("steps")
    assert "0.7500" in row("final loss")
    assert "0.7500" in row("best loss")
    assert "0.9375" in row("eval accuracy")
    assert "0.8125" in row("eval loss")
    assert "2,000 (mean)" in row("samples/s")
    assert "2 × cpu, fp32" in row("devices")
    assert "3.0 MiB" in row("peak memory rank 0")  # the peak, not the last sample
    assert "6.0 GiB" in row("peak memory rank 1")
    assert "1:05" in row("wall time")
    assert "step 50, end" in row("checkpoint")
    assert "failure" not in text


def test_summary_table_of_a_failed_run_shows_the_failure_and_traceback_tail(tmp_path):
    st = RunState()
    st.apply({"kind": "start", "t": 1.0, "world_size": 2, "max_steps": 100})
    st.apply({"kind": "step", "t": 2.0, "step": 7, "loss": 1.5})
    tb = "\n".join(
        ["Traceback (most recent call last):"]
        + [f'  File "frame{i}.py", line {i}, in f{i}' for i in range(8)]
        + ["RuntimeError: boom"]
    )
    st.apply_status(
        {
            "state": "failed",
            "reason": "rank 1 failed: RuntimeError: boom",
            "started": 1.0,
            "ended": 3.0,
            "failure": {"rank": 1, "summary": "rank 1 failed: RuntimeError: boom", "traceback": tb},
        }
    )
    text = render(summary.summary_table(st, tmp_path / "bad-run"))
    assert "bad-run: failed" in text
    assert "7/100" in text
    assert "rank 1 failed: RuntimeError: boom" in text
    assert "RuntimeError: boom" in text.split("traceback", 1)[1]
    assert 'frame7.py", line 7' in text
    assert 'frame3.py", line 3' in text  # the last six lines
    assert "frame2.py" not in text
    assert "Traceback (most recent call last)" not in text
    assert headless.exit_code(st) == 1


def test_human_bytes():
    assert headless.human_bytes(None) == "-"
    assert headless.human_bytes(0) == "0 B"
    assert headless.human_bytes(1023) == "1023 B"
    assert headless.human_bytes(1024) == "1.0 KiB"
    assert headless.human_bytes(1536) == "1.5 KiB"
    assert headless.human_bytes(5 * 1024**2) == "5.0 MiB"
    assert headless.human_bytes(3 * 1024**3 + 512 * 1024**2) == "3.5 GiB"
    assert headless.human_bytes(2 * 1024**4) == "2.0 TiB"
    assert headless.human_bytes(4096 * 1024**4) == "4096.0 TiB"


def test_human_duration():
    assert headless.human_duration(None) == "-"
    assert headless.human_duration(0) == "0:00"
    assert headless.human_duration(59.4) == "0:59"
    assert headless.human_duration(59.6) == "1:00"
    assert headless.human_duration(65) == "1:05"
    assert headless.human_duration(3600) == "1:00:00"
    assert headless.human_duration(3 * 3600 + 2 * 60 + 1) == "3:02:01"


# -- the task's close() -----------------------------------------------------------------------


class ClosesBadly:
    def close(self):
        raise ValueError("writer already closed")


def test_a_task_close_that_raises_is_a_warning_not_the_runs_outcome(tmp_path, capsys):
    from gpu_console.engine.loop import close_task
    from gpu_console.engine.reporter import Reporter

    out = Reporter(tmp_path, True)
    close_task(ClosesBadly(), out, 1)  # does not raise
    close_task(object(), out, 1)  # a task without close() is fine
    out.close()
    (log,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (log["kind"], log["level"]) == ("log", "warning")
    assert log["message"] == (
        "the task's close() failed on rank 1: ValueError: writer already closed"
    )
    assert "Traceback" in capsys.readouterr().err
