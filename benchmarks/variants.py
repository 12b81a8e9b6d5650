"""The benchmark's variants and groups: what one measured run is (an implementation, a workload,
a world size, a batch, epochs) and the command line that starts it.

May use: ``common`` (paths), ``workloads`` (the ddp_exp overrides of a workload). Used by the
runner's other modules (``measure``, ``targets``, ``report``, ``run``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import common
import workloads

BENCH = common.BENCH
PY = sys.executable

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
    overrides: tuple[str, ...] = ()  # ddp_exp: extra overrides (group perf)
    label: str | None = None  # in the key and the tables, for variants of one impl
    data_path: str | None = None  # the image folder (workload image_folder), made by main()
    user_defaults: bool = False  # ddp_exp: default trainer keys (checkpoint, progress, perf)
    world_pss: float = 0.0  # > 0: also read the world's PSS every this many seconds (scaling)

    @property
    def key(self) -> str:
        extra = f"/b{self.batch_size}" if self.group == "c17" else ""
        extra += f"/{self.label}" if self.label else ""
        return f"{self.group}/ws{self.world_size}{extra}/{self.impl}"

    def argv(self, workdir: str) -> list[str]:
        if self.impl == "ddp_exp":
            return [PY, "-m", "ddp_exp", *workloads.ddp_exp_overrides(
                self.workload, self.world_size, self.batch_size, self.epochs, self.num_train,
                self.data_path, self.user_defaults), *self.overrides,
                f"hydra.run.dir={workdir}/job"]
        if self.impl == "handwritten":
            return [PY, os.path.join(BENCH, "ddp_image_folder.py"), "--data-path",
                    str(self.data_path), "--world-size", str(self.world_size), "--batch-size",
                    str(self.batch_size), "--epochs", str(self.epochs), "--out",
                    f"{workdir}/result.json"]
        if self.impl.startswith("bare-"):
            return [PY, os.path.join(BENCH, "startup.py"), "--launch",
                    self.impl.removeprefix("bare-"), "--world-size", str(self.world_size),
                    "--out", f"{workdir}/result.json"]
        script = {"tuned": "ddp_tuned.py", "tight": "ddp_tight.py", "tutorial": "ddp_tutorial.py",
                  "tutorial-1t": "ddp_tutorial.py", "lightning": "lightning_digits.py"}[self.impl]
        argv = [PY, os.path.join(BENCH, script), "--workload", self.workload,
                "--world-size", str(self.world_size), "--batch-size", str(self.batch_size),
                "--epochs", str(self.epochs), "--out", f"{workdir}/result.json"]
        if self.num_train is not None:
            argv += ["--num-train", str(self.num_train)]
        if self.impl == "tutorial-1t":
            argv += ["--threads-per-rank", "1"]
        return argv


def build_variants(quick: bool) -> dict[str, list[Variant]]:
    """The groups of issue 5 (``quick``: 1 epoch, 2,048 compute samples)."""
    groups: dict[str, list[Variant]] = {}
    for wl in ("digits", "compute"):
        w = workloads.spec(wl)
        epochs = 1 if quick else w["epochs"]
        num_train = 2048 if quick and wl == "compute" else None
        vs = []
        for ws in (1, 2):
            impls = ["ddp_exp", "tuned", "tutorial"] + (["tutorial-1t"] if ws > 1 else []) + [
                "lightning"]
            vs += [Variant(wl, impl, wl, ws, w["batch_size"], epochs, num_train,
                           tree=impl == "lightning") for impl in impls]
            # Issue 13: what a user runs (checkpoint, progress, perf timer on) against the
            # tightest hand-written loop.
            vs += [Variant(wl, "ddp_exp", wl, ws, w["batch_size"], epochs, num_train,
                           label="defaults", user_defaults=True),
                   Variant(wl, "tight", wl, ws, w["batch_size"], epochs, num_train)]
        groups[wl] = vs
    d = workloads.spec("digits")
    groups["startup"] = [Variant("startup", "ddp_exp", "digits", 2, d["batch_size"], 1)] + [
        Variant("startup", impl, "digits", 2, d["batch_size"], 1)
        for impl in ("bare-mp-fork", "bare-elastic", "bare-mp-spawn", "tuned")] + [
        Variant("startup", "ddp_exp", "digits", 2, d["batch_size"], 1, label="defaults",
                user_defaults=True),
        Variant("startup", "tight", "digits", 2, d["batch_size"], 1)]
    b = d["batch_size"]
    c17_epochs = 1 if quick else d["epochs"]
    groups["c17"] = [Variant("c17", "ddp_exp", "digits", ws, bs, c17_epochs)
                     for ws, bs in ((1, 2 * b), (2, b), (4, b // 2))]
    groups["perf"] = [Variant("perf", "ddp_exp", "digits", 2, b, c17_epochs,
                              overrides=(f"trainer.perf_metrics={on}",), label=f"perf-{on}")
                      for on in ("true", "false")]
    # Issue 30: a step checkpoint every 50 steps (digits: 24 steps an epoch at world_size 2,
    # so one about every other epoch, written on the background thread) against none.
    groups["step_checkpoint"] = [
        Variant("step_checkpoint", "ddp_exp", "digits", 2, b, c17_epochs,
                overrides=(f"trainer.checkpoint_every_n_steps={every}",), label=f"every-{every}")
        for every in ("50", "null")]
    # world_size 2 only: at 1, the rank's 2 intra-op threads (cores // world_size) and its 2
    # decoding workers share 2 cores, and both implementations crawl (70-150 samples/s against
    # ~1,300 at world_size 2, 1-2 minutes a run): noise, not a comparison of the data paths.
    im = workloads.spec("image_folder")
    groups["image_folder"] = [
        Variant("image_folder", impl, "image_folder", 2, im["batch_size"],
                1 if quick else im["epochs"]) for impl in ("ddp_exp", "handwritten")]
    return groups
