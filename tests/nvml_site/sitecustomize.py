"""Python runs this at start-up in every process a test starts: conftest puts this folder on
their PYTHONPATH with ``GPU_CONSOLE_TEST_GPUS=N``. In each of them (the CLI, the supervisor,
torchrun's ranks, the console under tmux, ``check``'s workers) NVML is then the fake at the
``gpu_console.telemetry.nvml`` seam: no driver where N is 0 (the default suite: every machine
looks like CI), N GPUs where a person rehearses a GPU machine (tests/README.md). What the
console decides from NVML (``--devices auto``, the launch screen, ``check``, the supervisor's
telemetry) follows.
"""

import os
import sys

_GPUS = os.environ.get("GPU_CONSOLE_TEST_GPUS", "")
if _GPUS.isdigit():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        from test_telemetry_fake import FakeNvml, real

        from gpu_console.telemetry import nvml

        _n = int(_GPUS)
        nvml.pynvml = FakeNvml(_n) if _n else FakeNvml(init_error=real.NVML_ERROR_LIBRARY_NOT_FOUND)
    finally:
        sys.path.pop(0)
