"""autoencoder3d on real volumes (issue 40): ``task.data_dir``, a directory of ``.npy`` files (or
NIfTI through nibabel) written here. The directory judged from the files' headers and split
(volume_files.py); the profile trained on 2 CPU ranks in the harness (the loss falls, eval runs
on the held-out volumes, a cut and resumed run equals the whole one, flips included); every
directory a rank could not train on refused through the real CLI before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import events_of, write_profile
from conftest import test_env as cli_env
from harness import cut_and_resumed, run_engine
from test_bad_input import assert_bad, run_bad

from gpu_console.profile import load_profile
from gpu_console.schema import KeyProblem
from gpu_console.tasks import volume_files
from gpu_console.tasks.autoencoder3d import (
    Autoencoder3DTask,
    make_volumes,
    normalized,
    read_volume,
)


def write_volumes(folder: Path, n: int, *, seed: int = 0, channels: int = 0) -> list[np.ndarray]:
    """``n`` synthetic ellipsoid volumes (16³) as uint16 in 0..1000 (minmax brings them back
    to [0, 1]); ``channels``: a channel-first (C, 16, 16, 16) array each, else 3-D."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = load_profile("autoencoder3d").task
    _, clean = make_volumes(cfg, n * max(1, channels), torch.Generator().manual_seed(seed))
    arrays = []
    for i in range(n):
        volume = (clean[i * max(1, channels) : (i + 1) * max(1, channels), 0] * 1000).numpy()
        array = volume.astype(np.uint16) if channels else volume[0].astype(np.uint16)
        np.save(folder / f"vol-{i:03d}.npy", array)
        arrays.append(array)
    return arrays


PROFILE = """
[profile]
name = "volumes"
[task]
kind = "autoencoder3d"
data_dir = "vols"
channels = 4
latent_channels = 8
eval_fraction = 0.1
slice_png = false
[data]
batch_size = 4
[train]
max_steps = 24
lr = 3e-3
warmup_steps = 2
eval_every = 12
log_every = 1
precision = "fp32"
[checkpoint]
every_steps = 12
[hardware]
devices = "cpu:2"
"""


@pytest.mark.quick  # the loop between edits (tests/README.md): the units, in seconds
def test_the_directory_is_judged_and_split_by_one_rule(tmp_path, monkeypatch):
    write_volumes(tmp_path / "vols", 20)
    found = volume_files.scan("vols", 0.1, 1234, cwd=str(tmp_path))
    assert found.shape == (1, 16, 16, 16)
    assert len(found.held_out) == 2 and len(found.train) == 18
    assert set(found.held_out).isdisjoint(found.train)
    assert sorted(found.train + found.held_out) == list(found.files)
    # The same split from another directory (another place, files listed in another order):
    # it is a function of the names and the seed.
    other = tmp_path / "elsewhere"
    other.mkdir()
    for p in reversed(found.files):
        os.link(p, other / p.name)
    again = volume_files.scan(str(other), 0.1, 1234)
    assert [p.name for p in again.held_out] == [p.name for p in found.held_out]
    assert volume_files.scan("vols", 0.1, 7, cwd=str(tmp_path)).held_out != found.held_out
    assert volume_files.scan("vols", 0.0, 1234, cwd=str(tmp_path)).held_out == ()
    assert len(volume_files.scan("vols", 0.01, 1234, cwd=str(tmp_path)).held_out) == 1
    # The count the console judges data.batch_size with is the training set the ranks build.
    cfg = load_profile("autoencoder3d", ["task.data_dir='vols'"]).task
    assert cfg.train_size(str(tmp_path)) == 18
    monkeypatch.chdir(tmp_path)
    train, held = Autoencoder3DTask(cfg).build_datasets()
    assert (len(train), len(held)) == (18, 2)


