"""The benchmark workloads (issue 5), shared by the hand-written scripts and the runner.

The arrays are the ones ddp_exp trains on, bit for bit: :func:`load` repeats what
``ddp_exp.data.load_digits`` / ``make_synthetic`` / ``build_datasets`` do, in NumPy alone, so the
hand-written scripts do not pay for importing ddp_exp (``ddp_exp.data`` imports Hydra, ~0.5 s).
``python -m benchmarks`` checks the arrays against ddp_exp's own loaders before it measures
anything (:func:`check_against_ddp_exp`).

May use: the standard library and NumPy (Pillow and ddp_exp lazily); the bottom of
``benchmarks/``: every other module may import it.

Workloads:

* ``digits``: scikit-learn's 8x8 digits, 297 validation samples held out by seed 0 (1500
  training samples), MLP 64-128-10, 32 samples per rank, 20 epochs.
* ``compute``: ``make_synthetic`` with 10 classes from a random linear teacher, 16,384 training
  samples of 512 features (+1,024 validation), MLP 512-2048-2048-10, 256 per rank, 2 epochs.
* ``image_folder`` (issue 11): the same digits written as 8x8 grey PNG files
  (:func:`write_digits_pngs`, ``root/<digit>/<index>.png``), decoded with Pillow by 2 DataLoader
  workers per rank; 297 files held out by seed 0 as ddp_exp holds them out
  (:func:`image_folder_split`), ``model=cnn`` (conv 32, conv 64, 128 hidden), 32 per rank, 5
  epochs.
* ``lm`` (issue 29, the ``lm`` group): ``experiment=gpt_tokens``'s GPT (2 layers, width
  128, 4 heads, context 128) on the built-in corpus written as a uint16 ``.bin``, 16 windows per
  rank, 60 steps, AdamW lr 0.003 with 10 warmup steps, clipping 1.0.
* ``synthetic`` (issue 13 point 3, the ``scaling`` and ``memory`` groups; ddp_exp only, no
  script reads it): ddp_exp's ``data=synthetic`` defaults (4,096 samples of 32 features, 512
  held out, regression) and ``model=mlp`` (one hidden layer of 128), 32 per rank, 10 epochs,
  SGD lr 0.002 (at 0.05 the loss of the 2,048-wide MLP overflows within 10 steps; the lr
  changes no step's cost); the group changes ``data.num_samples`` and ``model.hidden_sizes``.
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np

SEED = 0
LR, MOMENTUM = 0.05, 0.9
LOG_EVERY_N_STEPS = 10  # ddp_exp's trainer.log_every_n_steps default: one host sync per interval

WORKLOADS = {
    "digits": {"hidden": [128], "batch_size": 32, "epochs": 20, "val_size": 297},
    "compute": {"hidden": [2048, 2048], "batch_size": 256, "epochs": 2, "val_size": 1024,
                "num_train": 16384, "num_features": 512, "num_classes": 10, "noise_std": 0.1},
    "image_folder": {"channels": [32, 64], "hidden": [128], "batch_size": 32, "epochs": 5,
                     "val_size": 297, "num_workers": 2},
    "synthetic": {"hidden": [128], "batch_size": 32, "epochs": 10, "val_size": 512,
                  "num_samples": 4096, "num_features": 32, "lr": 0.002, "ddp_exp_only": True},
    # issue 29 (groups/lm.py, baselines/nanogpt_loop.py): experiment=gpt_tokens's settings
    "lm": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "vocab_size": 256,
           "batch_size": 16, "steps": 60, "limit_val_batches": 4, "lr": 0.003,
           "weight_decay": 0.1, "warmup_steps": 10, "min_lr": 0.0003, "grad_clip": 1.0},
}


def digits_csv() -> str:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-learn is not installed (ddp_exp depends on it)")
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


def _digits() -> tuple[np.ndarray, np.ndarray, int]:
    table = np.loadtxt(digits_csv(), delimiter=",", dtype=np.float64)
    pixels, labels = table[:, :-1], table[:, -1].astype(np.int64)
    return (pixels / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), labels, 10


def _synthetic(num_samples: int, num_features: int, num_classes: int, noise_std: float,
               seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_samples, num_features), dtype=np.float32)
    teacher = rng.standard_normal((num_features, num_classes),
                                  dtype=np.float32) / math.sqrt(num_features)
    scores = x @ teacher + noise_std * rng.standard_normal((num_samples, num_classes),
                                                           dtype=np.float32)
    return x, scores.argmax(axis=1).astype(np.int64), num_classes


def lm_warmup_steps(steps: int) -> int:
    """The ``lm`` workload's warmup steps for a run of ``steps`` (fewer in a short smoke run:
    ddp_exp refuses a warmup that does not end before the last step)."""
    return min(WORKLOADS["lm"]["warmup_steps"], steps // 2)


def spec(name: str, num_train: int | None = None) -> dict:
    """The workload's settings; ``num_train`` shrinks the compute workload (quick runs)."""
    w = dict(WORKLOADS[name])
    if num_train is not None and name == "compute":
        w["num_train"] = num_train
    return w


