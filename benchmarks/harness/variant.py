"""What one measured run is (an implementation, a workload, a world size, a batch, epochs) and
the command line that starts it: ``python -m ddp_exp`` with the workload's overrides, or one of
the hand-written scripts of ``benchmarks/baselines/`` as ``python -m benchmarks.baselines.NAME``
(run from the repository's root, as the runner does).

May use: ``benchmarks.workloads`` (the ddp_exp overrides of a workload). The groups
(``benchmarks/groups/``) build their variants from it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from benchmarks import workloads

PY = sys.executable
BASELINES = "benchmarks.baselines"


def script(name: str) -> list[str]:
    """The command that starts the hand-written script ``benchmarks/baselines/<name>.py``."""
    return [PY, "-m", f"{BASELINES}.{name}"]

IMPL_LABELS = {
    "ddp_exp": "ddp_exp",
    "tuned": "hand-tuned script",
    "tight": "tight script (epoch shard, 1 reduce/epoch)",
    "tutorial": "tutorial script (default threads)",
    "tutorial-1t": "tutorial script (1 thread/rank)",
    "handwritten": "hand-written script (Pillow + DataLoader)",
    "lightning": "Lightning Trainer",
    "bare-mp-fork": "bare launch, mp fork",
    "bare-elastic": "bare launch, elastic launcher (fork)",
    "bare-mp-spawn": "bare launch, mp spawn",
}


@dataclass
class Variant:
    group: str
    impl: str
    workload: str
    world_size: int
    batch_size: int
    epochs: int
    num_train: int | None = None
    tree: bool = False  # True: the root process is itself a rank (Lightning's launcher)
    skipped: str | None = None
    overrides: tuple[str, ...] = ()  # ddp_exp: extra overrides (e.g. group perf)
    label: str | None = None  # in the key and the tables, for variants of one impl
    data_path: str | None = None  # the group's data file or folder, made by its ``prepare``
    user_defaults: bool = False  # ddp_exp: default trainer keys (checkpoint, progress, perf)
    world_pss: float = 0.0  # > 0: also read the world's PSS every this many seconds (scaling)

    @property
    def key(self) -> str:
        extra = f"/b{self.batch_size}" if self.group == "threads" else ""
        extra += f"/{self.label}" if self.label else ""
        return f"{self.group}/ws{self.world_size}{extra}/{self.impl}"

    def argv(self, workdir: str) -> list[str]:
        if self.impl == "ddp_exp":
            return [PY, "-m", "ddp_exp", *workloads.ddp_exp_overrides(
                self.workload, self.world_size, self.batch_size, self.epochs, self.num_train,
                self.data_path, self.user_defaults), *self.overrides,
                f"hydra.run.dir={workdir}/job"]
        if self.impl == "handwritten":
            return [*script("ddp_image_folder"), "--data-path",
                    str(self.data_path), "--world-size", str(self.world_size), "--batch-size",
                    str(self.batch_size), "--epochs", str(self.epochs), "--out",
                    f"{workdir}/result.json"]
        if self.impl.startswith("bare-"):
            return [*script("bare_launch"), "--launch",
                    self.impl.removeprefix("bare-"), "--world-size", str(self.world_size),
                    "--out", f"{workdir}/result.json"]
        name = {"tuned": "ddp_tuned", "tight": "ddp_tight", "tutorial": "ddp_tutorial",
                "tutorial-1t": "ddp_tutorial", "lightning": "lightning_digits"}[self.impl]
        argv = [*script(name), "--workload", self.workload,
                "--world-size", str(self.world_size), "--batch-size", str(self.batch_size),
                "--epochs", str(self.epochs), "--out", f"{workdir}/result.json"]
        if self.num_train is not None:
            argv += ["--num-train", str(self.num_train)]
        if self.impl == "tutorial-1t":
            argv += ["--threads-per-rank", "1"]
        return argv
