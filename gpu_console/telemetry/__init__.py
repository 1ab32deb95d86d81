"""Device telemetry: what the GPUs and the host are doing while a run trains.

- :mod:`.nvml`: the only importer of ``pynvml``; typed "not available" readings.
- :mod:`.host`: psutil: CPU, RAM, and every process of a run.
- :mod:`.ranks`: rank → process → GPU by UUID; NVML memory beside the allocator's.
- :mod:`.sampler`: one sample; the console's in-memory sampler and its ring buffers.
- :mod:`.recorder`: the supervisor's recorder: ``telemetry.jsonl`` for the whole run.
- :mod:`.figures`: one line per GPU of a run (util, peak memory, temperature, energy).
"""
