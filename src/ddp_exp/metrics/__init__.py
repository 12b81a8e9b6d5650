"""What is measured and written: the training-loss window, the TensorBoard/JSON writer,
throughput, dashboards, confusion matrices, language-model reports, progress.

May import data, job, distributed, io, config, compat.
"""
