"""docs/guide.md runs as written: every ``bash`` block of the guide is run, in order, in a scratch
folder laid out like the repository root (``.venv``, ``docs``), every command of it must succeed
(or end with the exit status the guide says), and every line of the output block that follows it
must appear in what it printed, in order.

Conventions of the guide's quoted output (its introduction says the same):

- a line ``...`` stands for lines left out;
- ``[...]`` and ``...`` inside a line stand for any text (timestamps, paths, a run's folder);
- the number before ``samples/s`` is a measurement and may be anything;
- a number with decimals is a value at the precision it is quoted: ``0.4687`` matches a printed
  number within one unit of its last digit (a CPU with other kernels may round the other way).

HTML comments on the lines just before a block's fence say what differs for that block:

- ``<!-- docs-test: skip (why) -->``: it cannot run here;
- ``<!-- docs-test: exit 2 2 (why) -->``: the statuses its failing commands end with, in order
  (every other command must succeed);
- ``<!-- docs-test: within 10% (why) -->``: its quoted numbers with decimals, and the counts of
  its ``(correct/total)`` accuracies, hold at that relative precision only (the digits of a
  longer training vary with the CPU's kernels).

Every other block runs, so a section added later is covered without touching this file. The
outputs were taken on a 2-core machine: the blocks run pinned to 2 cores. Every block quotes
digits of trained models, and the blocks build on each other's outputs: the whole guide is
``float_sensitive`` (``make test-float`` runs it with another CPU's kernels).

The work folder's ``.venv/bin/python`` (tests/zygote_shim.py) runs each ``python -m ...``,
``python script.py`` and ``python -`` command, torchrun and the ranks torchrun starts, forked
from this process's pre-imported server (tests/zygote.py), without ~2.5 s of imports each, and
execs the real interpreter for ``python -c`` (mp.spawn's children) or where a real process is
needed (a start-up variable such as ``PYTHONWARNINGS``, a background job).

The Chinese guide, docs/guide.zh-CN.md, must hold the same blocks (commands, quoted output,
markers), so running the English guide's checks both. The README and every page of docs/ link
only to files and headings that exist, the README links every page and stays short, and no file
refers to notes outside the repository.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zygote
import zygote_shim
from helpers import default_signals

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|exit|within)\s*(.*?)\s*-->")
BLOCK_TIMEOUT_S = 300
# What a quoted line's parts stand for: any text; a measured rate (may be anything); a value
# (a number with decimals, or the count of a "(correct/total)" accuracy).
TOKEN = re.compile(r"(?P<any>\[\.\.\.\]|\.\.\.)|(?P<rate>[\d,]+(?= samples/s))"
                   r"|(?P<value>\d+\.\d+|(?<=\()\d+(?=/\d+\)))")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    command: str
    expected: list[str]  # the output block's lines ([] when none follows)
    skip: str | None = None  # why it cannot run here
    exits: list[int] = field(default_factory=list)  # statuses of its failing commands, in order
    rel: float | None = None  # relative precision of its quoted values (None: the last digit)


def _markers(lines: list[str], fence: int) -> dict[str, str]:
    """The ``docs-test`` comments on the lines just above line index ``fence``: kind -> text."""
    found, i = {}, fence - 1
    while i >= 0 and (hit := MARKER.search(lines[i])):
        found[hit.group(1)] = hit.group(2)
        i -= 1
    return found


def _block(start: int, body: list[str], expected: list[str], markers: dict[str, str]) -> Block:
    block = Block(start + 1, "\n".join(body), expected)
    if "skip" in markers:
        block.skip = re.fullmatch(r"\((.+)\)", markers["skip"]).group(1)
    if "exit" in markers:
        block.exits = [int(n) for n in re.match(r"[\d ]+", markers["exit"]).group().split()]
    if "within" in markers:
        block.rel = float(re.match(r"([\d.]+)%", markers["within"]).group(1)) / 100
    return block


def guide_blocks(text: str) -> list[Block]:
    """Every ``bash`` block of the guide with the plain block that follows it and the
    ``docs-test`` comments above it."""
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
        blocks.append(_block(start, body, expected, _markers(lines, start)))
    return blocks


def line_pattern(quoted: str) -> tuple[re.Pattern, list[str]]:
    """A quoted output line as a regex and its values: ``[...]``/``...`` match anything, the
    number before samples/s any number, each value (:data:`TOKEN`) any number, captured for
    :func:`line_matches`."""
    regex, values, pos = "", [], 0
    for hit in TOKEN.finditer(quoted):
        regex += re.escape(quoted[pos:hit.start()])
        if hit.group("any"):
            regex += ".*"
        elif hit.group("rate"):
            regex += r"[\d,]+"
        else:
            regex += r"(\d+(?:\.\d+)?)"
            values.append(hit.group())
        pos = hit.end()
    return re.compile(regex + re.escape(quoted[pos:])), values


def values_agree(quoted: str, printed: str, rel: float | None = None) -> bool:
    """``printed`` is the quoted value at the precision the guide claims: within ``rel`` of it
    (relative) when given, else within one unit of its last quoted digit (``0.4687``: 0.4686
    to 0.4688; a count exactly)."""
    q, p = float(quoted), float(printed)
    if rel is not None:
        return abs(p - q) <= rel * abs(q)
    decimals = len(quoted.partition(".")[2])
    return abs(p - q) <= (10.0 ** -decimals if decimals else 0.0) + 1e-12


def line_matches(quoted: str, printed: str, rel: float | None = None) -> bool:
    """Whether a printed line is the quoted one (:func:`line_pattern`, :func:`values_agree`)."""
    pattern, values = line_pattern(quoted)
    hit = pattern.fullmatch(printed)
    return hit is not None and all(values_agree(q, p, rel)
                                   for q, p in zip(values, hit.groups(), strict=True))


def missing_lines(expected: list[str], output: str, rel: float | None = None) -> list[str]:
    """The quoted lines not found, in order, among the output's lines."""
    out = [ln.rstrip() for ln in output.splitlines()]
    missing, pos = [], 0
    for quoted in expected:
        if quoted.strip() == "...":
            continue
        hit = next((i for i in range(pos, len(out)) if line_matches(quoted.rstrip(), out[i], rel)),
                   None)
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


