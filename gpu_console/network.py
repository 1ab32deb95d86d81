"""The ranks' network, visible: the NCCL/gloo variables they inherit or a profile passes
(``distributed.env``), the interfaces, InfiniBand. No torch.

``distributed.env`` is a table of variables each rank sets before it imports torch
(engine/__main__.py), so NCCL and gloo read them: :func:`env_problems` is its validation
(profile.py), :func:`apply` its use in a rank. ``gpu-console check`` reports what a run would
inherit with :func:`inherited`, :func:`interfaces`, :func:`ifname_problems` and
:func:`infiniband`.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any

from . import toml_text

# What `check` reports as the network environment the ranks inherit.
PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_GLOO_", "TORCH_DISTRIBUTED_")
NAMES = ("TP_SOCKET_IFNAME",)
# Variables that name the interface a backend uses: NCCL's, gloo's, TensorPipe's.
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TORCHRUN = "set by torchrun for each rank"
# distributed.env may not set these: someone else does, per rank or per launch.
OWNED = {
    "CUDA_VISIBLE_DEVICES": "set by the console from --devices / hardware.devices",
    "CUDA_DEVICE_ORDER": "set by the console (GPUs are matched to NVML by PCI bus id)",
    "RANK": _TORCHRUN,
    "LOCAL_RANK": _TORCHRUN,
    "WORLD_SIZE": _TORCHRUN,
    "LOCAL_WORLD_SIZE": _TORCHRUN,
    "GROUP_RANK": _TORCHRUN,
    "MASTER_ADDR": "set by torchrun from the rendezvous (the launch picks it)",
    "MASTER_PORT": "set by torchrun from the rendezvous (the launch picks it)",
}
OWNED_PREFIXES = {
    "TORCHELASTIC_": "torchrun's own (its agent sets them for each rank)",
    "GPU_CONSOLE_": "the console's own",
}


# Read once, when a process starts: a rank applies distributed.env after that
# (engine/__main__.py), so these would be set and never read.
def _at_start(who: str) -> str:
    return (
        f"{who} reads it only when a process starts, before a rank applies distributed.env; "
        "export it in the shell that runs gpu-console (the ranks inherit it)"
    )


START_ONLY_PREFIXES = {"LD_": _at_start("the dynamic loader"), "PYTHON": _at_start("Python")}
START_ONLY = {"GLIBC_TUNABLES": _at_start("glibc")}
# Read again at each use (sys.breakpointhook): a rank's own setting takes effect.
READ_LATE = {"PYTHONBREAKPOINT"}


def _as_text(value: Any) -> str | None:
    """A TOML value as the variable's text: strings as they are, numbers as written, booleans
    as 1 or 0 (what NCCL and gloo read); None for a table, a list or a date."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float, str)):
        return value if isinstance(value, str) else str(value)
    return None


def owned_reason(name: str) -> str | None:
    """Why ``distributed.env`` may not set ``name``; None when it may."""
    if name in OWNED:
        return OWNED[name]
    for prefix, why in OWNED_PREFIXES.items():
        if name.startswith(prefix):
            return why
    return None


def too_late_reason(name: str) -> str | None:
    """Why ``name`` cannot take effect from ``distributed.env``; None when it can."""
    if name in START_ONLY:
        return START_ONLY[name]
    if name in READ_LATE:
        return None
    for prefix, why in START_ONLY_PREFIXES.items():
        if name.startswith(prefix):
            return why
    return None


