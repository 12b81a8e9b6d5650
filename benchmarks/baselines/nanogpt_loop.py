"""A plain language-model DDP loop in the spirit of nanoGPT's ``train.py`` (issue 29's baseline).

What a user writes by hand: no framework, one screen of loop. Each rank memory-maps the token
file and draws ``batch`` random windows of ``block_size`` tokens per step from the training
region with its own generator (nanoGPT's ``get_batch``: ``torch.randint`` offsets, the next batch
fetched right after the forward), runs ``DDP(GPT)``, the mean cross-entropy over the window's
tokens, ``backward`` (DDP's all-reduce), clipping to 1.0 and AdamW at a warmup + cosine rate set
by hand every step; rank 0 reads the loss every ``LOG_EVERY_N_STEPS`` steps. The same model class
as ddp_exp's ``model=gpt`` (``ddp_exp.train.gpt.GPT``), the same shapes, per-rank batch,
optimizer settings and intra-op threads (``cores // world_size``) as the ddp_exp run it is paired
with (``benchmarks/groups/lm.py``); the windows differ (random offsets here, ddp_exp's shuffled
non-overlapping windows there), which changes no step's cost.

    python -m benchmarks.baselines.nanogpt_loop --data tokens.bin --val-start 418000 --world-size 2

Prints one line ``BENCH_RESULT {json}``: training tokens/s of the loop only (all ranks, rank 0's
loop time, as ddp_exp's ``train/tokens_per_sec``) as ``samples_per_sec`` (a token is a sample
here), the model FLOP/s (tokens/s x ``GPT.flops_per_token()``), wall seconds of this process,
peak RSS per rank, the last logged training loss and the validation loss of the same windows
ddp_exp evaluates (``--val-batches`` x batch windows from ``--val-start``, as ddp_exp's
``trainer.limit_val_batches``).
"""

import time

T0 = time.time()  # wall time from the first line, imports included

import argparse  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from benchmarks import common, workloads  # noqa: E402
from benchmarks.workloads import LOG_EVERY_N_STEPS, SEED  # noqa: E402
from ddp_exp.train.gpt import GPT  # noqa: E402  (the model class ddp_exp trains)


def learning_rate(it: int, w: dict, steps: int) -> float:
    """Linear warmup over the workload's warmup steps, then cosine down to ``min_lr`` at the
    last step."""
    warmup = workloads.lm_warmup_steps(steps)
    if it < warmup:
        return w["lr"] * (it + 1) / warmup
    progress = (it - warmup) / max(1, steps - 1 - warmup)
    return w["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (
        w["lr"] - w["min_lr"])


def rank_main(rank, world_size, port, args, w, threads, result_path):
    common.init_rank(rank, world_size, port, threads)
    data = np.memmap(args.data, dtype=np.uint16, mode="r")
    block, batch = w["block_size"], w["batch_size"]
    gen = torch.Generator().manual_seed(SEED + rank)  # each rank its own windows (nanoGPT)

    def get_batch():
        ix = torch.randint(args.val_start - block, (batch,), generator=gen).tolist()
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64))
                         for i in ix])
        return x, y

    torch.manual_seed(SEED)
    model = GPT((block,), w["vocab_size"], n_layer=w["n_layer"], n_head=w["n_head"],
                n_embd=w["n_embd"], dropout=0.0, bias=True)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=w["lr"], betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=w["weight_decay"])
    vocab, lossf = w["vocab_size"], None
    t = time.perf_counter()
    x, y = get_batch()
    for it in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(it, w, args.steps)
        logits = ddp(x)
        loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
        x, y = get_batch()  # the next batch while nothing waits for it (nanoGPT's prefetch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), w["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (it + 1) % LOG_EVERY_N_STEPS == 0 and rank == 0:
            lossf = loss.item()
    dist.barrier()  # rank 0's clock stops when every rank has finished its steps
    loop_s = time.perf_counter() - t
    tokens = args.steps * batch * block * world_size
    val_loss = evaluate(model, data, args.val_start, args.val_batches, w, rank, world_size)
    tokens_per_sec = tokens / loop_s
    common.write_result(rank, result_path, tokens, loop_s, lossf, val_loss, None,
                        tokens_per_sec=tokens_per_sec,
                        model_flops_per_sec=tokens_per_sec * model.flops_per_token())
    dist.destroy_process_group()


def evaluate(model, data, val_start: int, val_batches: int, w: dict, rank: int,
             world_size: int) -> float:
    """Mean cross-entropy per token over the first ``val_batches x batch_size`` validation
    windows from ``val_start`` (ddp_exp's capped validation), strided over the ranks; sums
    all-reduced once. Not timed."""
    block, vocab = w["block_size"], w["vocab_size"]
    starts = [val_start + p * block for p in range(val_batches * w["batch_size"])]
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for s in starts[rank::world_size]:
            row = torch.from_numpy(data[s:s + block + 1].astype(np.int64))
            logits = model(row[None, :-1])
            totals[0] += F.cross_entropy(logits.view(-1, vocab), row[1:], reduction="sum")
            totals[1] += block
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a .bin of uint16 tokens (nanoGPT's format)")
    p.add_argument("--val-start", type=int, required=True,
                   help="the first validation window's offset (ddp_exp's held-out tail); "
                        "training windows are drawn from the tokens before it")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="default: the workload's")
    p.add_argument("--val-batches", type=int, default=None,
                   help="validation windows / batch size; default: the workload's")
    p.add_argument("--start-method", choices=("spawn", "fork", "forkserver"), default="fork")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = p.parse_args()
    w = workloads.spec("lm")
    args.steps = args.steps or w["steps"]
    args.val_batches = args.val_batches or w["limit_val_batches"]
    threads = max(1, common.cores() // args.world_size)  # ddp_exp's rule
    result = common.run_world(rank_main, (args.world_size, common.free_port(), args, w,
                                          threads), args.world_size, args.start_method,
                              "nanogpt_loop")
    result.update(script="nanogpt_loop", workload="lm", world_size=args.world_size,
                  batch_size=w["batch_size"], steps=args.steps, threads_per_rank=threads,
                  start_method=args.start_method)
    result["wall_s"] = time.time() - T0
    common.emit(result, args.out)


if __name__ == "__main__":
    main()
