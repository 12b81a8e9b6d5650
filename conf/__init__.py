"""Hydra config groups of ddp_exp, shipped inside the package (see pyproject.toml)."""
