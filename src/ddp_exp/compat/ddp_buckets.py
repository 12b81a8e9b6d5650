"""DDP's gradient bucket laid out once, so that a same-world resume at 3 or more ranks is
bit-identical to the run never stopped (issue 41 item 4).

Why they differed (measured here, torch 2.13, gloo): DDP lays its buckets out twice. The
constructor packs the parameters in registration order (``net.1.weight, net.1.bias, ...``);
after the first iteration the reducer rebuilds the buckets in the order the gradients became
ready (the reverse). Gloo's ring all-reduce cuts a bucket into one chunk per rank and sums each
chunk starting from another rank, so an element's sum ``g0 + g1 + g2`` is taken in an order set
by its offset in the bucket. An uninterrupted run takes its first step with the first layout
and every later step with the second; a resumed run takes its first step after the checkpoint
with the first layout, where the uninterrupted run used the second: the same three gradients
summed in another order, ~1e-8 apart (weights ~3e-8 after an epoch of digits). With 2 ranks
``g0 + g1 == g1 + g0`` exactly, so 1 and 2 ranks were bit-identical already.

:func:`lay_out_buckets_once` has the reducer rebuild its buckets at once, before the first step,
from the parameters in registration order, so that every step of every run (fresh or resumed)
uses one layout. Done only where the gradients fit in one bucket (digits' MLP and CNN: 38 KB
against DDP's first-bucket cap of 1 MiB): there, the order within the bucket changes nothing
else. With several buckets the rebuild would put the first layers' bucket first, which is ready
last in the backward pass, and lose the overlap of all-reduce with backward; those models keep
torch's two layouts (docs/checkpoints.md says what that costs a resume at 3+ ranks).

Borrowed internals: the reducer's ``_push_all_rebuilt_params`` and ``_rebuild_buckets`` (what
DDP's own ``Join`` hook and forward call), and ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddp_exp.compat.versions import written_for


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of the gradients DDP reduces: every parameter that requires a gradient."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def lay_out_buckets_once(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Rebuild ``ddp``'s buckets now, in registration order, where its gradients fit in one
    bucket and torch would rebuild them after the first iteration (not with
    ``find_unused_parameters`` or ``static_graph``, whose first iteration does its own
    bookkeeping). Returns True when it did; False leaves torch's behaviour (another torch
    version, several buckets, those options)."""
    if ddp.find_unused_parameters or ddp.static_graph:
        return False
    cap = min(ddp.bucket_bytes_cap, dist._DEFAULT_FIRST_BUCKET_BYTES)
    if gradient_bytes(ddp.module) > cap:
        return False
    if not written_for("torch", "DDP's reducer rebuild (_push_all_rebuilt_params)",
                       "the first step after a resume may sum 3+ ranks' gradients in another "
                       "order (~1e-8)"):
        return False
    ddp.reducer._push_all_rebuilt_params()
    return bool(ddp.reducer._rebuild_buckets())
