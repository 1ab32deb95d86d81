"""The ``cvrp`` task's eval instances from a file (``task.eval_file``), and its built-in eval
set written out as VRPLIB files. No torch at import: the console judges the file before
launch (``CVRPConfig.train_size``), as the ranks will read it.

What a file may hold:

- a VRPLIB instance (``.vrp``, read with the ``vrplib`` package, an optional extra:
  ``pip install "gpu-console[cvrp]"``) with a ``NODE_COORD_SECTION``, a ``DEMAND_SECTION``,
  a ``CAPACITY`` and one depot; or a directory of them (every ``*.vrp`` in it, by name), all
  with the same number of nodes;
- saved arrays: ``.npz`` (numpy) or ``.pt`` (``torch.save`` of a dict of tensors) holding
  ``coords`` (instances, nodes, 2) with node 0 the depot, ``demand`` (instances, nodes) with
  the depot's 0, and optionally ``capacity`` (a number; absent: ``task.capacity``'s).

What the model sees (it was trained in the unit square with demands out of ``task.capacity``):
coordinates already in the unit square are kept as they are (so the built-in set written out
by :func:`write_vrplib` reads back exactly); a VRPLIB instance's others are shifted to start
at 0 and divided by their larger extent (x or y: one factor, so distances keep their
proportions); saved arrays must already lie in the unit square. Demands are multiplied by
``task.capacity / capacity`` (the file's capacity), so each is the same share of the vehicle.
Tour lengths are reported in these normalised units.

``python -m gpu_console.tasks.cvrp_files write-eval PROFILE DIR [KEY=VALUE ...]`` writes the
profile's built-in eval instances (``task.eval_instances`` of ``task.num_customers``, from
``task.data_seed``) to ``DIR/eval-0000.vrp`` and on.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..schema import KeyProblem

KEY = "task.eval_file"
ARRAY_SUFFIXES = (".npz", ".pt")
CHECK_S = 120.0  # how long the console waits for a .pt file's check (it imports torch)


def eval_path(eval_file: str, cwd: str | None = None) -> Path:
    """Where ``task.eval_file`` points for a rank, which runs in the run's launch directory
    (``cwd``; None: this process's own)."""
    path = Path(eval_file).expanduser()
    return path if path.is_absolute() or cwd is None else Path(cwd) / path


def said(e: BaseException) -> str:
    """An exception's kind and message, in one line (torch.load's run to a page)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def refuse(eval_file: str, why: str) -> KeyProblem:
    return KeyProblem(KEY, why, eval_file)


def load(eval_file: str, capacity: float, cwd: str | None = None) -> tuple[np.ndarray, ...]:
    """The file's instances as the model takes them: coordinates (instances, nodes, 2) in the
    unit square and demands (instances, nodes) out of ``capacity``, both float64; KeyProblem
    naming ``task.eval_file`` for anything the eval could not use."""
    path = eval_path(eval_file, cwd)
    if not path.exists():
        raise refuse(eval_file, f"no such file or directory: {path.absolute()}")
    try:
        if path.is_dir():
            files = sorted(path.glob("*.vrp"))
            if not files:
                raise refuse(eval_file, f"no .vrp file in the directory {path.absolute()}")
            read = [read_vrplib(eval_file, f, capacity) for f in files]
            sizes = {len(c) for c, _ in read}
            if len(sizes) > 1:
                why = f"its instances differ in size ({sorted(sizes)} nodes): give one size"
                raise refuse(eval_file, why)
            coords = np.stack([c for c, _ in read])
            demand = np.stack([d for _, d in read])
        elif path.suffix == ".vrp":
            coords, demand = (a[None] for a in read_vrplib(eval_file, path, capacity))
        elif path.suffix in ARRAY_SUFFIXES:
            coords, demand = read_arrays(eval_file, path, capacity)
        else:
            why = "expected a .vrp file (VRPLIB), a directory of them, a .npz or a .pt file"
            raise refuse(eval_file, why)
    except OSError as e:
        raise refuse(eval_file, f"cannot read {path.absolute()}: {e.strerror or e}") from None
    return coords, demand


def read_vrplib(eval_file: str, path: Path, capacity: float) -> tuple[np.ndarray, np.ndarray]:
    """One VRPLIB instance, normalised (the module's docstring), its depot node 0."""
    try:
        import vrplib
    except ImportError:
        why = 'reading VRPLIB files needs the vrplib package: pip install "gpu-console[cvrp]"'
        raise refuse(eval_file, why) from None
    try:
        data = vrplib.read_instance(path, compute_edge_weights=False)
    except OSError:
        raise
    except Exception as e:  # the parser's own errors: ValueError, IndexError, KeyError, ...
        why = f"{path.name} is not a VRPLIB instance it can read ({said(e)})"
        raise refuse(eval_file, why) from None
    for key, section in (("node_coord", "NODE_COORD_SECTION"), ("demand", "DEMAND_SECTION"),
                         ("capacity", "CAPACITY"), ("depot", "DEPOT_SECTION")):  # fmt: skip
        if key not in data:
            raise refuse(eval_file, f"{path.name} has no {section}")
    try:
        coords = np.asarray(data["node_coord"], dtype=np.float64)
        demand = np.asarray(data["demand"], dtype=np.float64).reshape(-1)
        depots = np.asarray(data["depot"], dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        why = f"{path.name}: its coordinates, demands and depot must be numbers"
        raise refuse(eval_file, why) from None
    if not np.isfinite(coords).all():
        raise refuse(eval_file, f"{path.name}: its coordinates must be finite")
    if coords.ndim != 2 or coords.shape[1] != 2 or len(demand) != len(coords):
        why = f"{path.name}: expected 2-D coordinates and one demand for each node"
        raise refuse(eval_file, why)
    if len(depots) != 1:
        raise refuse(eval_file, f"{path.name} has {len(depots)} depots: the task has one")
    depot = int(depots[0])
    if not 0 <= depot < len(coords):
        raise refuse(eval_file, f"{path.name}: its depot is not one of its nodes")
    order = [depot, *(i for i in range(len(coords)) if i != depot)]
    coords, demand = coords[order], demand[order]
    if coords.min() < 0 or coords.max() > 1:
        low = coords.min(0)
        extent = float((coords.max(0) - low).max()) or 1.0
        coords = (coords - low) / extent
    return coords, checked_demand(eval_file, path.name, demand[None], data["capacity"], capacity)[0]


def read_arrays(eval_file: str, path: Path, capacity: float) -> tuple[np.ndarray, np.ndarray]:
    """``coords``, ``demand`` (and ``capacity``) of a ``.npz`` or ``.pt`` file, checked."""
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as saved:
                arrays = {k: np.asarray(saved[k]) for k in saved.files}
        except OSError:
            raise
        except Exception as e:  # not a zip, a pickled object array, ...
            why = f"{path.name} is not a numpy .npz file it can read ({said(e)})"
            raise refuse(eval_file, why) from None
    else:
        arrays = read_torch(eval_file, path)
    for key in ("coords", "demand"):
        if key not in arrays:
            raise refuse(eval_file, f"{path.name} has no {key!r} (it holds {sorted(arrays)})")
    coords = np.asarray(arrays["coords"], dtype=np.float64)
    demand = np.asarray(arrays["demand"], dtype=np.float64)
    if coords.ndim != 3 or coords.shape[2] != 2 or coords.shape[1] < 2 or not len(coords):
        why = f"{path.name}: coords must be (instances, nodes, 2) (got {list(coords.shape)})"
        raise refuse(eval_file, why)
    if demand.shape != coords.shape[:2]:
        why = f"{path.name}: demand must be (instances, nodes) = {list(coords.shape[:2])}"
        raise refuse(eval_file, f"{why} (got {list(demand.shape)})")
    if not np.isfinite(coords).all() or coords.min() < 0 or coords.max() > 1:
        why = f"{path.name}: coords must lie in the unit square (VRPLIB files are rescaled)"
        raise refuse(eval_file, why)
    file_capacity = arrays.get("capacity", capacity)
    return coords, checked_demand(eval_file, path.name, demand, file_capacity, capacity)


def read_torch(eval_file: str, path: Path) -> dict[str, np.ndarray]:
    """A ``.pt`` file's tensors as arrays (``torch.load(weights_only=True)``)."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:
        why = f"{path.name} is not a torch file of tensors ({said(e)})"
        raise refuse(eval_file, why) from None
    if not isinstance(saved, dict):
        why = f"{path.name} holds a {type(saved).__name__}: expected a dict of tensors"
        raise refuse(eval_file, why)
    return {str(k): np.asarray(v.double() if torch.is_tensor(v) else v) for k, v in saved.items()}


def checked_demand(
    eval_file: str, name: str, demand: np.ndarray, file_capacity, capacity: float
) -> np.ndarray:
    """Demands (instances, nodes) rescaled from the file's capacity to ``capacity``."""
    try:
        file_capacity = float(np.asarray(file_capacity).reshape(()))
    except (TypeError, ValueError):
        raise refuse(eval_file, f"{name}: the capacity must be one number") from None
    if not math.isfinite(file_capacity) or file_capacity <= 0:
        raise refuse(eval_file, f"{name}: the capacity must be positive (got {file_capacity:g})")
    if not np.isfinite(demand).all() or demand.min() < 0:
        raise refuse(eval_file, f"{name}: demands must be finite and at least 0")
    if (demand[:, 0] != 0).any():
        raise refuse(eval_file, f"{name}: the depot's demand must be 0")
    if demand.max() > file_capacity:
        why = f"{name}: a demand of {demand.max():g} exceeds the capacity {file_capacity:g}"
        raise refuse(eval_file, why)
    return demand * (capacity / file_capacity)


def check(eval_file: str, capacity: float, cwd: str | None = None) -> None:
    """The console's check before launch: the file read as the ranks will read it. A ``.pt``
    file needs torch, which the console never imports: read by a child process."""
    if eval_path(eval_file, cwd).suffix != ".pt":
        load(eval_file, capacity, cwd)
        return
    command = [sys.executable, "-m", __name__, "check", eval_file, repr(capacity)]
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=CHECK_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise refuse(eval_file, f"reading it took over {CHECK_S:g} s") from None
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["the check failed"]
        raise refuse(eval_file, lines[-1].removeprefix(f"{KEY}: "))


def write_vrplib(
    directory: str | os.PathLike, coords: np.ndarray, demand: np.ndarray, capacity: float,
    prefix: str = "eval",
) -> list[Path]:  # fmt: skip
    """Instances (coordinates (instances, nodes, 2), demands (instances, nodes), node 0 the
    depot) as VRPLIB files ``DIR/<prefix>-0000.vrp`` and on. Coordinates are written in full
    (float64), so reading them back gives the same instances."""
    import vrplib

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (xy, d) in enumerate(zip(coords, demand, strict=True)):
        path = out / f"{prefix}-{i:04d}.vrp"
        demands = np.asarray(d, dtype=np.float64)
        whole = demands.astype(np.int64)
        vrplib.write_instance(path, {
            "NAME": path.stem,
            "TYPE": "CVRP",
            "COMMENT": "gpu-console cvrp eval instance: the unit square",
            "DIMENSION": len(xy),
            "EDGE_WEIGHT_TYPE": "EUC_2D",
            "CAPACITY": int(capacity) if float(capacity).is_integer() else float(capacity),
            "NODE_COORD_SECTION": np.asarray(xy, dtype=np.float64),
            "DEMAND_SECTION": whole if (whole == demands).all() else demands,
            "DEPOT_SECTION": np.array([1, -1]),
        })  # fmt: skip
        written.append(path)
    return written


def write_eval(profile: str, directory: str, sets: list[str]) -> list[Path]:
    """The profile's built-in eval instances as VRPLIB files in ``directory``."""
    from ..profile import load_profile
    from .cvrp import capacity_of, instances, seeded

    cfg = load_profile(profile, sets).task
    coords, demand = instances(cfg.eval_instances, cfg.num_customers, seeded(cfg.data_seed, "cpu"))
    return write_vrplib(directory, coords.double().numpy(), demand.numpy(), capacity_of(cfg))


def main(argv: list[str]) -> int:
    usage = (
        "usage: python -m gpu_console.tasks.cvrp_files write-eval PROFILE DIR [KEY=VALUE ...]\n"
        "       python -m gpu_console.tasks.cvrp_files check FILE CAPACITY"
    )
    if len(argv) >= 3 and argv[0] == "write-eval":
        written = write_eval(argv[1], argv[2], argv[3:])
        print(f"{len(written)} instances written to {argv[2]}")
        return 0
    if len(argv) == 3 and argv[0] == "check":
        try:
            load(argv[1], float(argv[2]))
        except KeyProblem as e:
            print(f"{e.key}: {e.why}", file=sys.stderr)
            return 2
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
