"""``autoencoder3d``'s ``task.data_dir``: a directory of volume files, judged and split without
torch (as text_data.py is for the text tasks).

The console reads every file's header (never its voxels) before launch and refuses, in one
line naming ``task.data_dir``, what the ranks could not train on: a missing or empty
directory, a file it cannot read, a shape or dtype the model cannot take, volumes of
different shapes. The ranks list and split the files with the same functions, so the
training set the launch counted is the one they build.

Accepted files (other files and subdirectories are ignored):

- ``.npy``: a 3-D array ``(D, H, W)``, one channel, or a 4-D one ``(C, D, H, W)``, channel
  first (PyTorch's layout);
- ``.nii`` / ``.nii.gz`` (NIfTI, through nibabel: ``pip install "gpu-console[volumes]"``): a
  3-D image ``(X, Y, Z)`` or a 4-D one ``(X, Y, Z, C)``, channel last (NIfTI's layout).

Every spatial side a multiple of 4 (the model halves the resolution twice), numbers only
(bool, integer or floating point dtypes), every file the same shape.

The held-out split: the file names (within the directory) ordered by a hash of
(``task.data_seed``, name); the first ``max(1, round(n × task.eval_fraction))`` are held out
for eval, the rest train (none held out with ``eval_fraction = 0``). It does not depend on the
ranks, on where the directory lives or on the order the file system lists it in.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..schema import KeyProblem

NIFTI = (".nii", ".nii.gz")
SUFFIXES = (".npy", *NIFTI)
NUMBERS = "buif"  # numpy dtype kinds a volume may hold: bool, unsigned, signed, float
NIBABEL = 'NIfTI files need nibabel: pip install "gpu-console[volumes]"'


def data_path(data_dir: str, cwd: str | None = None) -> Path:
    """Where ``task.data_dir`` points for a rank, which runs in the run's launch directory
    (``cwd``; None: this process's own)."""
    path = Path(data_dir).expanduser()
    return path if path.is_absolute() or cwd is None else Path(cwd) / path


def is_nifti(path: Path) -> bool:
    return path.name.endswith(NIFTI)


def volume_files(folder: Path) -> list[Path]:
    """The volume files directly in ``folder``, sorted by name (hidden files left out)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.name.endswith(SUFFIXES) and not p.name.startswith(".") and p.is_file()
    )


def header(path: Path) -> tuple[tuple[int, ...], Any]:
    """(shape, numpy dtype) of a volume file, read from its header alone."""
    import numpy as np

    if is_nifti(path):
        import nibabel

        image: Any = nibabel.load(path)  # a NIfTI image (load's type names their base class)
        return tuple(int(n) for n in image.shape), np.dtype(image.get_data_dtype())
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    return tuple(int(n) for n in shape), np.dtype(dtype)


def model_shape(shape: tuple[int, ...], nifti: bool) -> tuple[int, ...] | None:
    """(C, D, H, W) as the model reads a file of ``shape``, or None for a rank it cannot."""
    if len(shape) == 3:
        return (1, *shape)
    if len(shape) == 4:
        return (shape[3], *shape[:3]) if nifti else shape
    return None


ACCEPTED = (
    "(D, H, W) or channel-first (C, D, H, W) for .npy, (X, Y, Z) or channel-last "
    "(X, Y, Z, C) for NIfTI"
)


@dataclass(frozen=True)
class Volumes:
    """A judged ``task.data_dir``: its files (sorted by name), the shape every one has as the
    model reads it, (C, D, H, W), and the split."""

    folder: Path
    files: tuple[Path, ...]
    shape: tuple[int, int, int, int]
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]


def held_out_count(n: int, eval_fraction: float) -> int:
    return max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0


def split_key(seed: int, name: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()


def scan(data_dir: str, eval_fraction: float, seed: int, cwd: str | None = None) -> Volumes:
    """``task.data_dir`` judged (every file's header) and split; KeyProblem for what the ranks
    could not train on."""
    folder = data_path(data_dir, cwd)

    def refuse(why: str, key: str = "task.data_dir", value: Any = data_dir) -> KeyProblem:
        return KeyProblem(key, why, value)

    try:
        if not folder.exists():
            raise refuse(f"no such directory: {folder.absolute()}")
        if not folder.is_dir():
            raise refuse(f"not a directory: {folder.absolute()}")
        files = volume_files(folder)
    except OSError as e:
        raise refuse(f"cannot read {folder.absolute()}: {e.strerror or e}") from None
    if not files:
        raise refuse(f"no .npy, .nii or .nii.gz files in {folder.absolute()}")
    if any(is_nifti(p) for p in files) and not installed("nibabel"):
        first = next(p for p in files if is_nifti(p))
        raise refuse(f"{first.name}: {NIBABEL}")
    shape: tuple[int, ...] | None = None
    first_name = ""
    for path in files:
        try:
            raw, dtype = header(path)
        except Exception as e:  # a truncated or foreign file: whatever the reader raised
            raise refuse(f"cannot read {path.name} as a volume: {_said(e)}") from None
        if dtype.kind not in NUMBERS or dtype.fields is not None:
            raise refuse(f"{path.name} holds {dtype} values; a volume holds numbers")
        got = model_shape(raw, is_nifti(path))
        if got is None:
            raise refuse(f"{path.name} has shape {raw}; accepted: {ACCEPTED}")
        if any(side % 4 or side < 4 for side in got[1:]) or got[0] < 1:
            why = f"{path.name} has shape {raw}: each spatial side must be a multiple of 4"
            raise refuse(f"{why} (4-D .npy is channel-first, (C, D, H, W))")
        if shape is None:
            shape, first_name = got, path.name
        elif got != shape:
            raise refuse(
                f"volumes of different shapes: {first_name} is {shape}, {path.name} is {got} "
                "(C, D, H, W)"
            )
    assert shape is not None and len(shape) == 4
    held = held_out_count(len(files), eval_fraction)
    if held >= len(files):
        why = (f"{len(files)} volume(s) in {folder.absolute()}: holding out {held} for eval "
               "leaves none to train on (0: no eval)")  # fmt: skip
        raise refuse(why, "task.eval_fraction", eval_fraction)
    order = sorted(files, key=lambda p: split_key(seed, p.name))
    held_set = set(order[:held])
    return Volumes(
        folder,
        tuple(files),
        (shape[0], shape[1], shape[2], shape[3]),
        tuple(p for p in files if p not in held_set),
        tuple(p for p in files if p in held_set),
    )


def _said(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__


def installed(package: str) -> bool:
    from .configs import installed as found  # configs imports this module

    return found(package)
