"""Time from ``python -m ddp_exp ...`` to its first line of output, and to its end (issue 41 item
2: < 3 s to the first line for every preset and every extreme value a range check lets through;
issue 42 item 6: ``--help``, ``--cfg job``, the job with forked and spawned ranks).

    python -m benchmarks.probes.first_line                       # every command, 3 repeats
    python -m benchmarks.probes.first_line --only help,job-spawn --repeats 1
    python -m benchmarks.probes.first_line --src before=/path/to/main/src --src after=src

Each command runs in a scratch folder with this interpreter (``--src NAME=PATH``: with
``PYTHONPATH=PATH``, a checkout's ``src``, trees side by side), interleaved: each repeat runs
every command (and tree) once. A command of :data:`PRESETS` that would train is cut at one
step and prints its config first (:data:`ONE_STEP`); it must run (exit 0) or be refused in one
line (exit 2). Prints a Markdown table of medians and ``BENCH_RESULT {json}`` (every run); exit
1 when a command exits otherwise. A busy machine moves every number: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ONE_STEP = ["world_size=1", "trainer.max_steps=1", "print_config=true", "trainer.progress=off"]
PRESETS = {  # issue 41 item 2: each preset, and the extreme values the range checks let through
    "refused-world_size=0": ["world_size=0"],  # the floor: interpreter, torch, Hydra, the check
    "digits-1-epoch": ["trainer.epochs=1"],
    "gpt-block_size=100000": ["experiment=gpt_tokens", "data.block_size=100000",
                              "trainer.epochs=1"],
    "gpt-n_embd=65536": ["experiment=gpt_tokens", "model.n_embd=65536"],  # 400 GiB of weights
    "digits_cnn_recipe": ["experiment=digits_cnn_recipe"],
    "image_folder_recipe": ["experiment=image_folder_recipe"],
    "debug": ["debug=default"],
    "batch_size=1e9": ["data.batch_size=1000000000"],
    "val_size=1e9": ["data.val_size=1000000000"],
    "num_workers=64": ["data.num_workers=64"],
    "hidden_sizes=1e6x2": ["model.hidden_sizes=[1000000,1000000]"],
}
JOB = ["world_size=2", "trainer.epochs=1", "print_config=false", "trainer.progress=off"]
COMMANDS = {  # issue 42 item 6
    "help": ["--help"],
    "cfg-job": ["--cfg", "job"],
    "job-fork": JOB,
    "job-spawn": [*JOB, "launcher.start_method=spawn"],
    **{name: [*ONE_STEP, *args] for name, args in PRESETS.items()},
}
ALLOWED_EXIT = {name: (0, 2) for name in PRESETS}  # run, or refused in one line


def timed(args: list[str], src: str | None, cwd: str,
          timeout: float = 300) -> tuple[float, float, int, str]:
    """(seconds to the first line on stdout or stderr, seconds to the end, exit status, the
    last lines of output) of ``python -m ddp_exp args`` (``src`` first on the path); its
    session is killed after ``timeout`` seconds."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.path.abspath(src)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ddp_exp", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    first, lines = None, []
    for line in proc.stdout:
        if first is None:
            first = time.perf_counter() - start
        lines = (lines + [line.decode(errors="replace")])[-5:]
    code = proc.wait()
    watchdog.cancel()
    end = time.perf_counter() - start
    return (end if first is None else first), end, code, "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(COMMANDS), help="comma-separated commands: "
                   + ", ".join(COMMANDS))
    args = p.parse_args(argv)
    trees: dict[str, str | None] = dict(item.split("=", 1) for item in args.src) or {"": None}
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(COMMANDS))
    if unknown:
        p.error(f"unknown command(s) {unknown}; choose from {', '.join(COMMANDS)}")
    runs, failed = [], []
    with tempfile.TemporaryDirectory(prefix="bench-first-line-") as scratch:
        for repeat in range(args.repeats):
            for i, command in enumerate(names):
                for tree, src in trees.items():
                    run_dir = os.path.join(scratch, f"{tree}-{repeat}-{i}")
                    extra = [] if command in ("help", "cfg-job") else [f"hydra.run.dir={run_dir}"]
                    first, end, code, tail = timed(COMMANDS[command] + extra, src, scratch)
                    runs.append({"command": command, "tree": tree, "repeat": repeat,
                                 "first_line_s": first, "whole_s": end, "exit": code})
                    if code not in ALLOWED_EXIT.get(command, (0,)):
                        failed.append(command)
                        print(f"{tree} {command}: exit {code}\n{tail}", file=sys.stderr)
    print("| command | tree | first line (s) | whole (s) | exit |\n|---|---|---|---|---|")
    for (command, tree) in dict.fromkeys((r["command"], r["tree"]) for r in runs):
        mine = [r for r in runs if r["command"] == command and r["tree"] == tree]
        print(f"| {command} | {tree} | {statistics.median(r['first_line_s'] for r in mine):.2f} "
              f"| {statistics.median(r['whole_s'] for r in mine):.2f} | {mine[-1]['exit']} |")
    print("BENCH_RESULT " + json.dumps({"script": "first_line", "runs": runs}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
