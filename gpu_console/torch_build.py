"""What the installed torch was built for, read from its ``torch/version.py`` without
importing torch (the console never imports it): a CPU-only build cannot use a GPU, however
many NVML sees, and every rank would fail in ``torch.cuda.set_device``."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path


def version_file() -> Path | None:
    """The installed torch's ``version.py`` (find_spec locates the package, runs nothing)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    return path if path.is_file() else None


def build_info() -> dict[str, str | None] | None:
    """``__version__``, ``cuda`` and ``hip`` of the installed torch; None when unreadable."""
    path = version_file()
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    out: dict[str, str | None] = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        literal = isinstance(value, ast.Constant) and isinstance(value.value, (str, type(None)))
        if isinstance(target, ast.Name) and literal:
            out[target.id] = value.value
    return out if "__version__" in out else None


def cuda_problem() -> str:
    """Why this torch cannot run on an NVIDIA GPU; "" when it can, or when that cannot be told
    (then the ranks find out, as before)."""
    info = build_info()
    if info is None or info.get("cuda") or info.get("hip"):
        return ""
    return f"torch {info['__version__']} is built without CUDA (a CPU-only build)"
