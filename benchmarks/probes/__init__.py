"""Measurements inside one process, where interleaved whole runs cannot resolve a few percent
on a noisy machine: each a script (``python -m benchmarks.probes.NAME --help``), run alone or
by a group (``groups/step_checkpoint.py``, ``groups/step_overhead.py``).

May use: ``benchmarks.common``, ``benchmarks.workloads``, ``benchmarks.baselines``,
``benchmarks.harness.variant``."""
