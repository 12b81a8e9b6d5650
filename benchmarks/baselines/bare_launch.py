"""Start-up cost (issue 5, workload 3): a bare 2-rank world that imports torch and initialises
gloo, and nothing else. Its wall time is the floor a 1-epoch ddp_exp job is compared against.

    python -m benchmarks.baselines.bare_launch [--launch mp-fork|mp-spawn|elastic] [--world-size 2]

``mp-fork`` / ``mp-spawn``: ``torch.multiprocessing.start_processes`` with a free port;
``elastic``: PyTorch's elastic launcher configured as ddp_exp configures it (c10d rendezvous on
``127.0.0.1:0``, fork, 0.05 s monitor interval). Each rank runs ``init_process_group("gloo")``,
one barrier, ``destroy_process_group()``. Prints ``BENCH_RESULT {json}`` with ``wall_s`` measured
inside the process from its first line (the runner also times the whole process from outside).

The ``startup`` group (``benchmarks/groups/startup.py``) times it against the 1-epoch digits
ddp_exp job at world_size 2, interleaved: ``make bench ARGS="--only startup"``.
"""

import time

T0 = time.time()

import torch  # noqa: E402, F401  (the bare launch imports torch: part of what is measured)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import common  # noqa: E402


def mp_rank(rank, world_size, port):
    common.set_rendezvous(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()


def elastic_rank():
    dist.init_process_group("gloo")  # env:// from the elastic agent
    dist.barrier()
    dist.destroy_process_group()


def launch_elastic(world_size: int) -> None:
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as logs:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                              run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                              rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                              monitor_interval=0.05, start_method="fork",
                              logs_specs=DefaultLogsSpecs(log_dir=logs))
        elastic_launch(config, elastic_rank)()


def main():
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", choices=("mp-fork", "mp-spawn", "elastic"), default="mp-fork")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.launch == "elastic":
        launch_elastic(args.world_size)
    else:
        mp.start_processes(mp_rank, args=(args.world_size, common.free_port()),
                           nprocs=args.world_size, join=True,
                           start_method=args.launch.removeprefix("mp-"))
    common.emit({"script": "startup", "launch": args.launch, "world_size": args.world_size,
                 "wall_s": time.time() - T0}, args.out)


if __name__ == "__main__":
    main()
