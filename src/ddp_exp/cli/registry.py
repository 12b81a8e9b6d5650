"""What the entry hands Hydra before it starts: the schema and the YAML's resolvers
(:func:`ddp_exp.config.compose.register_configs`), ``--help``'s resolvers
(:func:`ddp_exp.cli.usage.register_resolvers`) and the Hydra plugins that ship with ddp_exp
(``hydra/sweeper=ddp_optuna``: :mod:`hydra_plugins.ddp_optuna_sweeper`). The plugin sits above
the config layer (it imports ``train``, ``job`` and ``io``), so registering it is the entry's
work, not the config layer's (issue 42 item 5)."""

from __future__ import annotations

from ddp_exp.cli.usage import register_resolvers
from ddp_exp.config.compose import register_configs


def register() -> None:
    """Register everything ddp_exp's configs name (once per process; again is harmless): the
    schema, the resolvers, and the ``ddp_optuna`` sweeper, which Hydra's plugin scan finds in
    an installed wheel but not in an editable install (a path hook it does not walk)."""
    from hydra_plugins import ddp_optuna_sweeper

    register_configs()
    register_resolvers()
    ddp_optuna_sweeper.register()
