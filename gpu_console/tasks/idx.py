"""MNIST's IDX files, read and written without torch (the launch checks them torch-free).

An IDX file (LeCun's format) is a 4-byte magic number, two zero bytes, then a type code
(``0x08``: unsigned bytes) and the number of dimensions, then each dimension as a
big-endian uint32, then the values in C order. MNIST ships four of them, each also as
``.gz``: ``train-images-idx3-ubyte`` (60000 × 28 × 28), ``train-labels-idx1-ubyte``
(60000), ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (10000 each).
"""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

UBYTE = 0x08
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class IdxError(ValueError):
    """An IDX file that is missing, truncated or not what it should be (one line)."""


def write_idx(path: Path, dims: tuple[int, ...], data: bytes, code: int = UBYTE) -> None:
    """``data`` (unsigned bytes, C order) as an IDX file; gzipped where ``path`` ends ``.gz``."""
    if math.prod(dims) != len(data):
        raise ValueError(f"{len(data)} bytes for dims {dims}")
    raw = struct.pack(">HBB", 0, code, len(dims)) + struct.pack(f">{len(dims)}I", *dims) + data
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(raw)


def _raw(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError) as e:  # gzip's BadGzipFile is an OSError
        raise IdxError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def read_idx(path: Path) -> tuple[tuple[int, ...], bytes]:
    """An unsigned-byte IDX file's dims and values (C order), or IdxError saying what is wrong."""
    raw = _raw(path)
    if len(raw) < 4:
        raise IdxError(f"{path}: not an IDX file (only {len(raw)} bytes)")
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or ndim == 0:
        raise IdxError(f"{path}: not an IDX file (magic number {raw[:4].hex()})")
    if code != UBYTE:
        raise IdxError(f"{path}: values of type 0x{code:02x}, expected unsigned bytes (0x08)")
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise IdxError(f"{path}: truncated header")
    dims = struct.unpack(f">{ndim}I", raw[4:head])
    if len(raw) - head != math.prod(dims):
        raise IdxError(
            f"{path}: {len(raw) - head} bytes of values for dims {'×'.join(map(str, dims))} "
            f"({math.prod(dims)} expected): truncated or damaged"
        )
    return dims, raw[head:]


def find(directory: Path, stem: str) -> Path:
    """``directory/stem``, else ``directory/stem.gz``, or IdxError naming both."""
    for name in (stem, stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    raise IdxError(f"no {stem} (or {stem}.gz) in {directory}")


def read_mnist(directory: Path, split: str) -> tuple[tuple[int, ...], bytes, bytes]:
    """One split's images (dims, values) and labels, checked against each other."""
    images_stem, labels_stem = MNIST_FILES[split]
    dims, images = read_idx(find(directory, images_stem))
    ldims, labels = read_idx(find(directory, labels_stem))
    if len(dims) != 3:
        raise IdxError(f"{images_stem}: images are 3-dimensional (got dims {dims})")
    if len(ldims) != 1 or ldims[0] != dims[0]:
        raise IdxError(f"{labels_stem}: {ldims[0]} labels for {dims[0]} images in {images_stem}")
    if labels and max(labels) > 9:
        raise IdxError(f"{labels_stem}: a label of {max(labels)} (MNIST's are 0 to 9)")
    return dims, images, labels
