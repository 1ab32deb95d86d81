"""gpu-console: a terminal training console for PyTorch."""

import time as _time

__version__ = "0.1.0"

# When this interpreter first reached gpu-console's code, and the CPU its process had used by
# then: a command's start where /proc's is the start of a shell that exec'd it much later
# (timings.process_start_time).
FIRST_IMPORT = (_time.time(), _time.process_time())