@pytest.mark.quick
def test_volumes_are_normalised_noised_and_flipped_as_the_keys_say(tmp_path, monkeypatch):
    arrays = write_volumes(tmp_path / "vols", 6, channels=2)
    monkeypatch.chdir(tmp_path)
    sets = ["task.data_dir='vols'", "task.eval_fraction=0.2", "task.noise=0.1"]
    task = Autoencoder3DTask(load_profile("autoencoder3d", sets).task)
    train, held = task.build_datasets()
    assert task.build_model()(torch.zeros(1, 2, 16, 16, 16)).shape == (1, 2, 16, 16, 16)
    noisy, clean = held.__getitems__([0])
    assert clean.shape == (1, 2, 16, 16, 16)
    source = torch.from_numpy(arrays[int(held.files[0].stem[-3:])].astype(np.float32))
    assert torch.allclose(clean[0], normalized(source, "minmax"))
    assert clean.amin() == 0 and clean.flatten(2).amax(2).eq(1).all()  # per channel
    assert (noisy - clean).std().item() == pytest.approx(0.1, rel=0.1)
    assert torch.equal(held.__getitems__([0])[0], noisy), "an eval volume's noise is fixed"
    first = train.__getitems__([0, 1])[0]
    assert not torch.equal(train.__getitems__([0, 1])[0], first), "training noise is drawn"

    z = normalized(source, "zscore").flatten(1)
    assert torch.allclose(z.mean(1), torch.zeros(2), atol=1e-5)
    assert torch.allclose(z.std(1, unbiased=False), torch.ones(2), atol=1e-4)
    assert normalized(torch.full((1, 4, 4, 4), 5.0), "minmax").eq(0).all()

    flips = Autoencoder3DTask(load_profile("autoencoder3d", [*sets, "task.flip=true"]).task)
    train, _ = flips.build_datasets()
    seen = set()
    torch.manual_seed(0)
    for _ in range(20):
        noisy, clean = train.__getitems__([0])
        plain = train.clean(0)
        for dims in ([], [1], [2], [3], [1, 2], [1, 3], [2, 3], [1, 2, 3]):
            if torch.equal(clean[0], plain.flip(dims) if dims else plain):
                seen.add(tuple(dims))
                break
        else:
            raise AssertionError("a training volume that is no flip of its file")
        assert (noisy - clean).abs().max() < 1, "input and target flipped alike"
    assert len(seen) >= 4, seen

    # The synthetic volumes flip alike (off by default: their data set is unchanged).
    synthetic = ["task.train_samples=4", "task.eval_samples=0"]
    assert type(Autoencoder3DTask(load_profile("autoencoder3d", synthetic).task)
                .build_datasets()[0]).__name__ == "TensorSet"  # fmt: skip
    task = Autoencoder3DTask(load_profile("autoencoder3d", [*synthetic, "task.flip=true"]).task)
    train, _ = task.build_datasets()
    plain = train.tensors[1][0]
    got = {
        tuple(dims)
        for _ in range(20)
        for clean in [train.__getitems__([0])[1][0]]
        for dims in ([], [1], [2], [3], [1, 2], [1, 3], [2, 3], [1, 2, 3])
        if torch.equal(clean, plain.flip(dims) if dims else plain)
    }
    assert len(got) >= 4, got


def test_a_directory_of_volumes_trains_evaluates_held_out_and_resumes_exactly(tmp_path):
    write_volumes(tmp_path / "vols", 20)
    profile = write_profile(tmp_path / "volumes.toml", PROFILE)
    sets = ["task.flip=true"]  # the augmentation's draws are resumed too
    run = run_engine(tmp_path, profile, *sets, "task.slice_png=true", ranks=2,
                     runs_dir=tmp_path / "whole")  # fmt: skip
    steps = events_of(run, "step")
    losses = [e["loss"] for e in steps]
    assert len(losses) == 24 and max(losses[-4:]) < 0.5 * losses[0], losses
    # 18 training volumes over 2 ranks of 4: two steps an epoch, the third volume pair dropped.
    assert steps[-1]["epoch"] == 11
    evals = events_of(run, "eval")
    assert [e["step"] for e in evals] == [12, 24]
    assert evals[-1]["psnr"] > evals[0]["psnr"] > 10, evals
    assert sorted(p.name for p in (run / "task").iterdir()) == [
        "slice-step-00000012.png", "slice-step-00000024.png"
    ]  # fmt: skip

    cut = cut_and_resumed(tmp_path, profile, *sets, cut_at=12)
    after = {e["step"]: e["loss"] for e in events_of(cut, "step") if e["step"] > 12}
    assert after == {i + 1: loss for i, loss in enumerate(losses) if i + 1 > 12}
    assert events_of(cut, "eval")[-1]["psnr"] == evals[-1]["psnr"]


def test_nifti_volumes_read_as_their_npy_twins(tmp_path, monkeypatch):
    nibabel = pytest.importorskip("nibabel", reason="the volumes extra (nibabel) is not installed")
    arrays = write_volumes(tmp_path / "npy", 5, channels=2)
    (tmp_path / "nii").mkdir()
    for i, a in enumerate(arrays):
        image = nibabel.Nifti1Image(np.moveaxis(a, 0, -1), affine=np.eye(4))  # channel last
        nibabel.save(image, tmp_path / "nii" / f"vol-{i:03d}{'.nii.gz' if i % 2 else '.nii'}")
    monkeypatch.chdir(tmp_path)
    cfg = load_profile("autoencoder3d", ["task.data_dir='nii'"]).task
    found = cfg.volumes()
    assert found is not None and found.shape == (2, 16, 16, 16) and len(found.files) == 5
    for path in found.files:
        twin = arrays[int(path.name[4:7])].astype(np.float32)
        assert torch.equal(read_volume(path), torch.from_numpy(twin))
    profile = write_profile(tmp_path / "volumes.toml", PROFILE.replace('"vols"', '"nii"'))
    sets = ["train.max_steps=4", "train.eval_every=4", "task.eval_fraction=0.2"]
    run = run_engine(tmp_path, profile, *sets, ranks=1)
    assert len(events_of(run, "step")) == 4 and events_of(run, "eval")[0]["psnr"] > 0


