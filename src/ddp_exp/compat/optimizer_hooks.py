"""torch 2.13's private registry of global optimizer hooks
(``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_global_optimizer_post_hooks``).

* :func:`without_global_hooks` is kept because it prevents a wrong number: the startup line's
  optimizer-state estimate (:func:`ddp_exp.train.strategy.optimizer_bytes_per_byte`) takes one
  step of a 64-element probe optimizer, and every hook a user (or a test) registered with
  ``torch.optim.optimizer.register_optimizer_step_pre_hook`` saw that step as the run's first:
  a hook counting steps was one ahead (a preemption test's signal landed a step early, at an
  epoch's end). Nothing public runs an optimizer's step without the global hooks.

On a torch without those names the probe runs with the hooks (the estimate is the same).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_global_hooks() -> Iterator[None]:
    """Within the block, no global optimizer step hook runs; they are all back afterwards, in
    their order, whatever the block raised."""
    from torch.optim import optimizer as module

    registries = [getattr(module, name, None) for name in
                  ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    registries = [r for r in registries if isinstance(r, dict)]
    saved = [dict(r) for r in registries]
    for registry in registries:
        registry.clear()
    try:
        yield
    finally:
        for registry, hooks in zip(registries, saved, strict=True):
            registry.clear()
            registry.update(hooks)
