"""The reproducibility record: ``<job>/run.json``, what produced the job's outputs.

Written atomically by the launching process (never a rank) when every check has passed and
before any rank starts (:func:`write_start`), completed with the end time and status when the
job ends (:func:`write_end`, from :func:`ddp_exp.job.folder.write_status`). It holds the command
line and the job's overrides, the user's git commit and whether the working tree was dirty
(``run.diff`` beside it then), the versions of python, torch, hydra, omegaconf and ddp_exp, the
host, world size, backend and device, the seed, the torch threads per rank, the CPU kernel
settings that change results (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, and the
kernel torch picked), and the data files read (size + mtime; a SHA-256 of the content with
``record.hash_data=true``) with the CRC-32 of the arrays built from them. A resumed job's
earlier starts are kept under ``attempts``. ``ddp-exp runs`` and ``ddp-exp rerun`` read it
(:mod:`ddp_exp.cli.runs`).

Uses :mod:`ddp_exp.io.files` (atomic writes).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ddp_exp.io.files import atomic_write, read_json

RECORD = "run.json"
DIFF = "run.diff"
VERSIONED = ("python", "torch", "hydra-core", "omegaconf", "numpy", "ddp_exp")
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
              "CUBLAS_WORKSPACE_CONFIG")
GIT_TIMEOUT_S = 10.0


def now(seconds: float | None = None) -> str:
    """The time now (or ``seconds`` since the epoch), ISO 8601 in UTC with microseconds."""
    utc = datetime.timezone.utc
    return (datetime.datetime.now(utc) if seconds is None
            else datetime.datetime.fromtimestamp(seconds, utc)).isoformat()


def versions() -> dict[str, str | None]:
    """The installed versions of :data:`VERSIONED` (None where one is missing)."""
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED[1:]:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state(folder: str, job_dir: str) -> dict[str, Any]:
    """The git commit of ``folder`` (the command's folder, the user's project) and whether its
    working tree is dirty; a dirty tree's ``git diff HEAD`` goes to ``<job_dir>/run.diff``.
    Without git, or outside a repository: ``{"commit": None, "note": why}``."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)

    try:
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"commit": None, "dirty": None, "note": f"git not available ({exc})"}
    if head.returncode != 0:
        reason = (head.stderr.strip().splitlines() or ["not a git repository"])[-1]
        return {"commit": None, "dirty": None, "note": reason}
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = bool(status.stdout.strip())
    state: dict[str, Any] = {"commit": head.stdout.strip(), "dirty": dirty}
    if dirty:
        diff = git("diff", "HEAD").stdout
        atomic_write(os.path.join(job_dir, DIFF), lambda fh: fh.write(diff.encode()))
        state["diff"] = DIFF
    return state


