"""The ``image_folder`` group (issue 11): the digits as 8x8 grey PNG files in a temporary folder
(:func:`prepare`), ``data=image_folder model=cnn`` with 2 DataLoader workers per rank against
the hand-written Pillow + DataLoader + DDP script on the same files
(``benchmarks/baselines/ddp_image_folder.py``), 32 per rank, 5 epochs, world_size 2.

World size 2 only: at 1, the rank's 2 intra-op threads (cores // world_size) and its 2 decoding
workers share 2 cores, and both implementations crawl (70-150 samples/s against ~1,300 at world
size 2, 1-2 minutes a run): noise, not a comparison of the data paths.

May use: ``benchmarks.workloads``, ``benchmarks.baselines`` (the script's dataset and CNN, for
:func:`check`), ``benchmarks.harness``.
"""

from __future__ import annotations

import os
import tempfile

from benchmarks import workloads
from benchmarks.harness.group import Group
from benchmarks.harness.stats import Target
from benchmarks.harness.variant import Variant
from benchmarks.workloads import SEED


def variants(quick: bool) -> list[Variant]:
    im = workloads.spec("image_folder")
    return [Variant("image_folder", impl, "image_folder", 2, im["batch_size"],
                    1 if quick else im["epochs"]) for impl in ("ddp_exp", "handwritten")]


def targets() -> list[Target]:
    return [Target("image_folder.ws2.vs_script", "image folder, ws=2: ddp_exp / hand-written "
                   "script, samples/s", "image_folder/ws2/ddp_exp",
                   "image_folder/ws2/handwritten", "samples_per_sec", ">=", 0.95)]


def prepare(vs: list[Variant]) -> str | None:
    """Write the digits as PNG files into a new temporary folder and point ``vs`` at it;
    returns the folder (the runner deletes it)."""
    if not vs:
        return None
    root = workloads.write_digits_pngs(tempfile.mkdtemp(prefix="ddp_exp-bench-images-"))
    for v in vs:
        v.data_path = root
    return root


def check(vs: list[Variant]) -> list[str]:
    """:func:`check_image_folder` on the group's folder."""
    roots = sorted({str(v.data_path) for v in vs})
    for root in roots:
        check_image_folder(root)
    return ["image_folder (files, split, decoded pixels and initial CNN weights)"] if roots else []


def check_image_folder(root: str) -> None:
    """Raise AssertionError unless the hand-written script (``ddp_image_folder.py``) trains on
    what ddp_exp's ``data=image_folder data.channels=1`` reads from ``root``: the same training
    and validation files in the same order, the same labels and float32 pixels, and a CNN with
    the same initial weights as ``ddp_exp.train.models.CNN`` under seed 0."""
    import torch

    from benchmarks.baselines import ddp_image_folder as script
    from ddp_exp import data
    from ddp_exp.train.models import CNN

    w = workloads.spec("image_folder")
    theirs = data.load({"_target_": "ddp_exp.data.images.load_image_folder", "path": root,
                        "image_size": None, "channels": 1, "val_size": w["val_size"],
                        "batch_size": w["batch_size"], "num_workers": 0}, SEED, 1)
    for mine, part in zip(workloads.image_folder_split(root), (theirs.train, theirs.val),
                          strict=True):
        files = [part.dataset.samples[i] for i in part.indices]
        rel = [(os.path.relpath(p, root), label) for p, label in files]
        assert rel == [(os.path.relpath(p, root), label) for p, label in mine], "file lists"
        x, y = part.batch(range(len(part)))
        items = script.PngFiles(mine)
        assert torch.equal(x, torch.stack([items[i][0] for i in range(len(items))])), "pixels"
        assert y.tolist() == [label for _, label in mine], "labels"
    shape, classes = theirs.train.input_shape, theirs.train.num_classes
    torch.manual_seed(SEED)
    reference = CNN(shape, classes, w["channels"], w["hidden"][0])
    built = script.build_cnn(shape[0], shape[-1], classes, w["channels"], w["hidden"][0])
    a, b = list(reference.parameters()), list(built.parameters())
    assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), \
        "initial CNN weights"


IMAGE_FOLDER = Group(
    "image_folder", "Image folder: digits as 8x8 PNG files, Pillow, 2 DataLoader workers per "
    "rank, model=cnn, 32 per rank", variants, targets, prepare=prepare, check=check,
    notes=("Image folder: the runner writes the digits as 1,797 grey 8x8 PNG files into a "
           "temporary folder; ddp_exp runs `data=image_folder data.channels=1 data.val_size=297 "
           "data.num_workers=2 model=cnn`, the hand-written script "
           "(`benchmarks/baselines/ddp_image_folder.py`) a Pillow `Dataset` with "
           "`DataLoader(num_workers=2, persistent_workers=True)`, a `DistributedSampler` and "
           "torch's default collate. Checked at the start: the same training and validation "
           "files and decoded pixels, and the same initial CNN weights (seed 0). Both include "
           "the start of the loader's workers (first epoch) in the loop time.",))
