"""One rank's life: signals, logging, threads, the process group, the loop, clean shutdown.

:func:`run_rank` is the module-level function the elastic launcher starts ``world_size`` times;
it receives the already composed config as plain data (:class:`RankInputs`), never ``sys.argv``,
so a rank can neither re-compose the config, nor make its own output folder, nor start a sweep.

Uses the loop (:mod:`ddp_exp.train.loop`, :mod:`ddp_exp.train.state`), :mod:`ddp_exp.io.checkpoint`,
:mod:`ddp_exp.metrics.writer`, :mod:`ddp_exp.distributed.process_group`,
:mod:`ddp_exp.train.objective`, :mod:`ddp_exp.data`,
:mod:`ddp_exp.config`, :mod:`ddp_exp.rank.failures` (a failed rank, a restart's line),
:mod:`ddp_exp.rank.logs` (the rank's log lines), :mod:`ddp_exp.rank.parent` (it ends with its
launcher) and :mod:`ddp_exp.compat.elastic_agent`'s
gate for forked ranks; the launcher starts it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_exp.compat import elastic_agent as agent
from ddp_exp.config.errors import ConfigError, described
from ddp_exp.config.view import RankConfig, rank_config
from ddp_exp.data import Datasets
from ddp_exp.distributed.process_group import (
    World,
    all_reduce_max,
    destroy_process_group,
    device_for,
    init_process_group,
    peak_rss_mb,
    rss_mb,
    threads_per_rank,
)
from ddp_exp.io import checkpoint
from ddp_exp.io.console import protect_console
from ddp_exp.io.files import naming_the_disk
from ddp_exp.metrics.trackers import TrackerPlan, open_trackers
from ddp_exp.metrics.writer import MetricsWriter, flatten_hparams, recipe_hparam_metrics
from ddp_exp.rank import parent, preemption, stacks
from ddp_exp.rank.failures import (
    PEER_FAILURE_GRACE_S,
    exit_is_a_failure,
    is_peer_failure,
    restart_line,
)
from ddp_exp.rank.logs import configure_logging
from ddp_exp.train import state as train_state
from ddp_exp.train.loop import Trainer
from ddp_exp.train.objective import Objective
from ddp_exp.train.step_checkpoint import Preempted

log = logging.getLogger("ddp_exp")


@dataclass
class RankInputs:
    """Everything a rank needs, as picklable data built once by the launching process.

    Attributes:
        cfg: the resolved config (``OmegaConf.to_container(cfg, resolve=True)``): the
            stored and transmitted form; the rank reads its typed view
            (:func:`ddp_exp.config.view.rank_config`, built once in :func:`run_rank`).
        job_dir: absolute path of the job's output folder (rank 0 writes there).
        log_file: the job's log file to append to, or None.
        device: the resolved device type, ``cpu`` or ``cuda`` (rank ``r`` on
            ``cuda:LOCAL_RANK``).
        backend: the resolved process-group backend (``gloo`` or ``nccl``).
        datasets: the train/validation split.
        model: the seeded, unwrapped model.
        objective: the training loss and validation metrics.
        hparams: flat hyper-parameters for TensorBoard's HParams dashboard.
        t_start: ``time.time()`` when the job started, for ``time/total_s``.
        trackers: the ``logger`` group's trackers that rank 0 feeds (None: TensorBoard only).
    """

    cfg: dict[str, Any]
    job_dir: str
    log_file: str | None
    device: str
    backend: str
    datasets: Datasets
    model: nn.Module
    objective: Objective
    hparams: dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.time)
    trackers: TrackerPlan | None = None


def set_threads(world: World, num_workers: int = 0) -> int:
    """Set this rank's intra-op threads (see
    :func:`ddp_exp.distributed.process_group.threads_per_rank`)."""
    threads = threads_per_rank(world.local_world_size, num_workers)
    torch.set_num_threads(threads)
    return threads


def train_rank(inputs: RankInputs, world: World, threads: int, cfg: RankConfig
               ) -> dict[str, Any] | None:
    """Run the loop on this rank (process group already up); rank 0 writes the outputs.

    Args:
        cfg: the typed view of ``inputs.cfg`` (:func:`ddp_exp.config.view.rank_config`).

    Returns:
        The final metrics on rank 0 (as written to ``metrics.json``), None on other ranks;
        on every rank :func:`ddp_exp.rank.preemption.stopped` when the loop stopped for a
        preemption (``trainer.preempt_signal``).
    """
    device = device_for(inputs.device, world.local_rank)
    data = inputs.datasets
    global_batch = cfg.global_batch_size
    n_train = len(data.train)
    padded = -n_train % world.world_size
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    source = checkpoint.find_resume(inputs.job_dir, cfg.trainer.resume, attempt > 0)
    state = checkpoint.load(source, map_location=device) if source else None
    if attempt > 0 and world.is_main:
        # torchrun's --max-restarts where torchrun started the world
        limit = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", cfg.launcher.max_restarts))
        log.warning("%s", restart_line(attempt, limit, source, state))
    # A world of another size than the checkpoint's (a node left or joined, a requeued job on
    # other nodes) is said in one line where the run is prepared (launch.build).
    worlds = preemption.world_sizes(inputs.job_dir, world.world_size, state, world.is_main)
    log.info("world: %d rank(s) x %d thread(s), backend %s, device %s; global batch %d "
             "(%d per rank x %d accumulated); %d training / %d validation samples",
             world.world_size, threads, inputs.backend, device.type, global_batch,
             cfg.data.batch_size, cfg.trainer.accumulate_grad_batches, n_train,
             len(data.val))
    if global_batch > n_train and world.is_main:  # world_size=100 at the default batch
        log.warning("the global batch of %d is larger than the %d training samples: each "
                    "optimizer step takes the whole training set (%d per rank), not %d "
                    "(data.global_batch_size, or fewer ranks)", global_batch, n_train,
                    -(-n_train // world.world_size), global_batch)
    if padded:
        log.info("training set of %d is not divisible by %d ranks: DistributedSampler repeats "
                 "%d sample(s) per epoch, which count zero: each of the %d samples counts once",
                 n_train, world.world_size, padded, n_train)
    test_metrics = (["loss", *inputs.objective.metrics]
                    if data.test is not None and len(data.test) else [])
    writer = MetricsWriter(inputs.job_dir, inputs.hparams, enabled=world.is_main,
                           purge_step=state["global_step"] + 1 if state else None,
                           recipe_metrics=recipe_hparam_metrics(cfg.trainer.monitor,
                                                                test_metrics),
                           trackers=open_trackers(inputs.trackers, inputs.hparams, world.is_main,
                                                  state["global_step"] + 1 if state else None))
    try:
        if data.standardization is not None:  # what a user must apply to new inputs
            writer.write_json("standardization.json", data.standardization)
        classes = getattr(data.train, "classes", None)
        if classes:  # the names of labels 0..C-1 (a file's string labels, sorted)
            writer.write_json("classes.json", {"classes": list(classes),
                                               "rule": "label i is classes[i]"})
        # The loop listens for a preemption only where trainer.preempt_signal is on (its
        # checks then decide at once: a stop within one logging interval).
        watch = preemption.signal_number(cfg.trainer.preempt_signal,
                                         cfg.launcher.cluster) is not None
        trainer = Trainer(cfg, world, data, inputs.model, inputs.objective, device, writer,
                          preempt_requested=preemption.requested if watch else None)
        if state is not None:
            train_state.load_state_dict(trainer, state, source)
        try:
            final = trainer.fit()
        except Preempted:  # every rank, after the same step; rank 0 wrote the checkpoint
            return preemption.stopped(trainer.global_step, os.path.join(
                checkpoint.checkpoint_dir(inputs.job_dir), checkpoint.LAST))
        now = rss_mb()  # after the last validation, before model.pt's gather
        peak = all_reduce_max(torch.tensor(  # getrusage's peak can lag VmRSS by a few pages
            [max(peak_rss_mb(), now or 0.0), trainer.strategy.state_mb(trainer.optimizer),
             -1.0 if now is None else now], dtype=torch.float64, device=device))
        final.update({
            "perf/max_rss_mb": float(peak[0]),  # the largest peak over the ranks
            # the largest resident memory at the end of training (steady state), MiB
            "perf/rss_mb": float(peak[2]) if peak[2] >= 0 else None,
            # parameters + gradients + optimizer state, MiB, the largest over the ranks
            "perf/state_mb_per_rank": float(peak[1]),
            "strategy": trainer.strategy.name,
            "world_size": world.world_size,
            "batch_size": cfg.data.batch_size,
            "global_batch_size": global_batch,
            "threads_per_rank": threads,
            "backend": inputs.backend,
            "device": inputs.device,
            "time/total_s": time.time() - inputs.t_start,
            "restarts": attempt,  # torch elastic's restarts of this world (issue 30)
            "world_sizes": worlds,  # the world sizes this run trained at, in order
        })
        writer.finish(final, trainer.strategy.model_state())  # a collective under FSDP
    finally:
        writer.close()
    if world.is_main:
        log.info("wrote %s", os.path.join(inputs.job_dir, "metrics.json"))
        return final
    return None


# Settings each node may set its own way: how it joins (launcher.*: the rendezvous checks what
# must agree, and a host may be named differently from each node), how it reports, how many
# loader workers it runs, and where its copy of the data lives (its content is compared).
NODE_LOCAL_KEYS = ("launcher.", "print_config", "trainer.progress", "data.num_workers",
                   "data.persistent_workers", "data.prefetch_factor", "data.pin_memory",
                   "data.path")


def check_nodes_agree(inputs: RankInputs, world: World) -> None:
    """Every node of a multi-node world composed its own config and built its own data: check,
    with one ``all_gather_object``, that all ranks hold what rank 0 holds (the resolved config
    but the node-local keys of ``NODE_LOCAL_KEYS``, and the data's sizes and CRC-32). Nodes
    started with different overrides would otherwise train different models under one DDP
    world, or abort in gloo.

    Raises:
        ConfigError: on every rank, naming the first keys that differ from rank 0.
    """
    import torch.distributed as dist

    mine = {k: v for k, v in flatten_hparams(inputs.cfg).items()
            if not k.startswith(NODE_LOCAL_KEYS)}
    data = inputs.datasets.fingerprint()
    mine.update(data)
    everyone: list[Any] = [None] * world.world_size
    dist.all_gather_object(everyone, mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        differ = sorted((k for k in reference.keys() | theirs.keys()
                         if reference.get(k) != theirs.get(k)),
                        key=lambda k: (k in data, k))  # the config's keys first: the cause
        if differ:
            shown = ", ".join(f"{k}={theirs.get(k)!r} (rank 0: {reference.get(k)!r})"
                              for k in differ[:3])
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise ConfigError(f"the nodes disagree: rank {rank} has {shown}{more}; start every "
                              "node with the same overrides and data")


@record
def run_rank(inputs: RankInputs) -> dict[str, Any] | None:
    """Entry point of one rank started by the elastic launcher (env ``RANK``, ``WORLD_SIZE``...).

    ``@record`` hands an uncaught error to PyTorch's elastic error reporting, which names the
    failing rank in the launcher's summary.
    """
    # The launcher's death, whatever its signal (SIGKILL too), ends this rank at once; a
    # launcher already gone ends it now (ddp_exp.rank.parent).
    parent.end_with_launcher(parent.launcher_from_env())
    protect_console()  # a rank started by spawn: its console can fail nothing (ddp_exp.io.console)
    # SIGINT/SIGTERM end the rank at once from here, and every rank is forked before any
    # connects (a lock held at fork): ddp_exp.compat.elastic_agent.
    agent.pass_fork_gate()
    # Where this rank is, on the launcher's request: a peer's collective timed out waiting.
    stacks.listen()
    # The scheduler's warning (trainer.preempt_signal) notes a stop for the loop's next check.
    # The typed view of the config, built once; the dict stays inputs.cfg (the stored form).
    cfg = rank_config(inputs.cfg)
    preemption.install(preemption.signal_number(cfg.trainer.preempt_signal, cfg.launcher.cluster))
    world = World.from_env()
    configure_logging(world.rank, inputs.log_file)
    threads = set_threads(world, cfg.data.num_workers)
    # Under spawn/forkserver torch.multiprocessing hands the model over in shared memory: every
    # rank would step the same parameters (lr x world_size, racy). Each rank owns a copy.
    # Under strategy=fsdp the rank only reads it (its shards are slices of it): no copy.
    if cfg.strategy.name != "fsdp":
        inputs = dataclasses.replace(inputs, model=copy.deepcopy(inputs.model))
    init_process_group(inputs.backend, world, cfg.distributed.timeout_s, inputs.device)
    try:
        if cfg.launcher.nnodes > 1:
            check_nodes_agree(inputs, world)
        with exit_is_a_failure():  # sys.exit in the user's code: this rank failed
            return train_rank(inputs, world, threads, cfg)
    except Exception as exc:
        if is_peer_failure(exc):
            # Our collective broke because another rank died first. Exit after it, so that the
            # launcher reports that rank's error as the root cause (it stops us when it sees it).
            time.sleep(PEER_FAILURE_GRACE_S)
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < cfg.launcher.max_restarts:
            # the agent restarts the world and raises nothing: say why here
            log.error("rank %d failed: %s", world.rank, described(exc))
        named = naming_the_disk(exc, inputs.job_dir)
        if named is not exc:
            raise named from exc
        raise
    finally:
        destroy_process_group()
