"""The process group: a rank's World, the all-reduces and broadcasts, SyncBatchNorm on CPU.

May import io, config, compat.
"""
