"""Plumbing shared by the stand-alone benchmark scripts and the runner: the scripts' arguments,
a rank's process-group set-up, the world's start, the one validation pass, the result file and
the one JSON result line, peak RSS, the repository's paths.

The training loops are not here: each script keeps its own, written the way its kind of user
writes it, because the loops are what the benchmark compares. What is here is the same in every
script and is not timed (set-up, validation, results), or builds the same model for all of them.

May use: the standard library, torch, ``benchmarks.workloads`` (the settings of a workload).
Used by the scripts (``baselines/``, ``probes/``) and the runner (``harness/``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks import workloads

BENCH = os.path.dirname(os.path.abspath(__file__))  # benchmarks/
ROOT = os.path.dirname(BENCH)  # the repository
RESULT_PREFIX = "BENCH_RESULT "  # the runner reads the line that starts with this
EXIT_SKIPPED = 3  # an optional dependency is missing (lightning)
EVAL_BATCH = 512  # validation batch of every script


# ------------------------------------------------------------------------------ the command line
def parser(description: str, start_method: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--workload", choices=("digits", "compute"), default="digits")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="default: the workload's")
    p.add_argument("--batch-size", type=int, default=None, help="per rank; default: the workload's")
    p.add_argument("--num-train", type=int, default=None,
                   help="compute workload only: fewer training samples (quick runs)")
    p.add_argument("--start-method", choices=("spawn", "fork", "forkserver"),
                   default=start_method)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    return p


def job_config(args: argparse.Namespace, workload: str) -> dict:
    """The workload's settings (``workloads.spec``) with ``--epochs`` and ``--batch-size``
    (per rank) of the command line where given."""
    cfg = workloads.spec(workload, args.num_train)
    cfg["epochs"] = args.epochs or cfg["epochs"]
    cfg["batch_size"] = args.batch_size or cfg["batch_size"]
    return cfg


def cores() -> int:
    return len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------- the world and a rank
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rendezvous(port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


def init_rank(rank: int, world_size: int, port: int, threads: int | None = None) -> None:
    """Join the gloo world on ``127.0.0.1:port`` as ``rank``; ``threads``: this rank's intra-op
    threads (None: leave torch's default, one per core)."""
    set_rendezvous(port)
    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def run_world(rank_fn, rank_args: tuple, world_size: int, start_method: str, name: str) -> dict:
    """Start ``world_size`` processes of ``rank_fn(rank, *rank_args, result_path)`` with
    ``torch.multiprocessing`` and wait for them; returns what rank 0 wrote to ``result_path``
    (:func:`write_result`). Raises SystemExit(1) when rank 0 wrote nothing."""
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        path = os.path.join(tmp, "rank0.json")
        mp.start_processes(rank_fn, args=(*rank_args, path), nprocs=world_size, join=True,
                           start_method=start_method)
        return read_partial(path)


def read_partial(path: str) -> dict:
    """Rank 0's result file (the parent adds the process-level figures)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        print("error: rank 0 wrote no result", file=sys.stderr)
        raise SystemExit(1) from None


# ------------------------------------------------------------------------- model and validation
def mlp(in_features: int, hidden: list[int], num_classes: int) -> nn.Sequential:
    """ddp_exp's ``model=mlp`` without dropout: Flatten, then Linear + ReLU per hidden width, then
    Linear to ``num_classes``; ``[B, ...] -> [B, num_classes]``. Unseeded: the caller seeds."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def val_shard(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int):
    """This rank's strided, unpadded shard of the validation set in batches of ``EVAL_BATCH``:
    ``(x[B, ...], y[B])`` pairs; the shards of all ranks cover every sample once."""
    xs, ys = x[rank::world_size], y[rank::world_size]
    return ((xs[s:s + EVAL_BATCH], ys[s:s + EVAL_BATCH]) for s in range(0, len(xs), EVAL_BATCH))


def evaluate(model: nn.Module, batches) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over the ``(x, y)`` batches of every rank: the sums are
    all-reduced once (a collective: every rank calls it). Not timed by any script."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for xb, yb in batches:
            out = model(xb)
            totals[0] += F.cross_entropy(out, yb, reduction="sum").double()
            totals[1] += (out.argmax(1) == yb).sum()
            totals[2] += len(yb)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# ------------------------------------------------------------------------------------- results
def peak_rss_mib() -> float:
    """This process's peak resident set (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def result(samples: int, loop_s: float, train_loss: float | None, val_loss: float | None,
           val_accuracy: float | None, **extra) -> dict:
    """The figures every script reports: ``samples`` of all ranks over rank 0's ``loop_s``
    seconds in the training loop, the last losses, and ``extra``."""
    return {"samples_per_sec": samples / loop_s, "train_s": loop_s, "train_samples": samples,
            "train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_accuracy,
            **extra}


def write_result(rank: int, path: str, samples: int, loop_s: float, train_loss: float | None,
                 val_loss: float | None, val_accuracy: float | None, **extra) -> None:
    """A collective (every rank calls it): the peak RSS is max-reduced over the ranks, and rank 0
    writes :func:`result` with its own and the ranks' peak RSS to ``path``."""
    rss = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(result(samples, loop_s, train_loss, val_loss, val_accuracy, **extra,
                             peak_rss_mib_rank0=peak_rss_mib(),
                             peak_rss_mib_per_rank=rss.item()), fh)


def finish(res: dict, t0: float, args: argparse.Namespace, cfg: dict, script: str,
           **extra) -> None:
    """Add the job's settings (``extra`` wins over them) and this process's wall seconds since
    ``t0`` to rank 0's result and :func:`emit` it."""
    res.update(script=script, workload=args.workload,
               world_size=args.world_size, batch_size=cfg["batch_size"], epochs=cfg["epochs"],
               start_method=args.start_method)
    res.update(extra)
    res["wall_s"] = time.time() - t0
    emit(res, args.out)


def emit(res: dict, out: str | None) -> None:
    line = json.dumps(res, sort_keys=True)
    print(RESULT_PREFIX + line, flush=True)
    if out:
        with open(out, "w") as fh:
            fh.write(line + "\n")
