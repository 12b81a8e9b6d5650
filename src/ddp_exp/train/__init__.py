"""The training loop and what it steps: objective, models, optimizer, schedule, monitor,
evaluation, resumable state.

May import metrics, data, job, distributed, io, config, compat.
"""
