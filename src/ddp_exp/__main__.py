"""``python -m ddp_exp [overrides]``: the entry point; the command line lives in
:mod:`ddp_exp.cli.main`."""

from ddp_exp.cli.main import main

if __name__ == "__main__":
    main()
