"""Real datasets (issue 11): image folders, any map-style torch Dataset, DataLoader workers with
per-batch seeding; exact and reproducible at any world size.

User datasets plug in through the public entry: ``data._target_=lazy_data.<name>`` with this
folder on PYTHONPATH (``tests/lazy_data.py``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import QUIET, refused_before_ranks, tests_on_path
from torch.utils.data import DistributedSampler

from ddp_exp.config.errors import ConfigError
from ddp_exp.data.images import ImageFolder, decode, load_image_folder
from ddp_exp.data.lazy import ItemReader, TorchSplit
from ddp_exp.data.loaders import KeyedLoader, batch_seed
from ddp_exp.data.sampling import BatchKeys


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> Path:
    """The 1797 digits as PNG files: ``train/<digit>/`` (first 1500) and ``val/<digit>/``."""
    from lazy_data import write_digits_folder

    return write_digits_folder(tmp_path_factory.mktemp("digits") / "png", split=True)


def _state(job_dir: Path) -> dict:
    return torch.load(job_dir / "model.pt", weights_only=True)


# ------------------------------------------------------------------------- image folders
def test_image_folder_layout_labels_and_pixels(tmp_path):
    """Classes sorted by name and numbered from 0; files sorted; pixels as written."""
    from lazy_data import write_digits_folder

    from ddp_exp.data import load_digits

    write_digits_folder(tmp_path, limit=50)
    folder = ImageFolder(str(tmp_path), channels=1)
    digits = load_digits()
    present = sorted({str(int(t)) for t in digits.targets[:50]})
    assert folder.classes == present
    assert len(folder) == 50
    by_name = {Path(p).name: label for p, label in folder.samples}
    for i in range(50):
        assert folder.classes[by_name[f"{i:04d}.png"]] == str(int(digits.targets[i]))
    x, label = folder[0]
    assert x.dtype == torch.uint8 and x.shape == (1, 8, 8)
    i = int(Path(folder.samples[0][0]).stem)
    # the PNG holds round(255 * pixel); digits' pixels are sixteenths
    assert np.abs(x[0].numpy() / 255 - digits.features[i, 0]).max() <= 0.5 / 255
    rgb = ImageFolder(str(tmp_path))[0][0]
    assert rgb.shape == (3, 8, 8) and all(torch.equal(rgb[c], x[0]) for c in range(3))


def test_image_size_resizes_the_short_side_then_crops_the_centre(tmp_path):
    """A 10x20 (w x h) image whose top and bottom quarters are black and middle white becomes
    8x8 white: shorter side 10 -> 8 (height 16), then the central 8 rows."""
    from PIL import Image

    pixels = np.zeros((20, 10), dtype=np.uint8)
    pixels[5:15] = 255
    Image.fromarray(pixels, mode="L").save(tmp_path / "a.png")
    out = decode(str(tmp_path / "a.png"), image_size=8, channels=1)
    assert out.shape == (1, 8, 8)
    assert (out[0, 1:7] == 255).all()  # interior rows: white only (edges interpolate)
    assert decode(str(tmp_path / "a.png"), None, 3).shape == (3, 20, 10)


def test_train_and_val_subfolders_are_the_splits(digits_folder):
    splits = load_image_folder(str(digits_folder), channels=1)
    train, val = splits["train"], splits["val"]
    assert splits["test"] is None
    assert (len(train), len(val)) == (1500, 297)
    assert train.classes == val.classes == [str(d) for d in range(10)]


def test_val_folder_with_an_unknown_class_is_refused(tmp_path):
    from PIL import Image

    for split, name in (("train", "cat"), ("train", "dog"), ("val", "cat"), ("val", "cow")):
        (tmp_path / split / name).mkdir(parents=True)
        Image.new("L", (4, 4)).save(tmp_path / split / name / "x.png")
    with pytest.raises(ConfigError, match=r"class folder\(s\) \['cow'\]"):
        load_image_folder(str(tmp_path))


# ------------------------------------------------------------------- bad input: one line
def _folder_with_one_class(root: Path) -> str:
    from PIL import Image

    (root / "only").mkdir(parents=True)
    Image.new("L", (8, 8)).save(root / "only" / "a.png")
    return str(root)


def _folder_of_two_sizes(root: Path) -> str:
    from lazy_data import write_digits_folder

    return str(write_digits_folder(root, limit=30, size_of={7: (9, 8)}))


BAD_INPUTS = {
    # id: (overrides, fixture building data.path or None, the words the one line must hold)
    "missing path": (["data=image_folder"], None, "data.path is required"),
    "empty folder": (["data=image_folder"], lambda p: str(p), "holds no class folder"),
    "one class": (["data=image_folder"], _folder_with_one_class, "holds one class folder"),
    "sizes differ": (["data=image_folder"], _folder_of_two_sizes,
                     "data.image_size=null needs images of one size"),
    "not a pair": (["data=dataset", "data._target_=lazy_data.SingleTensors"], None,
                   "not an (input, target) pair"),
    "mapping, no key": (["data=dataset", "data._target_=lazy_data.MappingItems"], None,
                        "data.target_key is required"),
    "not a dataset": (["data=dataset", "data._target_=lazy_data.not_a_dataset"], None,
                      "returned int, not a map-style dataset"),
    "classes differ": (["data=dataset", "data._target_=lazy_data.pair_with_other_classes"], None,
                       "classes ['cat', 'fox'] differ from the training dataset's"),
}


def _bad_input_args(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """The overrides of ``BAD_INPUTS[case]`` (its data folder built under ``tmp_path``) and the
    words its one line must hold."""
    overrides, make_path, words = BAD_INPUTS[case]
    args = list(overrides)
    if make_path is not None:
        root = tmp_path / "data"
        root.mkdir()
        args.append(f"data.path={make_path(root)}")
    return [*args, "world_size=2", QUIET], words


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_before_any_rank_naming_the_key(compose, tmp_path, case):
    args, words = _bad_input_args(tmp_path, case)
    message = refused_before_ranks(compose(*args), tmp_path / "run")
    assert words in message, message
    assert re.search(r"data\.\w+", message), message  # names the key


def test_bad_input_is_one_line_exit_2_no_rank(run_cli, tmp_path):
    """The CLI's side of a bad data input, for one of BAD_INPUTS (a user's dataset module on
    PYTHONPATH); every case is refused in-process, by the same steps, above."""
    args, words = _bad_input_args(tmp_path, "not a dataset")
    run = run_cli(*args, env=tests_on_path(), timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], run.stderr
    key = re.search(r"data\.\w+", errors[0])
    assert key is not None, errors[0]  # names the key
    assert "Traceback" not in run.stderr
    assert "rank0" not in run.stdout  # no rank started
    for made in ("tensorboard", "checkpoints", "metrics.json"):
        assert not (run.job_dir / made).exists(), made


@pytest.mark.slow
@pytest.mark.parametrize("target", ["file", "non-empty folder"])
def test_the_demo_folder_writer_refuses_a_file_or_a_used_folder(tmp_path, target):
    """``python -m ddp_exp.data.images ROOT`` writes into a new or empty folder only: one line,
    exit 2 (bad input, as everywhere), and what was there is untouched."""
    root = tmp_path / "root"
    if target == "file":
        root.write_text("keep me")
    else:
        root.mkdir()
        (root / "notes.txt").write_text("keep me")
    run = subprocess.run([sys.executable, "-m", "ddp_exp.data.images", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    what = "is a file" if target == "file" else "is not empty"
    assert run.stderr.strip() == f"error: {root} {what}: give a new or empty folder", run.stderr
    kept = root if target == "file" else root / "notes.txt"
    assert kept.read_text() == "keep me"
    assert target == "file" or sorted(p.name for p in root.iterdir()) == ["notes.txt"]


# ------------------------------------------- bad data found by a rank while training
def _truncated_image_at_the_end(root: Path) -> str:
    """A digits folder whose last image of class 9 is cut to 60 bytes: with data.image_size
    set, headers are not read up front, so a rank finds it while training."""
    from lazy_data import write_digits_folder

    folder = write_digits_folder(root, limit=200)
    last = sorted((folder / "9").iterdir())[-1]
    last.write_bytes(last.read_bytes()[:60])
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["truncated image", "label out of range"])
def test_bad_data_found_while_training_is_one_line(run_cli, tmp_path, case):
    """Regression (fresh-user pass): a corrupt image met mid-run printed ~80 lines of torch's
    failure table and never named the file; a label out of range printed a traceback."""
    if case == "truncated image":
        path = _truncated_image_at_the_end(tmp_path / "png")
        args = ["data=image_folder", f"data.path={path}", "data.channels=1",
                "data.image_size=8", "data.val_size=20", "model=cnn"]
        words = [path, "cannot read image"]
    else:
        args = ["data=dataset", "data._target_=lazy_data.LabelOutOfRange", "data.val_size=297"]
        words = ["class label 11 is outside 0..9"]
    run = run_cli(*args, "world_size=2", "trainer.epochs=1", QUIET, env=tests_on_path(),
                  timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank "), run.stderr
    assert all(w in lines[0] for w in words), lines
    assert "Traceback" not in run.stdout + run.stderr
    status = json.loads((run.job_dir / "status.json").read_text())
    assert status["status"] == "failed" and words[-1] in status["error"]


@pytest.mark.slow
def test_a_restarted_ranks_error_is_shown(run_cli, tmp_path):
    """Regression (fresh-user pass): a rank that failed and was restarted showed only the
    restart line; its exception was nowhere."""
    marker = tmp_path / "failed-once"
    run = run_cli("data=dataset", "data._target_=lazy_data.FailsOnce",
                  f"+data.marker={marker}", "data.val_size=297", "launcher.max_restarts=1",
                  "trainer.epochs=1", QUIET, env=tests_on_path(), timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert marker.exists()
    log_text = (run.job_dir / "ddp_exp.log").read_text()
    assert "rank 1 failed: RuntimeError: transient failure on rank 1" in log_text
    assert "restart 1 of launcher.max_restarts=1" in log_text


# ---------------------------------------------------------- per-batch seeded randomness
def _draws(rank: int, epochs, workers: int, world_size: int = 2, seed: int = 0):
    """Per epoch, the list of this rank's batches of DrawProbe draws ``[B, 3]``."""
    from lazy_data import Computed, DrawProbe

    data = Computed(num_samples=40, shape=(3,), num_classes=2)
    split = TorchSplit(data, np.arange(40), ItemReader(), (3,), 2, transform=DrawProbe())
    sampler = DistributedSampler(range(40), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed)
    keys = BatchKeys(sampler, 4, seed=seed, rank=rank, random=split.random)
    options = {"num_workers": workers}
    if workers:
        options["persistent_workers"] = True
    loader = KeyedLoader(split, keys, options, seed, rank)
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append([x.clone() for x, _ in loader])
    return out