def cpu_kernels() -> dict[str, Any]:
    """What decides which CPU kernels torch runs: the environment (:data:`KERNEL_ENV`), the
    capability torch picked, the machine and its processor's model name."""
    import torch

    model = None
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh
                          if line.startswith("model name")), None)
    except OSError:
        pass
    return {"env": {k: os.environ.get(k) for k in KERNEL_ENV},
            "capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "processor": model}


def file_identity(path: str, content: bool) -> dict[str, Any]:
    """A data file or folder by size and modification time (the fast path), and by the
    SHA-256 of its bytes when ``content`` (a folder: of the list of its files' relative paths
    and SHA-256s, in order)."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    stats = [os.stat(f) for f in files]
    entry: dict[str, Any] = {"path": path, "files": len(files),
                             "bytes": sum(s.st_size for s in stats),
                             "mtime": max((s.st_mtime for s in stats), default=None)}
    if content:
        digests = [_sha256(f) for f in files]
        if os.path.isfile(path):  # what sha256sum prints
            entry["sha256"] = digests[0]
        else:
            listing = "".join(f"{os.path.relpath(f, path)}\0{d}\n"
                              for f, d in zip(files, digests, strict=True))
            entry["sha256"] = hashlib.sha256(listing.encode()).hexdigest()
    return entry


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(data_cfg: Mapping[str, Any]) -> list[str]:
    """The files a data config reads: ``data.path`` where set; the bundled digits CSV
    (``data=digits``); none known for a user's own ``_target_``."""
    path = data_cfg.get("path")
    if path:
        return [str(path)]
    if str(data_cfg.get("_target_", "")).endswith("load_digits"):
        import importlib.util

        spec = importlib.util.find_spec("sklearn")
        if spec is not None and spec.submodule_search_locations:
            candidate = os.path.join(spec.submodule_search_locations[0], "datasets", "data",
                                     "digits.csv.gz")
            if os.path.exists(candidate):
                return [candidate]
    return []


def write_start(job_dir: str, plain: Mapping[str, Any], *, command: Sequence[str],
                overrides: Sequence[str], cwd: str, config_dir: str | None,
                config_name: str | None, backend: str, threads_per_rank: int,
                data_fingerprint: Mapping[str, int], started: float) -> dict[str, Any]:
    """Write ``<job_dir>/run.json`` for the start of this job (see the module's docstring);
    ``started``: ``time.time()`` when the job started. An earlier start's record moves under
    ``attempts``, as it ended (:func:`ended`). Returns the record."""
    earlier = read_json(os.path.join(job_dir, RECORD))
    attempts = []
    if isinstance(earlier, dict):
        attempts = [ended(a) for a in [
            *earlier.get("attempts", []),
            {k: earlier.get(k) for k in ("start_time", "end_time", "status", "world_size",
                                         "overrides")}] if isinstance(a, dict)]
    data_cfg = plain.get("data") or {}
    content = bool((plain.get("record") or {}).get("hash_data"))
    record = {
        "command": list(command), "overrides": list(overrides), "cwd": cwd,
        "config_dir": config_dir, "config_name": config_name,
        "git": git_state(cwd, job_dir), "versions": versions(),
        "hostname": socket.gethostname(),
        "world_size": plain.get("world_size"), "backend": backend, "device": plain.get("device"),
        "nnodes": (plain.get("launcher") or {}).get("nnodes", 1),
        "seed": plain.get("seed"), "threads_per_rank": threads_per_rank,
        "cpu": cpu_kernels(),
        "data": {"files": [file_identity(p, content) for p in data_files(data_cfg)
                           if os.path.exists(p)],
                 "target": data_cfg.get("_target_"), **dict(data_fingerprint)},
        "start_time": now(started), "end_time": None, "status": "running",
        "attempts": attempts,
    }
    _write(job_dir, record)
    return record


# An earlier start still "running" when the next starts: it ended without recording its end.
KILLED = "killed"


def ended(attempt: dict[str, Any]) -> dict[str, Any]:
    """An earlier start of the job as it ended: one still ``running`` in the record (this
    start holds the job folder, so it has ended) ended without recording its end (killed, or a
    full disk refused the write) and is :data:`KILLED` (a fresh user's record listed every
    killed attempt as running)."""
    if attempt.get("status") == "running":
        return {**attempt, "status": KILLED}
    return attempt


def write_end(job_dir: str, status: str, wall_s: float) -> None:
    """Complete ``<job_dir>/run.json`` (if any) with the end time, the status and the wall
    seconds of this start."""
    record = read_json(os.path.join(job_dir, RECORD))
    if isinstance(record, dict):
        record.update(end_time=now(), status=status, wall_s=wall_s)
        _write(job_dir, record)


def _write(job_dir: str, record: Mapping[str, Any]) -> None:
    text = json.dumps(record, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(os.path.join(job_dir, RECORD), lambda fh: fh.write(text.encode()))


def command_line() -> list[str]:
    """This process's command line as the user typed it: ``python -m ddp_exp`` (or the
    ``ddp-exp`` script) and its arguments."""
    if sys.argv and sys.argv[0].endswith("__main__.py"):
        return [sys.executable, "-m", "ddp_exp", *sys.argv[1:]]
    return list(sys.argv)
