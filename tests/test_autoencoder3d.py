"""The built-in ``autoencoder3d`` (issue 22): a denoising 3D conv autoencoder on synthetic
volumes. Its pieces alone, then the profile on 2 CPU ranks (the harness, tests/harness.py):
the loss falls, each eval writes its labelled slice PNG, ``export`` gives weights its model
class loads with plain torch; through real torchrun, a Ctrl-C and a resume continue bit for bit."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from conftest import events_of
from harness import cut_and_resumed, run_engine
from torch.utils.flop_counter import FlopCounterMode

from gpu_console.profile import ProfileError, load_profile
from gpu_console.tasks.autoencoder3d import (
    Autoencoder3D,
    Autoencoder3DTask,
    fullest_slice,
    make_volumes,
    psnr,
)
from gpu_console.tasks.slice_image import MIN_SIDE, compose, text, write_png


def read_png(path) -> torch.Tensor:
    """An 8-bit grayscale, non-interlaced PNG of filter-0 rows (what write_png writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        (n,) = struct.unpack(">I", data[at : at + 4])
        tag, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        assert struct.unpack(">I", data[at + 8 + n : at + 12 + n])[0] == zlib.crc32(tag + body)
        chunks[tag] = body
        at += 12 + n
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 0) and b"IEND" in chunks
    rows = torch.frombuffer(bytearray(zlib.decompress(chunks[b"IDAT"])), dtype=torch.uint8)
    rows = rows.view(height, width + 1)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:]


def test_volumes_are_clean_in_the_unit_range_and_the_same_for_a_seed():
    cfg = load_profile("autoencoder3d").task
    noisy, clean = make_volumes(cfg, 32, torch.Generator().manual_seed(7))
    assert noisy.shape == clean.shape == (32, 1, 16, 16, 16)
    assert clean.min() == 0 and 0.3 <= clean.max() <= 1.0
    assert (clean.flatten(1) > 0).any(1).all(), "every volume holds an ellipsoid"
    noise = (noisy - clean).std().item()
    assert noise == pytest.approx(cfg.noise, rel=0.05)
    again = make_volumes(cfg, 32, torch.Generator().manual_seed(7))
    assert torch.equal(again[0], noisy) and torch.equal(again[1], clean)
    # Leaving the input as it is scores 20 dB at noise 0.1: what a denoiser must beat.
    assert psnr(noisy, clean).mean().item() == pytest.approx(20.0, abs=0.5)


def test_the_model_keeps_the_shape_and_its_flops_are_the_counters():
    task = Autoencoder3DTask(load_profile("autoencoder3d").task)
    model = task.build_model()
    x = torch.randn(2, 1, 16, 16, 16)
    assert model(x).shape == x.shape
    with FlopCounterMode(display=False) as counter:
        model(x[:1]).sum().backward()
    assert task.flops_per_sample() == pytest.approx(counter.get_total_flops(), rel=0.02)


def _contains(image: torch.Tensor, block: torch.Tensor) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(image.numpy(), tuple(block.shape))
    return bool((windows == block.numpy()).all(axis=(-2, -1)).any())


def test_the_png_holds_labelled_panels_large_enough_to_read_with_their_ranges(tmp_path):
    ramp = torch.linspace(0, 1, 16).repeat(16, 1)
    panels = [("input", ramp, 0.0, 1.0), ("difference", ramp * 2 - 1, -1.0, 1.0)]
    image, boxes = compose("step 7", panels)
    for label, values, lo, hi in panels:
        top, left, h, w = boxes[label]
        assert h == w >= MIN_SIDE  # each voxel a block of pixels
        scale = h // 16
        expected = ((values - lo) / (hi - lo)).repeat_interleave(scale, 0)
        expected = (expected.repeat_interleave(scale, 1) * 255).round().to(torch.uint8)
        assert torch.equal(image[top : top + h, left : left + w], expected)
        name = text(label)  # named right above its panel
        above = image[top - 4 - name.shape[0] : top - 4, left : left + name.shape[1]]
        assert torch.equal(above, name)
        below = image[top + h :]  # the grey bar's two ends, written
        assert _contains(below, text(f"{lo:.3g}")) and _contains(below, text(f"{hi:.3g}"))
    assert _contains(image[:40], text("step 7"))
    write_png(tmp_path / "s.png", image)
    assert torch.equal(read_png(tmp_path / "s.png"), image)
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"], "no temporary file left"


