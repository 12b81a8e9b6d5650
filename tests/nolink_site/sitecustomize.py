"""Test-only: a file system without hard links (exFAT, some network mounts) for a
``python -m ddp_exp`` started with this folder on PYTHONPATH (``test_checkpoint_files.py``).
With ``DDP_EXP_TEST_NO_LINK=1``, ``os.link`` raises ``PermissionError`` as it does there
(Lightning #18900), in the launcher and in the ranks it forks or spawns."""

from __future__ import annotations

import errno
import os


def _no_link(src, dst, *args, **kwargs):
    raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(src), None,
                          os.fspath(dst))


if os.environ.get("DDP_EXP_TEST_NO_LINK") == "1":
    os.link = _no_link
