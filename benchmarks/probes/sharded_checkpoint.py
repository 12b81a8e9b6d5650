"""A sharded checkpoint written beside the loop: ddp_exp's writer thread against
``torch.distributed.checkpoint.async_save`` (issue 40 item 2).

    python -m benchmarks.probes.sharded_checkpoint             # the issue's GPT (~25M parameters)
    python -m benchmarks.probes.sharded_checkpoint --quick     # smoke test: a tiny GPT

Two gloo ranks (spawned), the GPT under FSDP2 (each block, then the root) after one AdamW step;
each rank then takes ``--repeats`` checkpoints of model + optimizer both ways, alternating:

* ``writer``: what the loop does (:mod:`ddp_exp.train.checkpointing`): snapshot this rank's
  shards (``get_state_dict``, tensors cloned) and hand ``dcp.save`` over a gloo side group to a
  :class:`ddp_exp.io.files.BackgroundWriter`;
* ``async_save``: ``dcp.async_save`` over the same kind of group (it stages, i.e. copies, the
  state on the caller's thread, then saves on its own thread).

Printed per way, medians over the repeats (rank 0): ``blocked_s``, the seconds the caller's
thread is held (what the loop would wait), and ``durable_s``, until every rank's file and the
metadata are on disk; then ``BENCH_RESULT {json}`` with the same (make bench's group
``sharded_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddp_exp.distributed.process_group import side_group
    from ddp_exp.io import checkpoint, sharded
    from ddp_exp.io.files import BackgroundWriter
    from ddp_exp.train.gpt import GPT

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT((args.block,), 256, n_layer=args.layers, n_head=args.heads,
                n_embd=args.width, block_size=args.block)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.fsdp_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (2, args.block))
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    side = side_group(600)
    writer = BackgroundWriter()
    times: dict[str, list[tuple[float, float]]] = {"writer": [], "async_save": []}
    for i in range(args.repeats):
        for way in ("writer", "async_save"):
            folder = os.path.join(out, f"{way}-{i}")
            dist.barrier()
            t0 = time.perf_counter()
            if way == "writer":
                tensors = checkpoint.snapshot(sharded.state_tensors(model, optimizer))
                writer.submit(lambda t=tensors, f=folder: sharded.write_shards(t, f, side.group))
                blocked = time.perf_counter() - t0
                writer.wait()
            else:
                future = dcp.async_save(sharded.state_tensors(model, optimizer),
                                        checkpoint_id=folder, process_group=side.group)
                blocked = time.perf_counter() - t0
                future.result()
            times[way].append((blocked, time.perf_counter() - t0))
    writer.close()
    dist.barrier()
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"GPT {n / 1e6:.1f}M parameters, AdamW, 2 gloo ranks, {args.repeats} checkpoints "
              "each way (medians):")
        result = {"parameters": n, "repeats": args.repeats}
        for way, rows in times.items():
            blocked = statistics.median(r[0] for r in rows)
            durable = statistics.median(r[1] for r in rows)
            print(f"  {way:10s} blocked_s {blocked:.3f}  durable_s {durable:.3f}")
            result[way] = {"blocked_s": blocked, "durable_s": durable}
        print("BENCH_RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 2 repeats")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.layers, args.width, args.heads, args.block = (2, 64, 2, 64) if args.quick else \
        (8, 512, 8, 128)
    if args.quick:
        args.repeats = 2
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, port, args, out), nprocs=2)


if __name__ == "__main__":
    main()
