"""Time from the command to its first line (issue 41 item 2): every preset and the extreme values
a range check lets through, each started as ``python -m ddp_exp ...`` in a scratch folder, the
seconds until it prints anything (stdout or stderr), its exit status and total seconds. The
target is < 3 s to the first line on a quiet machine; a run that would train is stopped after
one step (``trainer.max_steps=1``).

    python benchmarks/first_line.py [--repeats 3] [--markdown benchmarks/first_line.md]

Prints one line per command (median over the repeats) and ``BENCH_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

COMMANDS = [
    ("world_size=0",),  # refused by a range check: the interpreter + torch + Hydra floor
    ("trainer.epochs=1",),
    ("experiment=gpt_tokens", "data.block_size=100000", "trainer.epochs=1"),
    ("experiment=gpt_tokens", "model.n_embd=65536"),  # 400 GiB of weights: refused
    ("experiment=digits_cnn_recipe",),
    ("experiment=image_folder_recipe",),
    ("debug=default",),
    ("data.batch_size=1000000000",),
    ("data.val_size=1000000000",),
    ("data.num_workers=64",),
    ("model.hidden_sizes=[1000000,1000000]",),
]
ONE_STEP = ("world_size=1", "trainer.max_steps=1", "print_config=true", "trainer.progress=off")


def first_line(args: tuple[str, ...], timeout: float = 300) -> tuple[float, int, float]:
    """(seconds to the first line, exit status, total seconds) of one ``python -m ddp_exp``."""
    work = tempfile.mkdtemp(prefix="bench-first-line-")
    try:
        cmd = [sys.executable, "-m", "ddp_exp", *ONE_STEP, *args, f"hydra.run.dir={work}/job"]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        first: list[float] = []

        def read() -> None:
            for _ in proc.stdout:
                if not first:
                    first.append(time.monotonic() - start)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        code = proc.wait(timeout=timeout)
        reader.join(5)
        return (first[0] if first else float("nan")), code, time.monotonic() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    rows = []
    for args in COMMANDS:
        runs = [first_line(args) for _ in range(a.repeats)]
        row = {"command": " ".join(args), "first_line_s": statistics.median(r[0] for r in runs),
               "exit": runs[-1][1], "total_s": statistics.median(r[2] for r in runs)}
        rows.append(row)
        print(f"{row['first_line_s']:6.2f} s to the first line, exit {row['exit']}, "
              f"{row['total_s']:6.2f} s in all: {row['command']}", flush=True)
    load = os.getloadavg()[0]
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(f"# Time to the first line\n\n`{' '.join(sys.argv)}`, load average {load:.1f}"
                     f" on {os.cpu_count()} cores at the end; each run adds "
                     f"`{' '.join(ONE_STEP)}`.\n\n| command | first line (s) | exit | total (s) |\n"
                     "|---|---|---|---|\n")
            for r in rows:
                fh.write(f"| `{r['command']}` | {r['first_line_s']:.2f} | {r['exit']} | "
                         f"{r['total_s']:.2f} |\n")
    print("BENCH_RESULT " + json.dumps({"rows": rows, "load_average": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
