"""hydra-core 1.3's private ``ConfigLoaderImpl.get_group_options``, answered once per question
for the duration of one ``--help``.

Kept because it buys seconds of every ``--help`` (issue 42 item 6): Hydra's help lists the
config groups for ``$APP_CONFIG_GROUPS`` and ``$HYDRA_CONFIG_GROUPS`` whether the template uses
them or not, and each ``get_group_options`` rebuilds a caching copy of the whole config
repository (~50 ms here, ~180 calls: ``--help`` took 2.8 s, its imports 0.2 s). Within one
``--help`` the repository does not change, so the same question has the same answer. On a
hydra-core other than 1.3.x nothing is changed (the stock listing, slower) and the log says so
once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddp_exp.compat.versions import wrap_once


def answer_group_options_once() -> None:
    """Memoise ``ConfigLoaderImpl.get_group_options`` in this process (only for a command that
    prints help and exits: a composition after it would see a stale listing of a config
    folder that changed meanwhile). Idempotent; nothing on a hydra-core other than 1.3.x."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    def wrap(stock: Callable) -> Callable:
        def get_group_options(self: Any, group_name: str, results_filter: Any = None,
                              config_name: str | None = None,
                              overrides: list[str] | None = None) -> list[str]:
            if results_filter is None:  # Hydra's default, ObjectType.CONFIG, by position
                from hydra.core.object_type import ObjectType

                results_filter = ObjectType.CONFIG
            answers = self.__dict__.setdefault("_ddp_exp_group_options", {})  # this loader's
            key = (group_name, results_filter, config_name, tuple(overrides or ()))
            if key not in answers:
                answers[key] = list(stock(self, group_name, results_filter, config_name,
                                          overrides))
            return list(answers[key])
        return get_group_options

    wrap_once(ConfigLoaderImpl, "get_group_options", wrap, "hydra-core",
              "the --help group listing answered once per question",
              "each listing rebuilds Hydra's config repository")
