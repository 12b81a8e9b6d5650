"""Start-up as a user sees it (issue 42 item 6): the seconds from ``python -m ddp_exp ...`` to its
first line of output, and to its end, for ``--help``, ``--cfg job`` and the 1-epoch digits job at
world_size 2 (ranks forked, the default, and spawned), with one or more source trees side by
side, interleaved (each repeat runs every tree's command once before the next repeat).

    python -m benchmarks.probes.first_line --src before=/path/to/main/src --src after=src

Each ``--src NAME=PATH`` runs with ``PYTHONPATH=PATH`` (a checkout's ``src``) in a scratch
folder, with this interpreter. Prints a Markdown table of medians and ``BENCH_RESULT {json}``.
A busy machine moves every number: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "--help": ["--help"],
    "--cfg job": ["--cfg", "job"],
    "job (fork)": ["world_size=2", "trainer.epochs=1", "print_config=false",
                   "trainer.progress=off"],
    "job (spawn)": ["world_size=2", "trainer.epochs=1", "print_config=false",
                    "trainer.progress=off", "launcher.start_method=spawn"],
}


def timed(args: list[str], src: str, cwd: str) -> tuple[float, float, int, str]:
    """(seconds to the first line on stdout or stderr, seconds to the end, exit status, the
    last lines of output) of ``python -m ddp_exp args`` with ``src`` first on the path."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    first, lines = None, []
    for line in proc.stdout:
        if first is None:
            first = time.perf_counter() - start
        lines = (lines + [line.decode(errors="replace")])[-5:]
    code = proc.wait()
    end = time.perf_counter() - start
    return (end if first is None else first), end, code, "".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(COMMANDS), help="comma-separated commands")
    args = p.parse_args()
    trees = dict(item.split("=", 1) for item in args.src)
    names = [name for name in args.only.split(",") if name]
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-first-line-") as scratch:
        for repeat in range(args.repeats):
            for command in names:
                for tree, src in trees.items():
                    run_dir = os.path.join(scratch, f"{tree}-{repeat}-{names.index(command)}")
                    extra = ([] if command.startswith("--") else [f"hydra.run.dir={run_dir}"])
                    first, end, code, tail = timed(COMMANDS[command] + extra, src, scratch)
                    if code != 0:
                        print(f"{tree} {command}: exit {code}\n{tail}", file=sys.stderr)
                        return 1
                    samples.setdefault((command, tree), []).append((first, end))
    rows = [{"command": c, "tree": t, "first_line_s": statistics.median(f for f, _ in v),
             "whole_s": statistics.median(e for _, e in v), "repeats": len(v)}
            for (c, t), v in samples.items()]
    print("| command | tree | first line (s) | whole (s) |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['command']} | {row['tree']} | {row['first_line_s']:.2f} | "
              f"{row['whole_s']:.2f} |")
    print("BENCH_RESULT " + json.dumps({"script": "first_line", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
