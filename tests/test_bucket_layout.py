"""A same-world resume at 3 ranks is bit-identical (issue 41 item 4;
:mod:`ddp_exp.compat.ddp_buckets`).

It differed by ~1e-8 per step (weights 3e-8 after an epoch of digits) where 1 and 2 ranks were
bit-identical: DDP rebuilds its bucket after the first iteration in another order, gloo's ring
sums each element of 3 ranks' gradients in an order set by its offset in the bucket, and the
resumed run's first step used the constructor's layout where the run never stopped used the
rebuilt one. Held here without the CLI: 3 gloo ranks train 6 SGD steps with one DDP object, and
3 steps, then 3 with a new DDP object (what a resume makes) from the same weights and momentum.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

SCRIPT = r'''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_exp.compat.ddp_buckets import lay_out_buckets_once
from ddp_exp.train.models import MLP

def ddp(model, rebuilt):
    d = DDP(model)
    rebuilt.append(lay_out_buckets_once(d))
    return d

def steps(d, opt, rank, ks):
    for k in ks:
        g = torch.Generator().manual_seed(1000 * k + rank)
        x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(d(x), y).backward()
        opt.step()

def new_model(state=None):
    torch.manual_seed(0)
    m = MLP(input_shape=(1, 8, 8), num_outputs=10, hidden_sizes=[128])
    if state is not None:
        m.load_state_dict(state)
    return m

def work(rank, ws, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    rebuilt = []
    m = new_model(); opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    steps(ddp(m, rebuilt), opt, rank, range(6))
    m2 = new_model(); opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    steps(ddp(m2, rebuilt), opt2, rank, range(3))
    m3 = new_model(m2.state_dict()); opt3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    opt3.load_state_dict(opt2.state_dict())
    steps(ddp(m3, rebuilt), opt3, rank, range(3, 6))
    if rank == 0:
        torch.save({"full": m.state_dict(), "resumed": m3.state_dict(), "rebuilt": rebuilt}, out)
    dist.destroy_process_group()

if __name__ == "__main__":
    # fork: the parent has run no torch computation (ddp_exp's rule for forked ranks)
    mp.start_processes(work, args=(3, int(sys.argv[1]), sys.argv[2]), nprocs=3,
                       start_method="fork")
'''


@pytest.mark.slow
def test_a_new_ddp_object_at_3_ranks_continues_bit_for_bit(tmp_path):
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, script = tmp_path / "weights.pt", tmp_path / "resume_at_3.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(port), str(out)], timeout=240,
                          capture_output=True, text=True, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out, weights_only=True)
    assert saved["rebuilt"] == [True, True, True]
    for name, full in saved["full"].items():
        assert torch.equal(full, saved["resumed"][name]), name


def test_several_buckets_keep_torchs_layouts():
    """A model whose gradients exceed one bucket keeps torch's rebuild (the overlap of
    all-reduce with backward); so do find_unused_parameters and static_graph."""
    from types import SimpleNamespace

    from ddp_exp.compat.ddp_buckets import gradient_bytes, lay_out_buckets_once

    big = torch.nn.Linear(1024, 512)  # 2 MiB of float32 gradients
    assert gradient_bytes(big) == (1024 * 512 + 512) * 4
    fake = SimpleNamespace(find_unused_parameters=False, static_graph=False, module=big,
                           bucket_bytes_cap=25 * 2**20)
    assert lay_out_buckets_once(fake) is False
    small = torch.nn.Linear(8, 2)
    assert lay_out_buckets_once(SimpleNamespace(find_unused_parameters=True, static_graph=False,
                                                module=small, bucket_bytes_cap=2**20)) is False


def test_contract_torchs_reducer_has_what_the_layout_uses():
    import torch.distributed as dist

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert hasattr(dist.Reducer, "_push_all_rebuilt_params")
    assert hasattr(dist.Reducer, "_rebuild_buckets")
