"""docs/guide.md runs as written: every ``bash`` block of the guide is run, in order, in a scratch
folder laid out like the repository root (``.venv``, ``docs``), and every line of the output
block that follows it must appear in what it printed, in order.

Conventions of the guide's quoted output (its introduction says the same):

- a line ``...`` stands for lines left out;
- ``[...]`` and ``...`` inside a line stand for any text (timestamps, paths, a run's folder);
- the number before ``samples/s`` is a measurement and may be anything.

A block that cannot run here is preceded by ``<!-- docs-test: skip (why) -->`` on the line
before its fence; every other block runs, so a section added later is covered without touching
this file. The outputs were taken on a 2-core machine: the blocks run pinned to 2 cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((.+)\)\s*-->")
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    command: str
    expected: list[str]  # the output block's lines ([] when none follows)
    skip: str | None  # why it cannot run here


def guide_blocks(text: str) -> list[Block]:
    """Every ``bash`` block of the guide with the plain block that follows it."""
    lines = text.splitlines()
    fences = []  # (start line index, info string, body lines)
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info, body, j = lines[i][3:].strip(), [], i + 1
            while not lines[j].startswith("```"):
                body.append(lines[j])
                j += 1
            fences.append((i, j, info, body))
            i = j + 1
        else:
            i += 1
    blocks = []
    for k, (start, _, info, body) in enumerate(fences):
        if info != "bash":
            continue
        expected: list[str] = []
        if k + 1 < len(fences):
            nxt_start, _, nxt_info, nxt_body = fences[k + 1]
            end = fences[k][1]
            between = lines[end + 1:nxt_start]
            if nxt_info == "" and all(not ln.strip() for ln in between):
                expected = nxt_body
        marker = SKIP.search(lines[start - 1]) if start > 0 else None
        blocks.append(Block(start + 1, "\n".join(body), expected,
                            marker.group(1) if marker else None))
    return blocks


def line_pattern(quoted: str) -> re.Pattern:
    """A quoted output line as a regex: ``[...]``/``...`` match anything, samples/s any number."""
    parts = re.split(r"(\[\.\.\.\]|\.\.\.|[\d,]+(?= samples/s))", quoted)
    regex = "".join(".*" if p in ("[...]", "...") else r"[\d,]+" if re.fullmatch(r"[\d,]+", p)
                    and i % 2 == 1 else re.escape(p) for i, p in enumerate(parts))
    return re.compile(regex)


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The quoted lines not found, in order, among the output's lines."""
    out = [ln.rstrip() for ln in output.splitlines()]
    missing, pos = [], 0
    for quoted in expected:
        if quoted.strip() == "...":
            continue
        pattern = line_pattern(quoted.rstrip())
        hit = next((i for i in range(pos, len(out)) if pattern.fullmatch(out[i])), None)
        if hit is None:
            missing.append(quoted)
        else:
            pos = hit + 1
    return missing


BLOCKS = guide_blocks(GUIDE.read_text())


def test_the_guide_has_command_blocks_with_quoted_output():
    assert len(BLOCKS) >= 15
    assert sum(bool(b.expected) for b in BLOCKS) >= 15
    for block in BLOCKS:
        assert block.skip is None or block.skip.strip(), block.line


def test_line_patterns():
    pattern = line_pattern("[...][rank0][x] - epoch 1/2 | loss 2.0411 | 20,465 samples/s")
    assert pattern.fullmatch("[2026-11-30 10:00:00,1][rank0][x] - epoch 1/2 | loss 2.0411 | "
                             "7,001 samples/s")
    assert not pattern.fullmatch("[t][rank0][x] - epoch 1/2 | loss 2.0412 | 7 samples/s")
    assert line_pattern("wrote .../outputs/x/metrics.json").fullmatch(
        "wrote /tmp/a/outputs/x/metrics.json")
    assert missing_lines(["a", "...", "c"], "a\nb\nc\n") == []
    assert missing_lines(["c", "a"], "a\nb\nc\n") == ["a"]  # in order


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder laid out like the repository root: outputs/ of the guide's runs land here."""
    root = tmp_path_factory.mktemp("guide")
    (root / ".venv").symlink_to(Path(sys.prefix))  # the environment running the tests
    (root / "docs").symlink_to(ROOT / "docs")
    for name in ("tests", "examples"):  # PYTHONPATH=tests ... (the guide's test models)
        (root / name).symlink_to(ROOT / name)
    return root


def _pin_to_two_cores() -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 2 and shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, cores[:2]))]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_guide_block_runs_and_prints_what_it_quotes(block: Block, workdir: Path):
    if block.skip:
        pytest.skip(f"docs/guide.md line {block.line}: {block.skip}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HYDRA_FULL_ERROR", "OMP_NUM_THREADS")}
    # stderr into stdout, in the order a terminal shows them (torchrun warns first, on stderr)
    proc = subprocess.run([*_pin_to_two_cores(), "bash", "-c", block.command], cwd=workdir,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    output = proc.stdout
    if not block.expected:  # nothing quoted: the block must at least succeed
        assert proc.returncode == 0, f"docs/guide.md line {block.line}:\n{output[-6000:]}"
    missing = missing_lines(block.expected, output)
    assert not missing, (f"docs/guide.md line {block.line}: not printed:\n" + "\n".join(missing)
                         + "\n--- output ---\n" + output[-6000:])
