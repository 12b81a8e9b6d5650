"""The hand-written programs ddp_exp is measured against: each one a script run as its own
process (``python -m benchmarks.baselines.NAME --help``), printing one ``BENCH_RESULT {json}``
line. Each keeps its own training loop, written the way its kind of user writes it.

May use: ``benchmarks.common``, ``benchmarks.workloads`` (and ddp_exp's model classes)."""
