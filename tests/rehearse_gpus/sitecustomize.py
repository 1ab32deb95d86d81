"""Python runs this at start-up when this folder is on PYTHONPATH: conftest puts it there for
the processes a test starts while ``GPU_CONSOLE_TEST_GPUS=N`` rehearses a GPU machine
(tests/README.md). In each such process (the CLI, the supervisor, torchrun's ranks, the
console under tmux, ``check``'s workers) NVML is then the fake at the
``gpu_console.telemetry.nvml`` seam with N GPUs: what the console decides from NVML
(``--devices auto``, the launch screen, ``check``) is what it decides on a GPU machine.
"""

import os
import sys

_GPUS = os.environ.get("GPU_CONSOLE_TEST_GPUS")
if _GPUS:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from test_telemetry_fake import FakeNvml

        from gpu_console.telemetry import nvml

        nvml.pynvml = FakeNvml(int(_GPUS))
    finally:
        sys.path.pop(0)