def test_guide_markers():
    text = ("x\n<!-- docs-test: exit 2 2 (refused) -->\n<!-- docs-test: within 5% (a CNN) -->\n"
            "```bash\ncmd\n```\n\n```\nout\n```\n<!-- docs-test: skip (a port) -->\n"
            "```bash\nother\n```\n")
    refused, skipped = guide_blocks(text)
    assert (refused.line, refused.command, refused.expected) == (4, "cmd", ["out"])
    assert (refused.exits, refused.rel, refused.skip) == ([2, 2], 0.05, None)
    assert (skipped.skip, skipped.exits, skipped.rel, skipped.expected) == ("a port", [], None, [])


def test_line_patterns():
    quoted = "[...][rank0][x] - epoch 1/2 | loss 2.0411 | acc 0.5993 (178/297) | 20,465 samples/s"
    assert line_matches(quoted, "[2026-11-30 10:00:00,1][rank0][x] - epoch 1/2 | loss 2.0411 | "
                                "acc 0.5993 (178/297) | 7,001 samples/s")
    # the last digit may round the other way on another CPU; more is another value
    assert line_matches(quoted, "[t][rank0][x] - epoch 1/2 | loss 2.0412 | acc 0.5993 (178/297) "
                                "| 7 samples/s")
    assert not line_matches(quoted, "[t][rank0][x] - epoch 1/2 | loss 2.0413 | acc 0.5993 "
                                    "(178/297) | 7 samples/s")
    assert not line_matches(quoted, "[t][rank0][x] - epoch 1/2 | loss 2.0411 | acc 0.5993 "
                                    "(179/297) | 7 samples/s")
    assert not line_matches(quoted, "[t][rank0][x] - epoch 1/3 | loss 2.0411 | acc 0.5993 "
                                    "(178/297) | 7 samples/s")
    # within 5%: 2.0411 * 1.05 = 2.1432, 178 * 0.95 = 169.1
    cnn = "[t][rank0][x] - epoch 1/2 | loss 2.1400 | acc 0.5700 (170/297) | 9 samples/s"
    assert line_matches(quoted, cnn, rel=0.05) and not line_matches(quoted, cnn)
    assert not line_matches(quoted, cnn.replace("2.1400", "2.1500"), rel=0.05)
    assert line_matches("wrote .../outputs/x/metrics.json", "wrote /tmp/a/outputs/x/metrics.json")
    assert line_matches("same: 0.86641902 == 0.86641902", "same: 0.86641903 == 0.86641903")
    assert missing_lines(["a", "...", "c"], "a\nb\nc\n") == []
    assert missing_lines(["c", "a"], "a\nb\nc\n") == ["a"]  # in order


# Appends the status of every command that fails (bash's ERR trap) to the file named by $1.
STATUSES = 'trap \'echo $? >> "$1"\' ERR\n'


