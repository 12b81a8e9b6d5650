"""The benchmark groups, one module per workload: what each one runs, interleaved, and the
targets it is judged by. ``benchmarks/registry.py`` lists them; ``benchmarks/__init__.py`` says
how to add one."""
