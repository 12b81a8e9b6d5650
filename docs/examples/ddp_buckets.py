"""Count the gradient all-reduces DDP makes inside backward, and what no_sync() does to them.

    .venv/bin/torchrun --standalone --nproc_per_node=2 docs/examples/ddp_buckets.py 25
    .venv/bin/torchrun --standalone --nproc_per_node=2 docs/examples/ddp_buckets.py 0.001

The argument is DDP's ``bucket_cap_mb`` (ddp_exp: ``ddp.bucket_cap_mb``). A communication hook
sees every bucket DDP hands to the process group during backward; it counts them and then does
what DDP does by default (``allreduce_hook``: all-reduce SUM, divide by world_size).
"""

import gc
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_exp.models import MLP

dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
torch.set_num_threads(1)
cap = float(sys.argv[1])
buckets = []


def counting_hook(state, bucket):  # runs inside backward, once per bucket whose grads are ready
    buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
    return allreduce_hook(state, bucket)


torch.manual_seed(0)
ddp = DDP(MLP((1, 8, 8), 10), bucket_cap_mb=cap)  # the digits MLP: 9,610 float32 parameters
ddp.register_comm_hook(None, counting_hook)
x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
for _ in range(3):  # DDP re-forms its buckets in gradient-ready order after the first step
    buckets.clear()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
synced = list(buckets)
buckets.clear()
with ddp.no_sync():  # forward *and* backward inside no_sync, as ddp_exp's Trainer._step does
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
if dist.get_rank() == 0:
    print(f"bucket_cap_mb={cap}: backward all-reduced {len(synced)} bucket(s) of {synced} bytes;"
          f" under no_sync: {len(buckets)}")
# Free the DDP object (its reducer holds the Python hook) before leaving the group; left to
# interpreter shutdown, a rank sometimes aborted with "terminate called without an active
# exception" on this machine.
del ddp
gc.collect()
dist.barrier()
dist.destroy_process_group()
