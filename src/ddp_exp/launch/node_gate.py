"""The nodes of a static-rendezvous world meet before their ranks start, and hear of a node
that failed before then.

torch's static rendezvous (``torchrun --node-rank``; every cluster job here:
:mod:`ddp_exp.launch.cluster`) waits in C++ for the other nodes' agents for up to its timeout.
A node whose launcher failed before its agent started (its data missing, its model refused, a
file race) is never heard from: the other nodes waited ``launcher.rdzv_timeout_s`` (900 s by
default) and then said only that the rendezvous had timed out (seen: node 1 of a slurm_local
job ended 0.7 s after its start and node 0 waited for it). torchrun has the same wait.

:class:`NodeGate` meets the nodes first, in Python, over a ``TCPStore`` on the rendezvous
endpoint that node 0 serves from before it builds the world (``multi_tenant``: its agent's
static rendezvous then shares that server, and the ranks reach it as before); the other nodes
connect to it from their start, in a thread, while they build theirs. Each node says, once its
world is built, that it is ready (:meth:`NodeGate.wait_for_every_node`, which returns when all
are) or why it failed (:meth:`NodeGate.announce_failure`). A node that hears of a failure ends
at once with :class:`NodeFailed`, naming the node and its line, instead of waiting.

Bounds: the wait for every node is ``launcher.rdzv_timeout_s`` from the gate's opening, as the
agent's. A failed node 0 stays, for at most :data:`NOTICE_S`, until the nodes connected to it
have heard, and until :data:`ARRIVAL_S` after its start for those not connected yet (nodes
started together connect within seconds; a node alone, with a typo, ends that much later, and
says why); a node that comes after that finds no server and waits, as before, until its
timeout. Another failed node waits at most :data:`NOTICE_S` for node 0's server.

May use: torch.distributed, :mod:`ddp_exp.config.errors`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

from omegaconf import DictConfig

from ddp_exp.config.errors import ConfigError, described, first_line

log = logging.getLogger("ddp_exp")

PREFIX = "ddp_exp/node_gate/"
PRESENT, READY, DONE = PREFIX + "present", PREFIX + "ready", PREFIX + "done"
FAILURES = PREFIX + "failures"
NOTICE_S = 30.0  # how long a failed node waits to tell the others (seconds)
ARRIVAL_S = 10.0  # a failed node 0 waits for unconnected nodes until this long after its start
POLL_S = 0.05  # between two looks at the store (seconds)


class NodeFailed(ConfigError):
    """Another node of the world failed before its ranks started; the message names it and
    says its line (``node 1 of 2 failed before its ranks started: <its line>``)."""


def gate_for(la: DictConfig) -> NodeGate | None:
    """The gate of this launcher (``cfg.launcher``): one for a world of several nodes meeting
    at a static rendezvous, None otherwise (one node; c10d, whose store any node may host)."""
    if la.nnodes <= 1 or la.rdzv_backend != "static":
        return None
    return NodeGate(la.rdzv_endpoint, la.node_rank, la.nnodes, la.rdzv_timeout_s)


class NodeGate:
    """Node ``node_rank`` of ``nnodes`` at the gate on ``endpoint`` (``HOST:PORT``).

    Node 0 serves the gate's store from construction until :meth:`close`; the others connect
    from construction on, in a daemon thread (``TCPStore`` waits without the GIL). Keys
    (under :data:`PREFIX`): the counters ``present`` (other nodes connected), ``ready``,
    ``done`` (other nodes that failed or heard of a failure) and ``failures``, and
    ``failed/<node>`` (that node's line).

    Raises (construction, node 0):
        torch.distributed.DistNetworkError: the endpoint's port is taken on this host.
    """

    def __init__(self, endpoint: str, node_rank: int, nnodes: int, timeout_s: float):
        self.host, _, port = endpoint.rpartition(":")
        self.port, self.node_rank, self.nnodes = int(port), node_rank, nnodes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.opened = time.monotonic()
        self.deadline = self.opened + timeout_s
        self.passed = False  # every node was ready: the agents meet from here
        self.store = None
        self._closed = False  # set by close(): a connection made after it is dropped at once
        self._connecting: threading.Thread | None = None
        self._connect_error: Exception | None = None
        if node_rank == 0:
            from torch.distributed import TCPStore

            self.store = TCPStore(self.host, self.port, None, True, self.timeout,
                                  wait_for_workers=False, multi_tenant=True)
        else:
            self._connecting = threading.Thread(target=self._connect, daemon=True,
                                                name="ddp_exp-node-gate")
            self._connecting.start()

    def _connect(self) -> None:
        """(The thread) connect to node 0's store, waiting up to the timeout for it."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.host, self.port, None, False, self.timeout,
                             wait_for_workers=False)
            store.add(PRESENT, 1)
            if not self._closed:  # else: dropped here, in this thread, with its last reference
                self.store = store
        except Exception as exc:  # DistError: node 0 did not come within the timeout
            self._connect_error = exc

    def _connected(self, within_s: float) -> bool:
        """Whether this node reaches node 0's store, waiting up to ``within_s`` for it."""
        if self._connecting is not None:
            self._connecting.join(max(within_s, 0.0))
        return self.store is not None

    def _failure(self) -> str | None:
        """The first other node's failure line, as :class:`NodeFailed` says it; None yet."""
        if self.store.add(FAILURES, 0) == 0:
            return None
        for node in range(self.nnodes):
            key = f"{PREFIX}failed/{node}"
            if node != self.node_rank and self.store.check([key]):
                return (f"node {node} of {self.nnodes} failed before its ranks started: "
                        f"{self.store.get(key).decode()}")
        return None

    def wait_for_every_node(self) -> None:
        """This node's world is built: say so, and return once every node has.

        Raises:
            NodeFailed: another node failed before its ranks started.
            torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: not every node
                was ready within ``launcher.rdzv_timeout_s`` of the gate's opening.
            torch.distributed.DistError: node 0's store cannot be reached (or went away).
        """
        from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

        if not self._connected(self.deadline - time.monotonic()):
            raise self._connect_error or RendezvousTimeoutError(
                f"node 0's gate at {self.host}:{self.port} did not answer")
        self.store.add(READY, 1)
        while self.store.add(READY, 0) < self.nnodes:
            failure = self._failure()
            if failure is not None:
                self.store.add(DONE, 1)  # heard: node 0 need not wait for this node
                raise NodeFailed(failure)
            if time.monotonic() > self.deadline:
                raise RendezvousTimeoutError(
                    f"{self.store.add(READY, 0)} of {self.nnodes} nodes ready at the gate")
            time.sleep(POLL_S)
        self.passed = True

    def announce_failure(self, line: str) -> None:
        """Tell the other nodes that this one failed before its ranks started (``line``: its
        error, one line). Node 0 then waits up to :data:`NOTICE_S` for the nodes connected to
        it to hear it (a node that failed too counts); another node waits up to that long for
        node 0's store. Never raises: the node's own error is what it reports."""
        from torch.distributed import DistError

        if not self._connected(min(NOTICE_S, self.deadline - time.monotonic())):
            return  # node 0 never came up: nobody to tell
        try:
            self.store.set(f"{PREFIX}failed/{self.node_rank}", line)
            self.store.add(FAILURES, 1)
            if self.node_rank > 0:
                self.store.add(DONE, 1)
                return
            until = time.monotonic() + NOTICE_S
            told = False
            while time.monotonic() < until:
                done, present = self.store.add(DONE, 0), self.store.add(PRESENT, 0)
                if done >= self.nnodes - 1 or (
                        done >= present and time.monotonic() >= self.opened + ARRIVAL_S):
                    break
                if not told:
                    log.warning("telling the other node(s) that this node failed (up to %g s)",
                                NOTICE_S)
                    told = True
                time.sleep(POLL_S)
        except DistError:  # node 0 went away: nobody left to tell
            pass

    def close(self) -> None:
        """Drop this node's store (node 0: its server, once no other user of it is left); a
        connection the thread makes afterwards is dropped as it is made."""
        self._closed = True
        self.store = None


def failure_line(exc: BaseException) -> str:
    """A launcher's error as one line for the other nodes: a refusal's message, else
    ``<type>: <first line>``."""
    if isinstance(exc, ConfigError):
        return first_line(exc)
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by SIGINT"
    return described(exc)