def test_every_failing_command_of_a_block_is_counted(tmp_path):
    statuses = tmp_path / "statuses"
    script = STATUSES + "true\n(exit 2)\necho fine\nfalse\ncat <<'EOF'\nx\nEOF\n"
    proc = subprocess.run(["bash", "-c", script, "block", str(statuses)], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0 and proc.stdout == "fine\nx\n"
    assert statuses.read_text().split() == ["2", "1"]


@dataclass
class Workdir:
    root: Path  # laid out like the repository root: outputs/ of the guide's runs land here
    ran: set[int] = field(default_factory=set)  # the blocks run in it (their lines)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Workdir:
    """A folder laid out like the repository root, for this process's blocks of the guide."""
    root = tmp_path_factory.mktemp("guide")
    address = zygote.address()
    if address:  # this environment, its python -m ddp_exp forked from the pre-imported server
        zygote_shim.install(root / ".venv", address)
    else:
        (root / ".venv").symlink_to(Path(sys.prefix))  # the environment running the tests
    (root / "docs").symlink_to(ROOT / "docs")
    for name in ("tests", "examples"):  # PYTHONPATH=tests ... (the guide's test models)
        (root / name).symlink_to(ROOT / name)
    return Workdir(root)


def _pin_to_two_cores() -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 2 and shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, cores[:2]))]
    return []