def test_batch_draws_differ_across_ranks_batches_epochs_and_repeat_exactly():
    """torch's default would give worker k of every rank the same stream when the ranks share a
    seed; here every batch (so every worker), rank and epoch draws its own numbers, the same in
    every rerun and whatever the number of workers."""
    rank0 = _draws(0, (0, 1), workers=2)
    rank1 = _draws(1, (0, 1), workers=2)
    batches = [b for epoch in rank0 + rank1 for b in epoch]
    assert len(batches) == 4 * 5  # 2 ranks x 2 epochs x 5 batches of 4
    rows = torch.cat(batches)
    for column in range(3):  # torch, NumPy and Python draws: no two samples alike
        assert len(set(rows[:, column].tolist())) == len(rows), column
    # consecutive batches go to different workers: they differ as well (covered above); reruns
    # repeat every number, with any number of workers (the seed is the batch's, not the worker's)
    for again in (_draws(0, (0, 1), workers=2), _draws(0, (0, 1), workers=0),
                  _draws(0, (0, 1), workers=1)):
        for e_got, e_ref in zip(again, rank0, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(e_got, e_ref, strict=True))
    # resuming at epoch 1 in a fresh loader draws what epoch 1 drew after epoch 0
    assert all(torch.equal(a, b) for a, b in zip(_draws(0, (1,), 2)[0], rank0[1], strict=True))
    assert not torch.equal(_draws(0, (0,), 0, seed=1)[0][0], rank0[0][0])  # the seed matters


