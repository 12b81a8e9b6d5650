"""Launching one world: building what ranks need before they start, the elastic launch,
torchrun/srun/submitit layouts, the rendezvous.

May import rank, train, metrics, data, job, distributed, io, config, compat.
"""
