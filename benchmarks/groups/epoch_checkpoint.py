"""The ``epoch_checkpoint`` group (issue 42 item 2): what the epoch checkpoint (``last.pt``
after every epoch, the default) costs digits' training at world_size 2, in one world
(``benchmarks/probes/epoch_checkpoint_cost.py``: blocks of epochs of the default keys alternated
with ``trainer.save_last=false``). Bound: < 1% of the loop, read as the loop thread's share
(what the loop pays: its own CPU in ``at_epoch_end``); the whole process's share (the writer
thread's serialising and file charged too) and the direct (wall) share are reported beside
it. No interleaved runs: pairs of whole runs cannot resolve 1% on this machine
(docs/benchmarks.md).

May use: ``benchmarks.harness``, ``benchmarks.groups.step_checkpoint`` (the probe runner).
"""

from __future__ import annotations

from benchmarks.groups.step_checkpoint import probe_result
from benchmarks.harness.group import Group

BOUND = 0.01
PROBE = "benchmarks.probes.epoch_checkpoint_cost"


def in_world(quick: bool, timeout_s: float) -> list[str]:
    """The probe's result as one line: the epoch checkpoint's loop-thread share against
    :data:`BOUND`, its whole-process and direct shares, and its parts per checkpoint (ms).
    Raises ProbeFailed where the probe gave no result."""
    r = probe_result(PROBE, ["--rounds", "2" if quick else "20",
                             "--epochs-per-block", "2" if quick else "10"], timeout_s)
    n = max(1, r["epoch_checkpoints"])
    verdict = "PASS" if r["loop_thread_cost"] < BOUND else "MISS"
    return [f"in one world ({n} epoch checkpoints, blocks of {r['epochs_per_block']} epochs "
            f"alternated {r['rounds']} times): loop thread share "
            f"{100 * r['loop_thread_cost']:.2f}% (bound < {100 * BOUND:g}%: {verdict}), whole "
            f"process share {100 * r['cpu_cost']:.2f}% (CPU of both threads), direct share "
            f"{100 * r['direct_cost']:.2f}% (wall); per "
            f"checkpoint the loop waits {1000 * r['take_s'] / n:.2f} ms (its CPU "
            f"{1000 * r['take_cpu_s'] / n:.2f} ms), the writer thread uses "
            f"{1000 * r['writer_cpu_s'] / n:.2f} ms of CPU; the blocks' ratio (save_last / none) "
            f"{r['ratio']:.3f}"]


EPOCH_CHECKPOINT = Group("epoch_checkpoint", "Epoch checkpoint: last.pt after every epoch "
                         "against none (ddp_exp, digits, ws=2, in one world)",
                         lambda quick: [], extra=in_world, opt_in=True)