def test_the_slice_shown_is_the_fullest_where_the_middle_one_is_often_empty():
    cfg = load_profile("autoencoder3d").task
    _, clean = make_volumes(cfg, 200, torch.Generator().manual_seed(3))
    sums = clean[:, 0].flatten(2).sum(2)  # (volume, slice)
    middle_empty = (sums[:, cfg.size // 2] == 0).float().mean().item()
    assert middle_empty > 0.05  # the fixed middle slice showed nothing that often
    for v in range(200):
        z = fullest_slice(clean[v, 0])
        assert sums[v, z] == sums[v].max() > 0
    task = Autoencoder3DTask(cfg)
    task.build_datasets()
    g = torch.Generator().manual_seed(cfg.data_seed)
    make_volumes(cfg, cfg.train_samples, g)
    _, held_out = make_volumes(cfg, cfg.eval_samples, g)
    assert task.slice == fullest_slice(held_out[0, 0])


def test_a_size_that_is_not_a_multiple_of_4_is_refused_in_one_line():
    with pytest.raises(ProfileError) as info:
        load_profile("autoencoder3d", ["task.size=18"])
    assert "--set: task.size: must be a multiple of 4 (got 18)" in str(info.value)


SHORT = ["train.max_steps=40", "train.eval_every=20", "task.eval_samples=32",
         "train.log_every=1"]  # fmt: skip


def test_the_profile_trains_writes_slices_resumes_exactly_and_exports(procs, tmp_path):
    whole_dir = tmp_path / "whole"
    run = run_engine(tmp_path, "autoencoder3d", *SHORT, ranks=2, runs_dir=whole_dir)
    losses = [e["loss"] for e in events_of(run, "step")]
    assert len(losses) == 40 and max(losses[-5:]) < 0.5 * losses[0], losses
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [20, 40]
    assert all(e["psnr"] > 10 for e in evals), evals
    for step in (20, 40):
        image = read_png(run / "task" / f"slice-step-{step:08d}.png")
        assert min(image.shape) > MIN_SIDE and image.float().std() > 0

    # Stopped at step 20, then --resume: the same losses from there on.
    stop = 20  # an eval's step
    cut = cut_and_resumed(tmp_path, "autoencoder3d", *SHORT, cut_at=stop)
    after = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > stop}
    assert after == {i + 1: loss for i, loss in enumerate(losses) if i + 1 > stop}

    out = tmp_path / "weights.pt"
    exported = procs.cli("export", str(run), "--out", str(out), "--runs-dir", str(whole_dir))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    model = Autoencoder3D(load_profile("autoencoder3d").task)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain torch, nothing else


def test_the_slice_is_written_under_fp64_too(tmp_path):
    from types import SimpleNamespace

    task = Autoencoder3DTask(load_profile("autoencoder3d", ["task.eval_samples=4"]).task)
    model = task.build_model().double()  # what train.precision = "fp64" makes of it
    task.build_datasets()
    ctx = SimpleNamespace(device=torch.device("cpu"), rank=0, step=7, task_dir=tmp_path)
    task.on_eval_end(model, {"loss": 0.1}, ctx)
    image = read_png(tmp_path / "slice-step-00000007.png")
    labels = ["input (noisy)", "reconstruction", "clean (target)", "recon - clean"]
    assert all(_contains(image[:80], text(label)) for label in labels)
    title = f"step 7: eval volume 0, slice {task.slice + 1} of 16 (the fullest)"
    assert _contains(image[:40], text(title))
    assert model.training, "left in train mode, as the hook found it"


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_activation_checkpointing_keeps_losses_gradients_and_running_statistics(mode):
    """The blocks recomputed in the backward: the same loss, the same gradients, bit for bit,
    and BatchNorm's running statistics updated once, as without (the recomputation is a
    second forward through each BatchNorm)."""
    from gpu_console.engine import activation_checkpoint

    task = Autoencoder3DTask(load_profile("autoencoder3d").task)
    noisy, clean = make_volumes(task.cfg, 4, torch.Generator().manual_seed(5))
    models = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = task.build_model()
        if checkpointed:
            assert activation_checkpoint.apply(task, model, mode) == 4
        for _ in range(2):  # a second step reads the first one's statistics in eval below
            model.zero_grad()
            loss = task.compute(model, (noisy, clean)).loss
            loss.backward()
        models.append((model, loss))
    (plain, plain_loss), (ckpt, ckpt_loss) = models
    assert torch.equal(plain_loss, ckpt_loss)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(plain.named_buffers(), ckpt.buffers(), strict=True):
        assert torch.equal(b, c), name
    assert plain.state_dict().keys() == ckpt.state_dict().keys()


def test_a_checkpointed_run_trains_and_evaluates_as_one_without(tmp_path):
    sets = ["train.max_steps=6", "train.eval_every=3", "task.eval_samples=8",
            "task.train_samples=64", "train.log_every=1", "task.slice_png=false"]  # fmt: skip
    runs = {
        mode: run_engine(
            tmp_path,
            "autoencoder3d",
            *sets,
            f"train.activation_checkpointing={mode!r}",
            ranks=2,
            name=mode,
        )  # fmt: skip
        for mode in ("none", "blocks")
    }
    losses = {m: [e["loss"] for e in events_of(r, "step")] for m, r in runs.items()}
    assert len(losses["none"]) == 6 and losses["blocks"] == losses["none"]
    evals = {m: [(e["loss"], e["psnr"]) for e in events_of(r, "eval")] for m, r in runs.items()}
    assert len(evals["none"]) == 2 and evals["blocks"] == evals["none"]
    held = events_of(runs["blocks"], "start")[0]["activation_checkpointing"]
    assert held["blocks"] == 4 and held["held_with"] < held["held_without"], held


def test_compiled_checkpointed_blocks_keep_the_running_statistics_too():
    """Under torch.compile (aot_eager: the graph capture and partitioner, eager kernels) the
    engine's recomputation context stays out (compile refuses a context_fn that is not
    selective checkpointing's), and the statistics still come out as without."""
    from gpu_console.engine import activation_checkpoint

    sets = ["task.size=8", "task.channels=2", "task.latent_channels=2"]
    task = Autoencoder3DTask(load_profile("autoencoder3d", sets).task)
    noisy, clean = make_volumes(task.cfg, 2, torch.Generator().manual_seed(5))
    got = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = task.build_model()
        run = model
        if compiled:
            activation_checkpoint.apply(task, model, "blocks")
            run = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            model.zero_grad()
            loss = task.compute(run, (noisy, clean)).loss
            loss.backward()
        got.append((loss.detach(), [p.grad for p in model.parameters()], list(model.buffers())))
    (loss, grads, buffers), (c_loss, c_grads, c_buffers) = got
    assert torch.allclose(loss, c_loss, rtol=1e-6)
    assert all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, c_grads, strict=True)
    )
    assert all(
        torch.allclose(a.float(), b.float()) for a, b in zip(buffers, c_buffers, strict=True)
    )
