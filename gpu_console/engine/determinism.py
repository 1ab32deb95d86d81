"""``train.deterministic``: what makes two runs (and a resumed one) compute the same numbers.

On CPU the engine's runs are bit-exact anyway. On GPUs three things differ from run to run
unless told not to: kernels that sum with atomics (scatter/index adds, some backward passes),
cuBLAS's choice of workspace split, and cuDNN's autotuning. Deterministic mode asks torch for
deterministic kernels (an op without one fails naming itself, rather than differ silently),
fixes cuBLAS's workspace (``CUBLAS_WORKSPACE_CONFIG``, read when the first cuBLAS handle is
made: this runs before the rank touches CUDA), and turns off cuDNN autotuning and TF32 (the
profile already says so: profile.py turns the defaults off and refuses an explicit true).
"""

from __future__ import annotations

import os

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"
# Both settings torch accepts as deterministic; a user's own choice of the two stands.
CUBLAS_ACCEPTED = (":4096:8", ":16:8")


def setup(deterministic: bool) -> None:
    """Before the process group and the device: nothing of CUDA exists yet."""
    if not deterministic:
        return
    if os.environ.get(CUBLAS_ENV) not in CUBLAS_ACCEPTED:
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def in_effect(deterministic: bool) -> dict[str, object]:
    """What the rank really runs with, read back from torch: the start event's ``deterministic``."""
    return {
        "enabled": deterministic,
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        CUBLAS_ENV.lower(): os.environ.get(CUBLAS_ENV),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
    }
