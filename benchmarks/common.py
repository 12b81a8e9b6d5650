"""Plumbing shared by the stand-alone benchmark scripts: arguments, rendezvous port, the one
JSON result line, peak RSS. No training code lives here (each script has its own loop)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))  # benchmarks/
ROOT = os.path.dirname(BENCH)  # the repository
RESULT_PREFIX = "BENCH_RESULT "  # the runner reads the line that starts with this
EXIT_SKIPPED = 3  # an optional dependency is missing (lightning)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rendezvous(port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)


def peak_rss_mib() -> float:
    """This process's peak resident set (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cores() -> int:
    return len(os.sched_getaffinity(0))


def emit(result: dict, out: str | None) -> None:
    line = json.dumps(result, sort_keys=True)
    print(RESULT_PREFIX + line, flush=True)
    if out:
        with open(out, "w") as fh:
            fh.write(line + "\n")


def read_partial(path: str) -> dict:
    """Rank 0's result file (the parent adds the process-level figures)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        print("error: rank 0 wrote no result", file=sys.stderr)
        raise SystemExit(1) from None
