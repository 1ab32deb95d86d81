"""``python -m gpu_console.commands.check_worker info | collective RANK WORLD PORT BACKEND``.

The torch side of ``gpu-console check``, in a process of its own (the console never imports
torch). Each mode prints one JSON line last on stdout. A failing step is caught and becomes
a one-line ``error`` in that JSON, so the console shows a row, not a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

MATMUL_N = 256
COLLECTIVE_CALLS = 20
COLLECTIVE_WARMUP = 5


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _step(out: dict[str, Any], name: str, fn) -> Any:
    try:
        return fn()
    except Exception as e:  # each step fails on its own; the rest still report
        out["errors"][name] = _one_line(e)
        return None


def info() -> dict[str, Any]:
    out: dict[str, Any] = {"errors": {}}
    import torch
    import torch.distributed as dist

    out["torch"] = torch.__version__
    out["torch_path"] = os.path.dirname(torch.__file__)
    out["cuda_build"] = torch.version.cuda
    out["hip_build"] = getattr(torch.version, "hip", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(_step(out, "cuda", torch.cuda.is_available))
    # torch explains a driver it cannot use in a warning, not an exception.
    out["cuda_warning"] = next((str(w.message).strip().splitlines()[0] for w in caught), None)
    out["cuda_available"] = available
    out["device_count"] = (
        (_step(out, "device_count", torch.cuda.device_count) or 0) if available else 0
    )
    out["devices"] = []
    for i in range(out["device_count"]):
        props = _step(out, f"device{i}", lambda i=i: torch.cuda.get_device_properties(i))
        if props is None:
            continue
        uuid = getattr(props, "uuid", None)
        out["devices"].append(
            {
                "index": i,
                "name": props.name,
                "capability": [props.major, props.minor],
                "memory": props.total_memory,
                "uuid": f"GPU-{uuid}"
                if uuid is not None and not str(uuid).startswith("GPU-")
                else (str(uuid) if uuid is not None else None),
            }
        )
    out["cudnn"] = None
    if available:
        out["cudnn"] = _step(
            out,
            "cudnn",
            lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        )
    out["gloo"] = bool(_step(out, "gloo", dist.is_gloo_available))
    out["nccl_available"] = bool(_step(out, "nccl", dist.is_nccl_available))
    out["nccl"] = None
    if out["nccl_available"] and available:
        version = _step(out, "nccl", torch.cuda.nccl.version)
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    out["bf16"] = [
        _step(out, f"bf16:{d['index']}", lambda d=d: _bf16(torch, d["index"]))
        for d in out["devices"]
    ]
    out["tf32_matmul_allowed"] = bool(torch.backends.cuda.matmul.allow_tf32)
    devices = ["cpu"] + [f"cuda:{d['index']}" for d in out["devices"]]
    out["matmul"] = [
        _step(out, f"matmul:{dev}", lambda dev=dev: _matmul(torch, dev)) for dev in devices
    ]
    out["torchrun"] = _step(out, "torchrun", _torchrun)
    return out


def _bf16(torch, index: int) -> bool:
    with torch.cuda.device(index):
        return bool(torch.cuda.is_bf16_supported())


def _matmul(torch, device: str) -> dict[str, Any]:
    """A float32 matmul on ``device`` against the same product in float64 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_N, MATMUL_N, generator=gen, dtype=torch.float64)
    b = torch.randn(MATMUL_N, MATMUL_N, generator=gen, dtype=torch.float64)
    ref = a @ b
    x, y = a.float().to(device), b.float().to(device)
    started = time.perf_counter()
    got = x @ y
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    got = got.double().cpu()
    error = ((got - ref).abs().max() / ref.abs().max()).item()
    return {"device": device, "n": MATMUL_N, "rel_error": error, "seconds": seconds}


def _torchrun() -> dict[str, Any]:
    # The launcher runs ``python -m torch.distributed.run``: building its parser is what
    # fails when the install is broken, without starting anything.
    from torch.distributed.run import get_args_parser

    get_args_parser()
    return {"module": "torch.distributed.run", "path": shutil.which("torchrun")}


def collective(rank: int, world: int, port: int, backend: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        value = torch.full((1,), float(rank + 1), device=device)
        dist.all_reduce(value)
        sync()
        got = value.item()
        expected = world * (world + 1) / 2
        x = torch.ones(1, device=device)
        times = []
        for i in range(COLLECTIVE_WARMUP + COLLECTIVE_CALLS):
            started = time.perf_counter()
            dist.all_reduce(x)
            sync()
            if i >= COLLECTIVE_WARMUP:
                times.append(time.perf_counter() - started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank,
        "backend": backend,
        "ok": got == expected,
        "value": got,
        "expected": expected,
        "median_s": statistics.median(times),
        "calls": len(times),
    }


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["info"]:
            result = info()
        elif argv[:1] == ["collective"] and len(argv) == 5:
            result = collective(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        else:
            print("usage: check_worker info | collective RANK WORLD PORT BACKEND", file=sys.stderr)
            return 2
    except Exception as e:  # the console shows this line as the check's detail
        print(json.dumps({"error": _one_line(e)}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
