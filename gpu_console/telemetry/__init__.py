"""Device telemetry. :mod:`.nvml` is the only importer of ``pynvml``."""
