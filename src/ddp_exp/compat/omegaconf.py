"""OmegaConf's private ``DictConfig._get_node`` (omegaconf 2.3.x), for a schema node that takes
keys of its own.

Kept (issue 27 item 3) because it prevents a wrong result: without it a section of the schema
is either closed (a data YAML's ``size: 100`` for the user's own ``_target_`` refused) or
untyped (``data.batch_size=two`` accepted at composition, and an Enum's name left a string).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from ddp_exp.compat.versions import written_for

# What an open schema node becomes on another OmegaConf (logged once, ddp_exp.compat.versions).
STOCK_NODE = ("the schema's sections are OmegaConf's structured configs: typed, but closed "
              "(a key of a user's own _target_ is refused)")


def open_node(dataclass: type) -> DictConfig | Any:
    """The schema ``dataclass`` as a node that takes keys of its own: each field keeps its
    type (``batch_size=x`` is refused at composition), and a config that extends it may add
    keys, the arguments of a user's ``_target_`` (a data YAML with ``size: 100``); on the
    command line a new key is ``+data.size=100``, which Hydra's error then suggests.

    Copies each field's typed node (``DictConfig._get_node``) into an untyped ``DictConfig``;
    on an OmegaConf other than 2.3.x, returns ``dataclass`` itself (OmegaConf's stock
    structured config: typed and closed) and logs :data:`STOCK_NODE` once."""
    if not written_for("omegaconf", "open_node (DictConfig._get_node)", STOCK_NODE):
        return dataclass
    typed = OmegaConf.structured(dataclass)
    node = OmegaConf.create({})
    for key in typed:
        node[key] = typed._get_node(key)
    return node