def env_problems(env: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """``distributed.env`` as the ranks get it (every value text), and every problem as
    ``distributed.env.NAME: what is wrong (got VALUE)``."""
    from .schema import show

    out: dict[str, str] = {}
    problems = []
    for name, value in env.items():
        where = f"distributed.env.{name}"
        text = _as_text(value)
        if not NAME.fullmatch(name):
            problems.append(
                f"{where}: not an environment variable name (letters, digits and _, not "
                f"starting with a digit) (got {show(value)})"
            )
        elif why := owned_reason(name):
            problems.append(f"{where}: may not be set here: {why} (got {show(value)})")
        elif why := too_late_reason(name):
            problems.append(f"{where}: cannot take effect here: {why} (got {show(value)})")
        elif text is None:
            problems.append(
                f"{where}: expected a string (or a number or boolean) (got {show(value)})"
            )
        elif "\0" in text:
            problems.append(f"{where}: a NUL character cannot be in a variable (got {show(value)})")
        else:
            out[name] = text
    return out, problems


def apply(run_toml: Path) -> dict[str, str]:
    """In a rank, before torch is imported: ``distributed.env`` of its run.toml (the launch
    validated it) into this process's environment, over what it inherited. What was set;
    nothing when run.toml cannot be read (the engine's own read of it then says why)."""
    try:
        data = toml_text.loads(run_toml.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    env = (data.get("distributed") or {}).get("env") or {}
    if not isinstance(env, dict):
        return {}
    good, _ = env_problems(env)
    os.environ.update(good)
    return good


# -- what `check` shows ------------------------------------------------------------------------


def inherited(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The NCCL, gloo and TensorPipe variables set here (what the ranks would inherit)."""
    environ = dict(os.environ if environ is None else environ)
    return {
        k: v for k, v in sorted(environ.items()) if k.startswith(PREFIXES) or k in NAMES
    }  # fmt: skip


def interfaces() -> list[dict[str, Any]]:
    """Every network interface: its name, whether it is up, its IPv4 and IPv6 addresses."""
    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        ips = [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        up = stats[name].isup if name in stats else None
        out.append({"name": name, "up": up, "addresses": ips})
    return out


def _matches(spec: str, var: str, names: list[str]) -> list[str]:
    """The interfaces ``var``'s value selects. NCCL: a comma list of prefixes, ``=name``
    exact, ``^...`` excludes (never a missing name); gloo and TensorPipe: exact names."""
    if var == "NCCL_SOCKET_IFNAME":
        if spec.startswith("^"):
            return [n for n in names if not any(n.startswith(p) for p in spec[1:].split(","))]
        exact = spec.startswith("=")
        wanted = [p for p in spec.lstrip("=").split(",") if p]
        return [n for n in names if any(n == p if exact else n.startswith(p) for p in wanted)]
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    return [n for n in names if n in wanted]


def ifname_problems(
    environ: dict[str, str], found: list[dict[str, Any]]
) -> tuple[list[str], list[str]]:
    """(what each ``*_SOCKET_IFNAME`` set selects, what is wrong): one that names no
    interface here (the backend would fail to start), or only interfaces that are down."""
    names = [i["name"] for i in found]
    up = {i["name"]: i["up"] for i in found}
    good, bad = [], []
    for var in IFNAME_VARS:
        spec = environ.get(var)
        if spec is None:
            continue
        hits = _matches(spec, var, names)
        if not hits:
            bad.append(f"{var}={spec} names no interface here (there are {', '.join(names)})")
        elif not any(up.get(n) for n in hits):
            bad.append(f"{var}={spec}: {', '.join(hits)} down")
        else:
            good.append(f"{var}={spec}: {', '.join(hits)}")
    return good, bad


INFINIBAND = Path("/sys/class/infiniband")


def infiniband(root: Path = INFINIBAND) -> list[dict[str, Any]]:
    """Each InfiniBand (or RoCE) device and its ports' state (``ACTIVE``, ``DOWN``; None
    where unreadable); empty when there is none."""
    try:
        devices = sorted(p for p in root.iterdir())
    except OSError:
        return []
    out = []
    for dev in devices:
        ports = []
        for port in sorted((dev / "ports").glob("*")):
            try:
                state = (port / "state").read_text().strip()  # "4: ACTIVE"
            except OSError:
                state = None
            state = state.split(":")[-1].strip() if state else None
            ports.append({"port": port.name, "state": state})
        out.append({"device": dev.name, "ports": ports})
    return out
