"""The machinery every group shares: ``variant`` (one run and its command line), ``timed`` (one
timed process), ``measure`` (a run -> one row; the groups interleaved), ``stats`` (medians,
targets), ``group`` (what a group is), ``results`` (the results files, the docs' table) and
``report`` (the run's markdown).

May use: ``benchmarks.common``, ``benchmarks.workloads``; never ``groups`` or ``registry``."""
