"""``hydra/sweeper=ddp_optuna``: ddp_exp's Optuna sweeper with per-epoch pruning (issue 31)."""


def register() -> None:
    """Store the sweeper's config and register its class with Hydra's plugins. Hydra's plugin
    scan finds both in an installed wheel; an editable install's ``hydra_plugins`` is a path
    hook that the scan does not walk, so ddp_exp calls this before Hydra starts."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.ddp_optuna_sweeper import config  # noqa: F401 (stores the config)
    from hydra_plugins.ddp_optuna_sweeper.sweeper import DDPOptunaSweeper

    Plugins.instance().register(DDPOptunaSweeper)
