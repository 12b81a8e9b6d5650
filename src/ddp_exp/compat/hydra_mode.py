"""hydra-core 1.3's ``Hydra.get_mode``, answered without a composition where only the command
line can decide the mode.

Before every run or multirun, Hydra composes the whole config once to read ``hydra.mode`` (set
in a config, it runs a multirun without ``-m``), then composes it again to run the job: ~0.15 s
of a launcher's start on this machine, paid by every command and sweep (issue 42 item 6;
py-spy: the first composition was ~30% of the launcher's time outside imports).

The first composition can only find a mode that a config file, or an override, sets. With
ddp_exp's own configs alone on the search path, the files that set it are known: the options of
the groups in :data:`MODE_GROUPS` (``hparams_search``: the Optuna presets sweep without
``-m``), which ``tests/test_config.py`` checks against every file of ``ddp_exp.conf``. So where
the primary config is ddp_exp's ``config``, no other config folder is searched
(``--config-dir``, ``--config-path``, a searchpath plugin) and no override names one of those
groups, ``hydra.mode`` or ``hydra.searchpath``, the mode is None, which is what Hydra's
composition returns then; everywhere else Hydra composes as before. On a hydra-core other than
1.3.x nothing is changed and the log says so once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ddp_exp.compat.versions import wrap_once

# Groups of ddp_exp.conf with an option that sets hydra.mode (tests/test_config.py scans them).
MODE_GROUPS = frozenset({"hparams_search"})
# (provider, path) of the search path where no config but Hydra's and ddp_exp's is found.
OWN_SEARCH_PATH = frozenset({("hydra", "pkg://hydra.conf"), ("main", "pkg://ddp_exp.conf"),
                             ("schema", "structured://")})
_DECIDING_KEYS = ("hydra.mode", "hydra.searchpath")


def only_the_command_line_decides(config_name: str | None,
                                  search_path: Sequence[tuple[str, str]],
                                  overrides: Sequence[str]) -> bool:
    """True when no config on ``search_path`` ((provider, path) pairs) that the primary
    config ``config_name`` and ``overrides`` (Hydra's override strings) select can set
    ``hydra.mode``, so that Hydra's ``get_mode`` composition would return None."""
    if config_name != "config" or set(search_path) - OWN_SEARCH_PATH:
        return False
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").strip()
        if key == "hydra" or key.startswith(_DECIDING_KEYS):
            return False
        if key.replace("/", ".").split(".", 1)[0] in MODE_GROUPS:
            return False
    return True


def decide_mode_without_composing() -> None:
    """Install the shortcut on ``hydra._internal.hydra.Hydra.get_mode`` in this process.
    Idempotent; nothing on a hydra-core other than 1.3.x."""
    from hydra._internal.hydra import Hydra

    def wrap(stock: Callable) -> Callable:
        def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
            entries = [(e.provider, e.path) for e in
                       self.config_loader.get_search_path().get_path()]
            if only_the_command_line_decides(config_name, entries, overrides):
                return None
            return stock(self, config_name, overrides)
        return get_mode

    wrap_once(Hydra, "get_mode", wrap, "hydra-core",
              "Hydra.get_mode answered from the command line",
              "Hydra composes the config twice per job")
