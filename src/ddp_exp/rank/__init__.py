"""A rank's life: its start, its training run, its failures and their records.

May import train, metrics, data, job, distributed, io, config, compat.
"""
