"""A process group started by hand with torch.multiprocessing.spawn, for comparison with
torchrun and ddp_exp's elastic launch.

    .venv/bin/python docs/examples/spawn_allreduce.py 3

mp.spawn only starts N copies of a function and passes each its index. Everything else is the
caller's job: choosing a port, setting MASTER_ADDR/MASTER_PORT, passing rank and world size to
init_process_group, and handling a failed process (mp.spawn stops the others and raises;
there are no restarts and no report naming the rank).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    # Racy: another program may take the port between close() and the rendezvous.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # every rank ends with the same sum
    for turn in range(world_size):  # print in rank order: one rank at a time
        if turn == rank:
            print(f"rank {rank} of {world_size}: all_reduce(SUM) of rank+1 = "
                  f"{value.item():.0f}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(worker, args=(n, free_port()), nprocs=n)