# -- a directory a rank could not train on: exit 2, one line naming the file and key -----------


def _bad_dir(tmp_path: Path, case: str) -> tuple[str, str]:
    """(task.data_dir, what the refusal says of it) for ``case``."""
    vols = tmp_path / "vols"
    if case == "missing":
        return "vols", f"no such directory: {vols}"
    if case == "a-file":
        vols.write_text("not a directory")
        return "vols", f"not a directory: {vols}"
    vols.mkdir()
    (vols / "notes.txt").write_text("not a volume")  # other files are ignored
    if case == "empty":
        return "vols", f"no .npy, .nii or .nii.gz files in {vols}"
    write_volumes(vols, 3)
    if case == "2-d":
        np.save(vols / "flat.npy", np.zeros((16, 16), np.float32))
        return "vols", "flat.npy has shape (16, 16); accepted: " + volume_files.ACCEPTED
    if case == "odd-side":
        np.save(vols / "odd.npy", np.zeros((16, 16, 18), np.float32))
        return "vols", (
            "odd.npy has shape (16, 16, 18): each spatial side must be a multiple of 4 (4-D "
            ".npy is channel-first, (C, D, H, W))"
        )
    if case == "dtype":
        np.save(vols / "text.npy", np.full((16, 16, 16), "a"))
        return "vols", "text.npy holds <U1 values; a volume holds numbers"
    if case == "shapes":
        np.save(vols / "zbig.npy", np.zeros((32, 32, 32), np.float32))
        return "vols", (
            "volumes of different shapes: vol-000.npy is (1, 16, 16, 16), zbig.npy is "
            "(1, 32, 32, 32) (C, D, H, W)"
        )
    if case == "truncated":
        (vols / "cut.npy").write_bytes((vols / "vol-000.npy").read_bytes()[:20])
        return "vols", "cannot read cut.npy as a volume: "
    raise AssertionError(case)


BAD_CASES = ["missing", "a-file", "empty", "2-d", "odd-side", "dtype", "shapes", "truncated"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_a_directory_a_rank_could_not_train_on_is_refused_before_anything_is_written(
    procs, runs_dir, tmp_path, case
):
    data_dir, says = _bad_dir(tmp_path, case)
    profile = write_profile(tmp_path / "volumes.toml", PROFILE)
    result = run_bad(procs, runs_dir, str(profile), cwd=tmp_path)
    (line,) = assert_bad(result, runs_dir)
    assert line.startswith(f"gpu-console: {profile}: task.data_dir: {says}"), line
    assert line.endswith(f"(got {data_dir!r})"), line


def test_too_few_volumes_for_the_held_out_share_is_refused(procs, runs_dir, tmp_path):
    write_volumes(tmp_path / "vols", 1)
    profile = write_profile(tmp_path / "volumes.toml", PROFILE)
    (line,) = assert_bad(run_bad(procs, runs_dir, str(profile), cwd=tmp_path), runs_dir)
    assert line == (
        f"gpu-console: {profile}: task.eval_fraction: 1 volume(s) in {tmp_path / 'vols'}: "
        "holding out 1 for eval leaves none to train on (0: no eval) (got 0.1)"
    )


def test_nifti_without_nibabel_is_one_line(procs, runs_dir, tmp_path):
    """nibabel hidden from the console's process (a sitecustomize that blocks the import)."""
    (tmp_path / "vols").mkdir()
    (tmp_path / "vols" / "brain.nii.gz").write_bytes(b"\x1f\x8b not read")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['nibabel'] = None\n")
    profile = write_profile(tmp_path / "volumes.toml", PROFILE)
    env = cli_env(PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]))
    result = procs.cli("run", str(profile), "--headless", "--runs-dir", str(runs_dir),
                       cwd=tmp_path, env=env)  # fmt: skip
    (line,) = assert_bad(result, runs_dir)
    assert line == (
        f"gpu-console: {profile}: task.data_dir: brain.nii.gz: NIfTI files need nibabel: "
        "pip install \"gpu-console[volumes]\" (got 'vols')"
    )


def test_a_data_dir_judged_in_the_launch_directory(tmp_path):
    with pytest.raises(KeyProblem) as info:
        volume_files.scan("vols", 0.1, 1, cwd=str(tmp_path))
    assert info.value.key == "task.data_dir"
    assert json.dumps(str(tmp_path / "vols")).strip('"') in info.value.why
