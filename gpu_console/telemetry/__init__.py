"""Device telemetry: what the GPUs and the host are doing while a run trains.

- :mod:`.nvml`: the only importer of ``pynvml``; typed "not available" readings.
- :mod:`.host`: psutil: CPU, RAM, and every process of a run.
- :mod:`.ranks`: rank → process → GPU by UUID; NVML memory beside the allocator's.
- :mod:`.sampler`: the background sampler, its ring buffers and ``telemetry.jsonl``.
"""
