"""glibc's ``malloc_trim`` after each optimizer step (``strategy.malloc_trim``) or its
``M_MMAP_THRESHOLD`` fixed for a rank (``strategy.malloc_mmap_threshold``), so that the tensors
FSDP allocates and frees every step give their memory back to the system.

Why (measured here, issue 40, torch 2.13 CPU, GPT 25M at world_size 2, 10 steps): torch's CPU
allocator is glibc's ``malloc``. An allocation of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB
at start) is its own ``mmap``, unmapped on ``free``; but glibc raises the threshold to the size
of every such block freed (its "dynamic mmap threshold", up to 32 MiB; ``man 3 mallopt``). FSDP
frees a 12 MiB all-gather output per block per forward, so after the first one every smaller
tensor (activations, unsharded gradients) comes from the heap, whose freed pages glibc keeps: a
rank's RSS grew 973 -> 1,134 MiB over 10 steps while its live memory (RSS after
``malloc_trim(0)``) stayed at ~670 MiB (DDP: ~930 MiB, flat). Setting the threshold turns the
dynamic rule off: at 128 KiB the rank's peak RSS was 753 MiB against 1,135 (steady 644).

The cost: each large tensor is a fresh ``mmap``, its pages faulted in and zeroed on every
allocation. In 10 steps of both ranks: kernel time 3.2-3.5 s (null), 7.2-7.4 s (8 MiB),
10.0-10.4 s (1 MiB), 11.7-12.6 s (128 KiB), with peak RSS 1,150 / 820 / 695 / 636 MiB; steps
slowed in proportion on this 2-core machine. Hence off by default (null).

``malloc_trim(0)`` once per optimizer step leaves glibc's rule alone and gives back, between
steps, the pages of every free chunk in the heap (``madvise(MADV_DONTNEED)``; ``man 3
malloc_trim``): the pages a step freed are faulted in again by the next step that uses them,
once a step instead of at every allocation of a large tensor. Measured (2026-12-06, GPT 25M,
AdamW, world_size 2, 10 steps, 4 alternating quiet rounds): peak RSS per rank 897-948 MiB
(median 930) against 1,034-1,065 without it and DDP's 956-970 (lower than DDP's in every
round), steady RSS 776-809 against 969-1,065; tokens/s 471-494 against 542-552 (0.89x; DDP
691-742). On by default under ``strategy=fsdp`` on a CPU: a model that needs sharding is one
whose memory is the point.

Uses nothing of ddp_exp.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

M_MMAP_THRESHOLD = -3  # <malloc.h>

log = logging.getLogger("ddp_exp.train")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None on another C library (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def set_mmap_threshold(num_bytes: int | None) -> bool:
    """Fix glibc's ``M_MMAP_THRESHOLD`` at ``num_bytes`` for this process (allocations of at
    least that many bytes are mapped on their own and unmapped on ``free``; glibc no longer
    raises it). None: leave glibc's dynamic threshold. Returns whether it was set (False: not
    glibc, or glibc refused the value)."""
    if num_bytes is None:
        return False
    libc = _libc()
    if libc is None:
        log.debug("strategy.malloc_mmap_threshold: not glibc, left as it is")
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(num_bytes)))


def trim() -> bool:
    """Give the system back the free pages of this process's heaps (glibc's ``malloc_trim(0)``:
    the top of each heap and the whole free pages inside it). Returns whether any memory was
    released; False on another C library (nothing done)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))