def load(name: str, num_train: int | None = None):
    """``(x_train, y_train, x_val, y_val, num_classes)`` as NumPy arrays, exactly ddp_exp's."""
    w = spec(name, num_train)
    if name == "digits":
        x, y, k = _digits()
    else:
        x, y, k = _synthetic(w["num_train"] + w["val_size"], w["num_features"],
                             w["num_classes"], w["noise_std"], SEED)
    perm = np.random.default_rng(SEED).permutation(len(x))  # = ddp_exp.data.build_datasets
    val_idx, train_idx = np.sort(perm[:w["val_size"]]), np.sort(perm[w["val_size"]:])
    return x[train_idx], y[train_idx], x[val_idx], y[val_idx], k


def write_digits_pngs(root: str) -> str:
    """The digits as 8x8 grey PNG files ``root/<digit>/<index>.png`` (pixel ``round(v / 16 *
    255)``, as ``tests/lazy_data.write_digits_folder``), 1,797 files. Returns ``root``."""
    from PIL import Image

    x, y, _ = _digits()
    for i in range(len(x)):
        folder = os.path.join(root, str(int(y[i])))
        os.makedirs(folder, exist_ok=True)
        pixels = np.round(x[i, 0] * 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i:04d}.png"))
    return root


def image_folder_split(root: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(train, val)`` lists of ``(path, class index)`` of an image folder, as ddp_exp makes
    them: classes are the sorted sub-folder names, files sorted within a class, and
    ``val_size`` files held out by a seed-0 permutation of that list (``build_datasets``)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    files = [(os.path.join(root, c, f), label) for label, c in enumerate(classes)
             for f in sorted(os.listdir(os.path.join(root, c)))]
    perm = np.random.default_rng(SEED).permutation(len(files))
    val_size = WORKLOADS["image_folder"]["val_size"]
    val_idx, train_idx = np.sort(perm[:val_size]), np.sort(perm[val_size:])
    return [files[i] for i in train_idx], [files[i] for i in val_idx]


def ddp_exp_overrides(name: str, world_size: int, batch_size: int, epochs: int,
                      num_train: int | None = None, data_path: str | None = None,
                      user_defaults: bool = False) -> list[str]:
    """The ``python -m ddp_exp`` overrides of the same job (no checkpoints, logs or config dump);
    ``data_path``: the image folder of the ``image_folder`` workload; ``synthetic``: without
    ``data.num_samples`` and ``model.hidden_sizes`` (the caller adds them). ``user_defaults``: keep
    what a user runs (``trainer.save_last``, ``trainer.progress``, ``print_config`` and
    ``trainer.perf_metrics`` at their defaults: checkpoint, progress lines, config dump, timer)."""
    w = spec(name, num_train)
    common = [f"world_size={world_size}", "backend=gloo", f"seed={SEED}",
              f"data.batch_size={batch_size}", f"trainer.epochs={epochs}",
              f"trainer.log_every_n_steps={LOG_EVERY_N_STEPS}",
              "optim=sgd", f"optim.lr={w.get('lr', LR)}", f"optim.momentum={MOMENTUM}"]
    if not user_defaults:
        common += ["trainer.save_last=false", "print_config=false", "trainer.progress=off"]
    if name == "image_folder":
        return ["data=image_folder", f"data.path={data_path}", "data.channels=1",
                f"data.val_size={w['val_size']}", f"data.num_workers={w['num_workers']}",
                "model=cnn", "model.channels=[" + ",".join(map(str, w["channels"])) + "]",
                f"model.hidden_size={w['hidden'][0]}"] + common
    if name == "synthetic":  # data.num_samples and model.hidden_sizes: the variant's own
        return ["data=synthetic", f"data.num_features={w['num_features']}",
                f"data.val_size={w['val_size']}", "model=mlp"] + common
    common += ["model=mlp", "model.hidden_sizes=[" + ",".join(map(str, w["hidden"])) + "]"]
    if name == "digits":
        return ["data=digits", f"data.val_size={w['val_size']}"] + common
    return ["data=synthetic", f"data.num_classes={w['num_classes']}",
            f"data.num_features={w['num_features']}",
            f"data.num_samples={w['num_train'] + w['val_size']}",
            f"data.val_size={w['val_size']}", f"data.noise_std={w['noise_std']}"] + common


def check_against_ddp_exp(name: str, num_train: int | None = None) -> None:
    """Raise AssertionError unless :func:`load` gives ddp_exp's arrays exactly (``digits`` and
    ``compute``; the image folder and the token file are checked by their groups:
    ``benchmarks/groups/image_folder.py`` and ``lm.py``)."""
    from ddp_exp import data

    w = spec(name, num_train)
    if name == "digits":
        ds = data.load_digits()
    else:
        ds = data.make_synthetic(w["num_train"] + w["val_size"], w["num_features"],
                                 w["num_classes"], w["noise_std"], SEED)
    split = data.build_datasets(ds, w["val_size"], SEED, 1)
    mine = load(name, num_train)
    theirs = (split.train.features, split.train.targets, split.val.features, split.val.targets)
    for a, b in zip(mine[:4], theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert mine[4] == split.num_classes, name
