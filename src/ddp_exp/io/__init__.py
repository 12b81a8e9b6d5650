"""Files: atomic writes, disk-full reporting, checkpoints.

May import config, compat.
"""
