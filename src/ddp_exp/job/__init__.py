"""The job folder (its lock, status, records) and the sweep it belongs to (summary, pruning).

May import distributed, io, config, compat.
"""
