"""``python -m ddp_exp [overrides]``: the entry point (:mod:`ddp_exp.cli.entry`); the command
line lives in :mod:`ddp_exp.cli.main`."""

from ddp_exp.cli.entry import main

if __name__ == "__main__":
    main()
