"""torch 2.13's private tensor and module internals: ``torch._foreach_norm``, the module a
``torch.compile`` wrapper holds (``OptimizedModule._orig_mod``) and autograd's end-of-backward
queue (``Variable._execution_engine.queue_callback``).

* :func:`tensor_norms` is kept (issue 27 item 3) for time, not for a fault: it is the per-step
  fast path of ``train/grad_norm`` and gradient clipping (one fused op where the gradients share
  a device and dtype, as ``torch.nn.utils.clip_grad_norm_`` does; 39 us a call against 59 us for
  one ``vector_norm`` per tensor on the digits MLP, ~3 % of its CPU step, measured in session
  34; on CUDA one kernel instead of one per tensor). The value is the same either way.
* :func:`compiled_original` is kept because it prevents a visible traceback: a model the user's
  own ``_target_`` returns compiled (``torch.compile(net)``) would be passed an
  ``attention_mask`` its ``forward`` does not take (``TypeError``), its wrapper's signature
  being ``(*args, **kwargs)``.

* :func:`backward_end_queue` is kept because it prevents a wrong number: the throughput split of
  ``metrics/perf`` (compute vs gradient sync) stamps the moment every gradient is ready, which
  only autograd's engine knows (DDP queues its own finalize the same way); stamped at the last
  parameter's hook instead, the split moves the last bucket's backward into ``sync``.

On a torch other than 2.13 each takes the public path (a norm per tensor; the wrapper as it is; the
callback at once, from the hook)
and the log says so once (:mod:`ddp_exp.compat.versions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_exp.compat.versions import written_for


def tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each of ``tensors`` (at least one), as scalar tensors on the first one's
    device (no host sync): one ``torch._foreach_norm`` where all share a device and dtype, else
    one ``torch.linalg.vector_norm`` per tensor (also on a torch other than 2.13)."""
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype
                                 for t in tensors) and written_for(
            "torch", "torch._foreach_norm", "one vector_norm per gradient"):
        return list(torch._foreach_norm(tensors))
    return [torch.linalg.vector_norm(t).to(first.device) for t in tensors]


def compiled_original(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper holds (``OptimizedModule._orig_mod``), or
    ``module`` itself when it is no such wrapper, or on a torch other than 2.13."""
    original = getattr(module, "_orig_mod", None)
    if original is None or not written_for(
            "torch", "OptimizedModule._orig_mod",
            "a model compiled by the user's own _target_ is inspected as its wrapper"):
        return module
    return original


def backward_end_queue() -> Callable[[Callable[[], None]], None]:
    """The function that runs a callback (no arguments) when the running backward pass has
    finished, before the callbacks DDP queues later (its finalize, after the last bucket's
    all-reduce was launched), decided once: autograd's
    ``Variable._execution_engine.queue_callback`` on torch 2.13, valid only while a backward
    runs (call it from a gradient hook); else one that runs the callback at once. A caller
    that queues a callback every step (``metrics/perf``'s timer) takes it once, so that the
    version check is not repeated per step (~10 us of host time a step on the digits MLP,
    issue 42)."""
    if written_for("torch", "Variable._execution_engine.queue_callback",
                   "the backward's end stamped at the last parameter's gradient hook"):
        from torch.autograd import Variable

        return Variable._execution_engine.queue_callback
    return _run_now


def _run_now(callback: Callable[[], None]) -> None:
    callback()
