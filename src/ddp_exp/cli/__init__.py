"""The command line: the Hydra task, exit statuses, signals, one-line errors, ``--help``.

May import every package below it; nothing imports it.
"""
