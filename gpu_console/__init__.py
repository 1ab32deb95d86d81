"""gpu-console: a terminal training console for PyTorch."""

__version__ = "0.1.0"
