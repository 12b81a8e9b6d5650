"""The rendezvous of a one-node world: the elastic agent is the whole rendezvous.

torch's ``c10d`` rendezvous (``DynamicRendezvousHandler``) is built for nodes that find each
other: its first round sleeps a random 0-0.3 s so that nodes do not all hit the store at once,
then runs a join and a sync over the store, and its shutdown closes the round over the store
again. On one node there is no one to find: the agent is node 0 of 1. :class:`LocalRendezvous`
makes each round a fresh ``TCPStore`` on a free loopback port (port 0: the kernel picks it, so
parallel jobs cannot collide), served by the agent (``use_agent_store``: the ranks reach it at
``MASTER_ADDR:MASTER_PORT`` and set up their process group there, as under torchrun), and hands
back node rank 0 of 1. Every round, the first and each restart, gets a store of its own, so a
restarted world never reads the dead one's keys.

It is registered with torch's ``rendezvous_handler_registry`` (the elastic launcher's extension
point for rendezvous backends) under :data:`BACKEND`; :mod:`ddp_exp.launch.elastic` picks it for one
node on the default endpoint ``127.0.0.1:0``. Measured: the one-node start-up of the 1-epoch
digits job is ~0.2 s shorter (docs/benchmarks.md, issue 13).

May use: torch.distributed (nothing of ddp_exp).
"""

from __future__ import annotations

import datetime

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "ddp_exp-local"
HOST = "127.0.0.1"


class LocalRendezvous(RendezvousHandler):
    """One node's rendezvous: a fresh agent-hosted ``TCPStore`` on ``HOST`` per round, node rank
    0 of 1.

    Args:
        run_id: the launch's id; the agent's keys in the store are prefixed with it.
        timeout_s: how long the store waits for an answer (seconds).
    """

    def __init__(self, run_id: str, timeout_s: float):
        self.run_id, self.timeout_s = run_id, timeout_s
        self.store = None
        self.closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore, TCPStore

        # A restart's round drops the previous store (its server closes with it).
        self.store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        return RendezvousInfo(PrefixStore(self.run_id, self.store), rank=0, world_size=1,
                              bootstrap_store_info=RendezvousStoreInfo(HOST, self.store.port))

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # nobody else can join a one-node world

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self.closed, self.store = True, None
        return True


def _create(params: RendezvousParameters) -> LocalRendezvous:
    return LocalRendezvous(params.run_id, float(params.get("timeout", 900)))


rendezvous_handler_registry.register(BACKEND, _create)
