"""Two digits runs at the same time, each pinned to its own core: a comparison that the host's
speed changes cannot skew (issue 13).

Why: this machine's two cores change speed by about 2x for seconds at a time (a fixed pure-Python
loop took 25 ms, then 49-51 ms for several seconds, on both cores, with nothing else running;
``--probe`` shows it), and nothing inside the VM sees it (``/proc/stat`` steal stays 0, "other
cores busy" stays 0). Runs taken one after the other, as ``python -m benchmarks`` does, land in
different phases, so 10-15 interleaved pairs cannot tell 0.97 from 1.0. Here both runs of a pair
train during the same seconds, one per core (so each has one intra-op thread: ``threads_per_rank``
and the scripts give a rank the cores it may use), and the cores are swapped every repeat.

    python -m benchmarks.probes.side_by_side --epochs 150 --repeats 8 --a "" --b tight
    python -m benchmarks.probes.side_by_side --a "" --b "trainer.save_last=false"
    python -m benchmarks.probes.side_by_side --a "" --b "PYTHONPATH=/tmp/old/src"

Each of ``--a`` / ``--b``: ``tight`` (``ddp_tight.py``), or ddp_exp with the workload's
overrides (``workloads.ddp_exp_overrides``, the default trainer keys) plus the given
space-separated overrides; an item ``NAME=value`` whose NAME is upper case sets an environment
variable instead (e.g. ``PYTHONPATH=...`` to run another checkout's ``src``), and ``dir=PATH``
puts the job folder under PATH. Prints each pair's training samples/s (the loop only, as
``train/samples_per_sec``) and a/b, then the median and the range of a/b.
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
import time

from benchmarks import common, workloads  # noqa: E402
from benchmarks.harness.variant import PY, script  # noqa: E402


def command(spec: str, cpu: int, epochs: int, workdir: str) -> tuple[list[str], dict, str]:
    """The argv, environment and result path of one run of ``spec`` pinned to ``cpu``."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    pin = ["taskset", "-c", str(cpu)]
    if spec == "tight":
        out = os.path.join(workdir, "result.json")
        # run from workdir: the package is found through PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (common.ROOT, env.get("PYTHONPATH"))))
        return pin + [*script("ddp_tight"), "--workload", "digits", "--world-size", "1",
                      "--epochs", str(epochs), "--out", out], env, out
    overrides, root = [], workdir
    for item in spec.split():
        name, _, value = item.partition("=")
        if name.isupper():
            env[name] = value
        elif name == "dir":  # removed with workdir's (see main)
            root = tempfile.mkdtemp(dir=value)
            os.symlink(root, os.path.join(workdir, "elsewhere"))
        else:
            overrides.append(item)
    job = os.path.join(root, "job")
    argv = pin + [PY, "-m", "ddp_exp",
                  *workloads.ddp_exp_overrides("digits", 1, workloads.spec("digits")["batch_size"],
                                               epochs, user_defaults=True),
                  *overrides, f"hydra.run.dir={job}"]
    return argv, env, os.path.join(job, "metrics.json")


def samples_per_sec(path: str) -> float:
    with open(path) as fh:
        result = json.load(fh)
    return result.get("train/samples_per_sec", result.get("samples_per_sec"))


def probe(seconds: float = 10.0) -> None:
    """Time a fixed pure-Python loop on each core every 0.25 s: the host's speed over time."""
    for cpu in sorted(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {cpu})
        times, end = [], time.monotonic() + seconds / 2
        while time.monotonic() < end:
            t = time.perf_counter()
            x = 0
            for i in range(300_000):
                x += i
            times.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.25)
        print(f"core {cpu}: " + " ".join(f"{t:.0f}" for t in times) + " ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="", help="ddp_exp overrides, or 'tight'")
    p.add_argument("--b", default="tight", help="ddp_exp overrides, or 'tight'")
    p.add_argument("--epochs", type=int, default=150,
                   help="long enough that both runs train during the same seconds (start-up "
                        "~4 s, digits epoch ~35 ms)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--probe", action="store_true", help="only time the host's speed")
    args = p.parse_args()
    if args.probe:
        probe()
        return
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        sys.exit("side_by_side needs two cores")
    ratios = []
    for rep in range(args.repeats):
        a_cpu, b_cpu = cpus if rep % 2 == 0 else cpus[::-1]
        with tempfile.TemporaryDirectory(prefix="side-by-side-") as workdir:
            runs = []
            for spec, cpu, name in ((args.a, a_cpu, "a"), (args.b, b_cpu, "b")):
                folder = os.path.join(workdir, name)
                os.makedirs(folder)
                argv, env, out = command(spec, cpu, args.epochs, folder)
                runs.append((subprocess.Popen(argv, env=env, cwd=folder,
                                              stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL), out))
            for proc, _ in runs:
                proc.wait()
            a, b = (samples_per_sec(out) for _, out in runs)
            for name in ("a", "b"):
                elsewhere = os.path.join(workdir, name, "elsewhere")
                if os.path.islink(elsewhere):
                    shutil.rmtree(os.path.realpath(elsewhere), ignore_errors=True)
        ratios.append(a / b)
        print(f"[{rep}] a on core {a_cpu}: {a:9,.0f} samples/s   b on core {b_cpu}: "
              f"{b:9,.0f}   a/b {a / b:.3f}", flush=True)
    print(f"a/b: median {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); a = {args.a!r}, b = {args.b!r}")


if __name__ == "__main__":
    main()