def run_block(block: Block, workdir: Workdir, statuses: Path) -> subprocess.CompletedProcess:
    """Run ``block`` in the work folder, as the guide's reader would (bash, 2 cores, stderr
    into stdout in the order a terminal shows them), appending the status of each command that
    fails to ``statuses``. The blocks build on each other's outputs: when pytest-xdist gave
    this process a block without those before it, they run first (unchecked)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HYDRA_FULL_ERROR", "OMP_NUM_THREADS")}
    earlier = [b for b in BLOCKS if b.line < block.line and not b.skip
               and b.line not in workdir.ran]
    for b in [*earlier, block]:
        workdir.ran.add(b.line)
        proc = subprocess.run([*_pin_to_two_cores(), "bash", "-c", STATUSES + b.command,
                               "block", str(statuses if b is block else os.devnull)],
                              cwd=workdir.root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, preexec_fn=default_signals)  # a terminal's
    return proc


@pytest.mark.slow
@pytest.mark.float_sensitive
# The blocks build on each other: one worker runs them all, in order (make test's --dist
# loadgroup), where another worker given a later block would first replay every block before it.
@pytest.mark.xdist_group("guide")
# A block that runs those before it (run_block) may take minutes; each command's own timeout
# (BLOCK_TIMEOUT_S) is the hang check.
@pytest.mark.timeout(BLOCK_TIMEOUT_S * len(BLOCKS))
@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_guide_block_runs_and_prints_what_it_quotes(block: Block, workdir: Workdir, tmp_path):
    if block.skip:
        pytest.skip(f"docs/guide.md line {block.line}: {block.skip}")
    statuses = tmp_path / "statuses"
    proc = run_block(block, workdir, statuses)
    output = proc.stdout
    failed = [int(n) for n in statuses.read_text().split()] if statuses.exists() else []
    # a block bash cannot parse runs no command: only its own status says so
    parsed = proc.returncode == 0 or failed[-1:] == [proc.returncode]
    assert failed == block.exits and parsed, (
        f"docs/guide.md line {block.line}: commands ended with {failed} (bash with "
        f"{proc.returncode}), the guide says {block.exits}:\n{output[-6000:]}")
    missing = missing_lines(block.expected, output, block.rel)
    assert not missing, (f"docs/guide.md line {block.line}: not printed:\n" + "\n".join(missing)
                         + "\n--- output ---\n" + output[-6000:])


# The Chinese guide is the English one translated: the same blocks (commands, quoted output,
# markers), so the blocks run above check both guides; running them twice would double the
# suite's longest test for no new command.
GUIDE_ZH = ROOT / "docs" / "guide.zh-CN.md"


def runnable(block: Block) -> tuple:
    """What running a block checks: its command, quoted output, statuses, precision, skip."""
    return block.command, block.expected, block.exits, block.rel, block.skip is not None


def test_the_chinese_guide_runs_the_english_guides_blocks():
    zh = guide_blocks(GUIDE_ZH.read_text())
    assert len(zh) == len(BLOCKS), (len(zh), len(BLOCKS))
    for en_block, zh_block in zip(BLOCKS, zh, strict=True):
        assert runnable(zh_block) == runnable(en_block), (
            f"docs/guide.zh-CN.md line {zh_block.line} is not docs/guide.md line "
            f"{en_block.line}: the translation runs the same blocks")


# The README and docs/ link each other: a link to a file or a heading that is not there is a
# page the reader cannot find.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-`` (a ``#`` line inside a code block is no heading)."""
    anchors, in_code = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (hit := re.match(r"#+\s+(.*)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", hit.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def relative_links(page: Path) -> list[str]:
    """The links of a markdown page to files of this repository (outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def broken_links(page: Path) -> list[str]:
    """The relative links of a markdown page whose file, or heading, does not exist."""
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or (anchor and target.suffix == ".md"
                                   and anchor not in heading_anchors(target.read_text())):
            broken.append(link)
    return broken


def test_heading_anchors_and_broken_links(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Sweeps: `-m` and Optuna's\n```\n# not a heading\n```\n"
                    "[x](a.md#sweeps--m-and-optunas) [y](#not-a-heading) [z](b.md) "
                    "[w](https://example.com/c.md)\n")
    assert heading_anchors(page.read_text()) == {"sweeps--m-and-optunas"}  # "-m" keeps its dash
    assert broken_links(page) == ["#not-a-heading", "b.md"]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_pages_links_resolve(page):
    assert broken_links(page) == []


def test_the_readme_is_a_front_door_to_every_page():
    """The README stays what a newcomer reads in ten minutes (~15 KB) and links every page of
    docs/."""
    readme = ROOT / "README.md"
    assert len(readme.read_text()) < 16_000
    linked = {(ROOT / link.partition("#")[0]).resolve() for link in relative_links(readme)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


# A clone holds everything its text refers to: no design notes or case lists in a folder beside
# the checkout.
OUTSIDE = re.compile(r"\.\./shared/|\bshared/(?:cases|DESIGN|STYLE)|\b(?:DESIGN|STYLE)\.md\b")
TEXT_FILES = ("README.md", "Makefile", "pyproject.toml", "docs/**/*.md", "src/**/*.py",
              "tests/**/*.py", "conf/**/*.yaml", "benchmarks/**/*.py", "benchmarks/**/*.md",
              "examples/**/*.py", "examples/**/*.yaml", "examples/**/*.md")


def test_nothing_refers_to_files_outside_the_repository():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for pattern in TEXT_FILES for path in sorted(ROOT.glob(pattern))
             for n, line in enumerate(path.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert found == []


# The docs name the code (`rank.worker.run_rank`, `ddp_exp.metrics.perf`,
# `src/ddp_exp/train/loop.py`): a name that a move or a split left behind sends the reader to
# nothing. Logger names in quoted output (`[ddp_exp.perf]`) and file names (`ddp_exp.log`) are not
# code.
FILE_SUFFIXES = {"log", "md", "json", "csv", "pt", "yaml", "png", "lock", "py", "txt"}
CODE_REF = re.compile(r"(?<![\w./\[-])(ddp_exp(?:\.\w+)+|[a-z_]+\.[a-z_]+(?:\.\w+)*)")
SOURCE_PATH = re.compile(r"(?<![\w/])src/ddp_exp/[\w/]+\.py\b")


def stale_code_refs(text: str) -> list[str]:
    """The names of ddp_exp's code in ``text`` that do not exist: a dotted name starting with
    ``ddp_exp.``, or ``package.module.attr...`` whose first two parts name a module of ddp_exp
    (other dotted names, such as config keys, are not code), and ``src/ddp_exp/...py`` paths."""
    import importlib

    stale = [path for path in SOURCE_PATH.findall(text) if not (ROOT / path).exists()]
    for ref in dict.fromkeys(CODE_REF.findall(text)):
        parts = ref.removeprefix("ddp_exp.").split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue
        if not ref.startswith("ddp_exp.") and not (
                ROOT / "src" / "ddp_exp" / parts[0] / f"{parts[1]}.py").exists():
            continue
        obj, rest = None, parts
        for i in range(len(parts), 0, -1):
            try:
                obj, rest = importlib.import_module("ddp_exp." + ".".join(parts[:i])), parts[i:]
                break
            except ImportError:
                continue
        for name in rest:
            obj = getattr(obj, name, None)
        if obj is None:
            stale.append(ref)
    return stale


def test_stale_code_refs():
    assert stale_code_refs("`rank.worker.run_rank` `ddp_exp.train.models.MLP` data.batch_size "
                           "`src/ddp_exp/train/loop.py` [ddp_exp.perf] ddp_exp.log") == []
    assert stale_code_refs("`launch.elastic.no_such` `ddp_exp.nothing` "
                           "`src/ddp_exp/train.py`") == ["src/ddp_exp/train.py",
                                                         "launch.elastic.no_such",
                                                         "ddp_exp.nothing"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_code_the_pages_name_exists(page):
    assert stale_code_refs(page.read_text()) == []


def test_the_pages_name_the_job_folders_as_hydra_writes_them():
    """A job's folder is ``outputs/runs/<date>/<time>`` (a sweep's ``outputs/multirun/...``:
    ``hydra.run.dir`` and ``hydra.sweep.dir`` in conf/config.yaml), never ``outputs/<date>``
    (Hydra's own default, which language-models.md named)."""
    config = (ROOT / "conf" / "config.yaml").read_text()
    assert "dir: outputs/runs/" in config and "dir: outputs/multirun/" in config
    stale = re.compile(r"outputs/(?:<date>|\d{4}-\d\d-\d\d)")
    assert [(page.name, hit) for page in PAGES
            for hit in stale.findall(page.read_text())] == []