def test_batch_seeds_are_distinct():
    seeds = {batch_seed(s, r, e, b) for s in range(3) for r in range(4) for e in range(5)
             for b in range(50)}
    assert len(seeds) == 3 * 4 * 5 * 50


def test_loader_leaves_the_rank_rng_alone():
    """Iterating an augmented loader (in this process or with workers) draws nothing from the
    rank's own torch RNG, which dropout and the checkpoint's RNG state rely on."""
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    _draws(0, (0, 1), workers=0)
    _draws(0, (0,), workers=1)
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------- end to end, real CLI
@pytest.mark.slow
def test_image_folder_cnn_learns_digits(run_cli, digits_folder):
    """``model=cnn data=image_folder`` with no other key: shape and classes from the files,
    2 decoding workers per rank, val/accuracy >= 0.9 over the 297 files of val/."""
    run = run_cli("model=cnn", "data=image_folder", f"data.path={digits_folder}",
                  "world_size=2", "trainer.epochs=6", QUIET, timeout=240).ok()
    m = run.metrics
    assert m["val/num_samples"] == 297 and m["train/num_samples"] == 1500
    assert m["val/accuracy"] >= 0.9, m


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_lazy_validation_exact_for_world_sizes_1_2_3(run_cli, tmp_path):
    """Must-hold 2: ``optim.lr=0`` on a lazy (train, val) pair with 101 (prime) validation
    samples: val/loss within 1e-6 and val/accuracy identical for world_size 1, 2 and 3, and
    equal to the values computed here in one process from the saved (initial) weights."""
    from lazy_data import computed_pair

    from ddp_exp.train.models import MLP

    common = ("data=dataset", "data._target_=lazy_data.computed_pair", "optim.lr=0.0",
              "trainer.epochs=1", "data.batch_size=16", QUIET)
    runs = {ws: run_cli(*common, f"world_size={ws}", f"data.num_workers={ws - 1}",
                        job=f"ws{ws}", env=tests_on_path(), timeout=180).ok()
            for ws in (1, 2, 3)}
    model = MLP((16,), 3, [128])
    model.load_state_dict(_state(runs[1].job_dir))
    _, val = computed_pair()
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out.double(), y, reduction="sum").item() / 101
    correct = int((out.argmax(1) == y).sum())
    for ws, run in runs.items():
        m = run.metrics
        assert m["val/num_samples"] == 101, ws
        assert m["val/loss"] == pytest.approx(loss, rel=1e-6), ws
        assert round(m["val/accuracy"] * 101) == correct, ws
        assert m["val/accuracy"] == runs[1].metrics["val/accuracy"], ws


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_lazy_path_equals_in_memory_and_world_sizes_agree(run_cli, digits_folder):
    """A Dataset class serving the digits item by item trains bit for bit what ``data=digits``
    trains (same split, same order) and validates it at float32 precision (other batches); and
    an image folder at world_size=3, per-rank batch 8, with a worker, trains the weights of
    world_size=1, batch 24 (DDP equivalence, relative 1e-5)."""
    common = ("trainer.epochs=1", QUIET)
    arrays = run_cli("data=digits", "world_size=3", "data.batch_size=8", *common,
                     job="arrays").ok()
    lazy = run_cli("data=dataset", "data._target_=lazy_data.DigitsDataset", "data.val_size=297",
                   "world_size=3", "data.batch_size=8", *common, job="lazy",
                   env=tests_on_path()).ok()
    for key in ("train/epoch_loss", "val/accuracy"):
        assert lazy.metrics[key] == arrays.metrics[key], key
    # validation batches of 8 here, 512 for arrays: the float32 forward sums in another order,
    # which another CPU's kernels round differently (1e-9 held here, 4e-9 apart with AVX512)
    assert lazy.metrics["val/loss"] == pytest.approx(arrays.metrics["val/loss"], rel=1e-6)
    a, b = _state(arrays.job_dir), _state(lazy.job_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)

    folder = ("data=image_folder", f"data.path={digits_folder}", "data.channels=1")
    one = run_cli(*folder, "world_size=1", "data.batch_size=24", "data.num_workers=0",
                  *common, job="one").ok()
    three = run_cli(*folder, "world_size=3", "data.batch_size=8", "data.num_workers=1",
                    *common, job="three").ok()
    assert one.metrics["global_batch_size"] == three.metrics["global_batch_size"] == 24
    s1, s3 = _state(one.job_dir), _state(three.job_dir)
    for k in s1:
        torch.testing.assert_close(s3[k], s1[k], rtol=1e-5, atol=1e-6, msg=k)
    assert three.metrics["val/loss"] == pytest.approx(one.metrics["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_nothing_is_materialised(run_cli):
    """Must-hold 3: 1,000,000 samples of [3, 32, 32] (12.3 GB as one float32 array) train 50
    steps at world_size=2 with every rank's peak resident memory under 1.5 GB."""
    run = run_cli("data=dataset", "data._target_=lazy_data.Computed",
                  "+data.num_samples=1000000", "+data.shape=[3,32,32]", "+data.num_classes=10",
                  "data.val_size=64", "world_size=2", "trainer.max_steps=50",
                  "data.num_workers=1", QUIET, env=tests_on_path(), timeout=240).ok()
    m = run.metrics
    assert 1_000_000 * 3 * 32 * 32 * 4 >= 4e9
    assert m["global_step"] == 50 and m["val/num_samples"] == 64
    assert 0 < m["perf/max_rss_mb"] < 1.5 * 1024, m["perf/max_rss_mb"]


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_killed_augmented_run_with_workers_resumes_exactly(run_cli, tmp_path, digits_folder):
    """Must-hold 4: ``data.num_workers=2 data.augment=true``, rank 1 SIGKILLed in epoch 2 after
    epoch 1's checkpoint, then resumed with ``trainer.resume=auto``: the weights of a run never
    interrupted (1e-6)."""
    from helpers import UNREACHABLE, faulty_args, load_ckpt

    env = tests_on_path()
    common = ("data=image_folder", f"data.path={digits_folder}", "data.channels=1",
              "data.augment=true", "data.num_workers=2", "world_size=2", "trainer.epochs=2",
              "launcher.max_restarts=0", QUIET)
    steps = 24  # 1500 / 2 ranks / 32 per rank
    reference = run_cli(*faulty_args(tmp_path / "c1", fault="none"), *common, job="ref",
                        env=env).ok()
    killed = run_cli(*faulty_args(tmp_path / "c2", fault="kill", fault_step=steps + 5,
                                  after_checkpoint=str(tmp_path / "job/checkpoints/last.pt"),
                                  after_epoch=0), *common, job="job", env=env)
    assert killed.returncode != 0
    assert load_ckpt(killed.job_dir / "checkpoints" / "last.pt")["epoch"] == 0
    resumed = run_cli(*faulty_args(tmp_path / "c2", fault="kill", fault_step=UNREACHABLE),
                      *common, "trainer.resume=auto", job="job", env=env).ok()
    assert "epoch 2/2" in resumed.stdout and "epoch 1/2" not in resumed.stdout
    a, b = _state(reference.job_dir), _state(resumed.job_dir)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    ref = json.loads((reference.job_dir / "metrics.json").read_text())
    assert resumed.metrics["val/loss"] == pytest.approx(ref["val/loss"], rel=1e-6)


# ------------------------------------------------------------------- data.standardize
def _scaled_csv(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """60 rows of 3 features on very different scales, and a class label."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((60, 3)) * [1000.0, 1.0, 0.001] + [5e4, -3.0, 0.0]
    y = (x[:, 1] > -3.0).astype(int)
    path = tmp_path / "wide.csv"
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", fmt="%.9g")
    return path, x, y


def test_standardize_uses_training_statistics_only(tmp_path):
    from ddp_exp.data import build_datasets, load, load_file

    path, _, _ = _scaled_csv(tmp_path)
    cfg = {"_target_": "ddp_exp.data.load_file", "path": str(path), "task": "auto",
           "val_size": 20, "batch_size": 8, "shuffle": True, "num_workers": 0,
           "standardize": True}
    scaled = load(cfg, seed=0, world_size=2)
    raw = build_datasets(load_file(str(path)), 20, 0, 2)  # the same split, unscaled
    train = raw.train.features.astype(np.float64)
    mean, std = train.mean(axis=0), train.std(axis=0)
    np.testing.assert_allclose(scaled.standardization["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(scaled.standardization["std"], std, rtol=1e-12)
    np.testing.assert_allclose(scaled.train.features.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(scaled.train.features.std(axis=0), 1, rtol=1e-4)
    np.testing.assert_allclose(scaled.val.features, (raw.val.features - mean) / std,
                               rtol=1e-5, atol=1e-5)  # validation: the training statistics
    assert np.array_equal(scaled.val.targets, raw.val.targets)
    unscaled = load({**cfg, "standardize": False}, seed=0, world_size=2)
    assert unscaled.standardization is None
    assert np.array_equal(unscaled.train.features, raw.train.features)


def test_standardize_writes_its_statistics(run_cli, tmp_path):
    path, _, _ = _scaled_csv(tmp_path)
    run = run_cli("data=file", f"data.path={path}", "data.val_size=20", "data.standardize=true",
                  "world_size=1", "trainer.epochs=1", QUIET).ok()
    stats = json.loads((run.job_dir / "standardization.json").read_text())
    assert len(stats["mean"]) == len(stats["std"]) == 3
    assert stats["mean"][0] == pytest.approx(5e4, rel=0.01)  # the first feature's scale


def test_split_folders_need_not_all_be_there(tmp_path):
    """train/ and test/ without val/: test/ is the test split and validation is held out of
    train/ (the split folders were once taken for two classes); val/ alone is refused."""
    from lazy_data import write_digits_folder

    from ddp_exp.data import load

    write_digits_folder(tmp_path / "all", split=True)
    (tmp_path / "tt").mkdir()
    (tmp_path / "all" / "train").rename(tmp_path / "tt" / "train")
    (tmp_path / "all" / "val").rename(tmp_path / "tt" / "test")
    cfg = {"_target_": "ddp_exp.data.images.load_image_folder", "path": str(tmp_path / "tt"),
           "image_size": None, "channels": 1, "augment": False, "mean": None, "std": None,
           "transform": None, "val_size": 100, "test_size": 0, "batch_size": 8,
           "shuffle": True, "num_workers": 0}
    data = load(cfg, seed=0, world_size=2)
    assert (len(data.train), len(data.val), len(data.test)) == (1400, 100, 297)
    assert data.train.num_classes == 10
    with pytest.raises(ConfigError, match="data.test_size=5 is invalid here"):
        load({**cfg, "test_size": 5}, seed=0, world_size=2)
    (tmp_path / "tt" / "train").rename(tmp_path / "tt" / "val")
    with pytest.raises(ConfigError, match="but no train/"):
        load(cfg, seed=0, world_size=2)


def test_given_splits_are_read_once_and_their_transform_built_once(digits_folder,
                                                                  monkeypatch):
    """Item 0 of each split is read once, and data.transform built once, however many splits
    are given (the training set's item 0 was read, and the transform built, again per split)."""
    from lazy_data import CountedTransform

    from ddp_exp.data import load

    common = {"val_size": 0, "test_size": 0, "batch_size": 8, "shuffle": True,
              "num_workers": 0, "input_key": None, "target_key": None}
    data = load({"_target_": "lazy_data.counted_splits", "task": "auto", "num_classes": None,
                 **common}, seed=0, world_size=2)
    assert [part.dataset.reads for part in (data.train, data.val, data.test)] == [[0]] * 3
    assert (len(data.train), len(data.val), len(data.test)) == (200, 50, 40)

    reads: list[tuple[str, int]] = []
    read = ImageFolder.__getitem__
    monkeypatch.setattr(ImageFolder, "__getitem__",
                        lambda self, i: reads.append((Path(self.root).name, i)) or read(self, i))
    monkeypatch.setattr(CountedTransform, "built", 0)
    cfg = {"_target_": "ddp_exp.data.images.load_image_folder", "path": str(digits_folder),
           "image_size": None, "channels": 1, "augment": False, "mean": None, "std": None,
           "transform": {"_target_": "lazy_data.CountedTransform"}, **common}
    data = load(cfg, seed=0, world_size=2)
    assert sorted(reads) == [("train", 0), ("val", 0)]
    assert CountedTransform.built == 1
    assert data.train.transform.transform is not None and data.val.transform.transform is None


def test_given_splits_with_other_classes_are_refused():
    """A (train, val) pair whose ``classes`` differ would give one label two meanings: refused
    with one line naming both lists, as a val/ folder with a class unknown to train/ is."""
    from ddp_exp.data import load

    cfg = {"_target_": "lazy_data.pair_with_other_classes", "val_size": 0, "batch_size": 8,
           "shuffle": True, "num_workers": 0, "task": "auto", "num_classes": None,
           "input_key": None, "target_key": None}
    with pytest.raises(ConfigError) as caught:
        load(cfg, seed=0, world_size=2)
    message = str(caught.value)
    assert "\n" not in message
    assert "['cat', 'fox']" in message and "['cat', 'dog', 'fox']" in message, message
    assert "validation dataset's classes" in message and "from label 1 on" in message, message
    load({**cfg, "_target_": "lazy_data.computed_pair"}, seed=0, world_size=2)  # same: fine


def test_a_class_folder_without_images_is_refused(tmp_path):
    from lazy_data import write_digits_folder

    write_digits_folder(tmp_path, limit=40)
    (tmp_path / "zebra").mkdir()
    (tmp_path / "zebra" / "notes.txt").write_text("no image here")
    with pytest.raises(ConfigError, match=r"class folder\(s\) \['zebra'\] hold no image"):
        load_image_folder(str(tmp_path))


def test_validation_and_test_batches_draw_their_own_numbers():
    """N03: batch n of validation or test never repeats batch n of training's draws, and
    validation draws differ between epochs."""
    from ddp_exp.data.loaders import TEST, TRAIN, VAL

    seeds = {(stream, epoch): batch_seed(0, 1, epoch, 3, stream)
             for stream in (TRAIN, VAL, TEST) for epoch in (0, 1)}
    assert len(set(seeds.values())) == len(seeds)
    assert batch_seed(0, 1, 0, 3) == seeds[(TRAIN, 0)]  # training's seeds are unchanged


def test_the_launcher_reads_a_datasets_item_0_once(compose, tmp_path):
    """Regression: before the ranks start, the launching process read item 0 of a user's
    Dataset twice: once to learn the shapes and the task (``ddp_exp.data.lazy.describe``), once
    more in the objective's probe of the first training samples (``ddp_exp.launch.build``). A
    Dataset
    that decodes a file or draws at random paid for it twice."""
    from ddp_exp.launch import elastic as launch

    cfg = compose("world_size=1", "trainer.epochs=1", "data=dataset",
                  "data._target_=lazy_data.counted_splits")
    job_dir = tmp_path / "run"
    job_dir.mkdir()
    _, inputs = launch.prepare_world(cfg, str(job_dir), 1)
    train = inputs.datasets.train
    assert 0 in train.indices[:2]  # the probe's samples hold item 0: it would be read again
    assert train.dataset.reads.count(0) == 1, train.dataset.reads
    assert len(train.dataset.reads) == 2  # item 0, then the probe's other sample
    assert inputs.datasets.items_read == {}  # the ranks read every item themselves
