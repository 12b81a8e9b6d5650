"""``make bench`` (``python -m benchmarks``): ddp_exp against hand-written DDP, Lightning and a
nanoGPT-style loop, and what its own features cost. docs/benchmarks.md holds the current
results, one row per target, with the command that measures each.

The layout, each package importing only those listed after it (``tests/test_benchmarks_layout.py``
holds the import graph to this order, free of cycles):

* ``__main__.py``: the command line (``--only``, ``--quick``, ``--repeats``, ``--impls``, ...);
* ``registry.py``: every group, by name;
* ``groups/``: one module per workload: what it runs, interleaved, and its targets (digits and
  compute against the hand-written scripts and Lightning, start-up, threads, perf, step
  checkpoints, image folder, language model; opt-in: scaling, memory, step overhead, the epoch
  checkpoint, FSDP against DDP, text preparation, time to the first line, trackers, warm-up);
* ``probes/``: measurements that are not interleaved runs (per-step overhead, the checkpoints'
  cost in one world, two runs side by side on two cores, ``ddp-exp prepare`` on a generated
  corpus, time to the first line, each epoch's rate against its own steady intervals): run by a
  group or alone (``python -m benchmarks.probes.NAME --help``);
* ``harness/``: the machinery, the same for every group: a variant and its command line, one
  timed process, a run -> one row, medians and targets, the results files and the report;
* ``baselines/``: the hand-written programs ddp_exp is measured against, each run as its own
  process (``python -m benchmarks.baselines.NAME``);
* ``common.py`` (what the scripts share: arguments, a rank's set-up, the result line, paths)
  and ``workloads.py`` (the workloads' settings and ddp_exp's arrays, in NumPy);
* ``results/``: one CSV per group, the latest measured rows of each variant.

Adding a group: one module in ``groups/`` that defines a ``harness.group.Group`` (its variants,
targets and hooks; a measurement that is not interleaved runs is a group with no variants and a
``probe`` whose rows, ``harness.group.probe_row``, go into its results file), a hand-written
baseline in ``baselines/`` or a probe in ``probes/`` if it needs one, and its entry in
``registry.GROUPS``. Its rows then land in ``results/<name>.csv`` and its targets' rows in
docs/benchmarks.md's table after a full run.
"""
