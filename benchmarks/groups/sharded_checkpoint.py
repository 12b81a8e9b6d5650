"""The ``sharded_checkpoint`` group (issue 40 item 2): what a sharded checkpoint of the ~25M
GPT under FSDP2 holds the loop, ddp_exp's writer thread against ``dcp.async_save``
(``benchmarks/probes/sharded_checkpoint.py``: 2 gloo ranks, model + AdamW state, alternated).
The writer thread is what ddp_exp uses. Target (the issue's "the loop does not wait for the
disk"): the loop is held less than half the time the checkpoint takes to be durable;
``async_save``'s figures are printed beside it, for the choice of the writer thread.

May use: ``benchmarks.harness``, ``benchmarks.groups.step_checkpoint`` (the probe runner).
"""

from __future__ import annotations

from benchmarks.groups.step_checkpoint import probe_result
from benchmarks.harness.group import Group

PROBE = "benchmarks.probes.sharded_checkpoint"


def in_world(quick: bool, timeout_s: float) -> list[str]:
    """The probe's medians as one line: seconds the loop is held and until durable, each way,
    and whether the writer thread holds the loop under half its time to durable. Raises
    ProbeFailed where the probe gave no result."""
    r = probe_result(PROBE, ["--quick"] if quick else ["--repeats", "5"], timeout_s)
    ours, theirs = r["writer"], r["async_save"]
    verdict = "PASS" if ours["blocked_s"] < 0.5 * ours["durable_s"] else "MISS"
    return [f"GPT {r['parameters'] / 1e6:.1f}M, AdamW, 2 gloo ranks, {r['repeats']} "
            f"checkpoints each way (medians): the writer thread holds the loop "
            f"{ours['blocked_s']:.3f} s, durable after {ours['durable_s']:.3f} s; "
            f"dcp.async_save {theirs['blocked_s']:.3f} s / {theirs['durable_s']:.3f} s "
            f"(the loop held < half the time to durable: {verdict})"]


SHARDED_CHECKPOINT = Group("sharded_checkpoint", "Sharded checkpoint under FSDP2: ddp_exp's "
                           "writer thread against dcp.async_save (GPT ~25M, ws=2)",
                           lambda quick: [], extra=in_world, opt_in=True)
