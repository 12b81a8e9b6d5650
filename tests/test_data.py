"""Datasets, the seeded validation split, user files, and the per-rank data path."""

from __future__ import annotations

import gc
import math
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_exp.config.errors import ConfigError
from ddp_exp.data import (
    ArrayDataset,
    build_datasets,
    load_digits,
    load_file,
    make_synthetic,
)
from ddp_exp.data.loaders import KeyedLoader, TrainLoader, val_batches
from ddp_exp.data.sampling import BatchKeys, shard_order


# --------------------------------------------------------------------------------- digits
def test_load_digits_equals_scikit_learn():
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    ds = load_digits()
    assert ds.features.shape == (1797, 1, 8, 8)
    assert ds.features.dtype == np.float32
    expected = (bunch.data / 16.0).reshape(1797, 1, 8, 8)
    np.testing.assert_allclose(ds.features, expected, rtol=0, atol=1e-7)
    assert ds.features.min() == 0.0 and ds.features.max() == 1.0
    assert ds.targets.dtype == np.int64
    np.testing.assert_array_equal(ds.targets, bunch.target)
    assert ds.num_classes == 10
    assert ds.input_shape == (1, 8, 8)
    assert ds.num_outputs == 10


# ------------------------------------------------------------------------------ synthetic
def test_make_synthetic_is_seeded():
    a = make_synthetic(256, 8, seed=3)
    b = make_synthetic(256, 8, seed=3)
    c = make_synthetic(256, 8, seed=4)
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.targets, b.targets)
    assert not np.array_equal(a.features, c.features)
    assert not np.array_equal(a.targets, c.targets)

    ka = make_synthetic(256, 8, num_classes=3, seed=3)
    kb = make_synthetic(256, 8, num_classes=3, seed=3)
    kc = make_synthetic(256, 8, num_classes=3, seed=4)
    np.testing.assert_array_equal(ka.targets, kb.targets)
    assert not np.array_equal(ka.targets, kc.targets)


def test_make_synthetic_regression():
    n, f, noise = 4096, 32, 0.1
    ds = make_synthetic(n, f, num_classes=0, noise_std=noise, seed=0)
    assert ds.features.shape == (n, f) and ds.features.dtype == np.float32
    assert ds.targets.shape == (n, 1) and ds.targets.dtype == np.float32
    assert ds.num_classes == 0 and ds.num_outputs == 1
    # y = x @ w + noise: a least-squares fit leaves residuals with the noise's std.
    x = ds.features.astype(np.float64)
    y = ds.targets.astype(np.float64)
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual_std = float(np.std(y - x @ w))
    assert residual_std == pytest.approx(noise, rel=0.1)
    assert float(np.std(y)) > 5 * noise  # the signal is not just noise


@pytest.mark.parametrize("k", [2, 4, 10])
def test_make_synthetic_classification(k):
    ds = make_synthetic(2048, 16, num_classes=k, seed=1)
    assert ds.targets.shape == (2048,)
    assert np.issubdtype(ds.targets.dtype, np.integer)
    assert ds.targets.min() >= 0 and ds.targets.max() < k
    assert len(np.unique(ds.targets)) > 1
    assert ds.num_classes == k and ds.num_outputs == k


# ---------------------------------------------------------------------------- the split
def _indexed(n: int) -> ArrayDataset:
    """A dataset whose sample i carries i as its feature and its label."""
    return ArrayDataset(np.arange(n, dtype=np.float32).reshape(n, 1),
                        np.arange(n, dtype=np.int64), num_classes=n)


@pytest.mark.parametrize("n,val_size", [(1797, 297), (100, 33), (10, 0), (10, 7)])
def test_build_datasets_holds_out_by_seed_alone(n, val_size):
    splits = {ws: build_datasets(_indexed(n), val_size, seed=5, world_size=ws)
              for ws in (1, 2, 3)}
    val = {ws: s.val.targets for ws, s in splits.items()}
    train = {ws: s.train.targets for ws, s in splits.items()}
    for ws in (2, 3):
        np.testing.assert_array_equal(val[ws], val[1])
        np.testing.assert_array_equal(train[ws], train[1])
    v, t = set(val[1].tolist()), set(train[1].tolist())
    assert len(val[1]) == len(v) == val_size
    assert len(train[1]) == len(t) == n - val_size
    assert v.isdisjoint(t)
    assert v | t == set(range(n))
    # features travel with their targets
    np.testing.assert_array_equal(splits[1].val.features[:, 0], val[1].astype(np.float32))


def test_build_datasets_depends_on_seed():
    a = build_datasets(_indexed(500), 100, seed=0, world_size=2).val.targets
    b = build_datasets(_indexed(500), 100, seed=1, world_size=2).val.targets
    assert set(a.tolist()) != set(b.tolist())
    # not simply the first or last samples
    assert set(a.tolist()) != set(range(100)) and set(a.tolist()) != set(range(400, 500))


@pytest.mark.parametrize("val_size,world_size", [(1797, 1), (1797, 2), (1800, 2), (1796, 2)])
def test_build_datasets_rejects_val_size_leaving_too_few(val_size, world_size):
    with pytest.raises(ConfigError, match="data.val_size") as info:
        build_datasets(load_digits(), val_size, seed=0, world_size=world_size)
    assert "\n" not in str(info.value)


def test_build_datasets_largest_valid_val_size():
    # every one of the ranks still gets one training sample
    s = build_datasets(_indexed(20), 17, seed=0, world_size=3)
    assert len(s.train) == 3 and len(s.val) == 17


# --------------------------------------------------------------------------------- files
def _arrays(n=24, f=3, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((n, f)).astype(np.float32)
    labels = (np.arange(n) % classes).astype(np.int64)
    rng.shuffle(labels)
    values = rng.standard_normal(n).astype(np.float32)
    return features, labels, values


def _write_csv(path, features, targets, header=False):
    with open(path, "w") as fh:
        if header:
            fh.write(",".join([f"f{i}" for i in range(features.shape[1])] + ["target"]) + "\n")
        for row, t in zip(features.astype(np.float64), targets, strict=True):
            cells = [repr(float(v)) for v in row] + [repr(t.item())]
            fh.write(",".join(cells) + "\n")


def _write(path, kind, features, targets, header=False):
    path = str(path)
    if kind == "pt":
        torch.save({"features": torch.from_numpy(features), "targets": torch.from_numpy(targets)},
                   path)
    elif kind == "npz":
        np.savez(path, features=features, targets=targets)
    elif kind == "csv":
        _write_csv(path, features, targets, header)
    return path


FORMATS = [("pt", False), ("npz", False), ("csv", False), ("csv", True)]


@pytest.mark.parametrize("kind,header", FORMATS)
def test_load_file_classification_same_arrays(tmp_path, kind, header):
    features, labels, _ = _arrays()
    path = _write(tmp_path / f"d.{kind}", kind, features, labels, header)
    ds = load_file(path)
    assert ds.features.dtype == np.float32
    np.testing.assert_array_equal(ds.features, features)
    assert ds.targets.dtype == np.int64
    np.testing.assert_array_equal(ds.targets, labels)
    assert ds.num_classes == 3
    assert ds.input_shape == (3,)


@pytest.mark.parametrize("kind,header", FORMATS)
def test_load_file_regression_same_arrays(tmp_path, kind, header):
    features, _, values = _arrays()
    path = _write(tmp_path / f"d.{kind}", kind, features, values, header)
    ds = load_file(path)
    np.testing.assert_array_equal(ds.features, features)
    assert ds.targets.dtype == np.float32 and ds.targets.shape == (24, 1)
    np.testing.assert_array_equal(ds.targets[:, 0], values)
    assert ds.num_classes == 0 and ds.num_outputs == 1


def test_load_file_formats_agree(tmp_path):
    features, labels, _ = _arrays(n=40, f=5, seed=2, classes=4)
    loaded = [load_file(_write(tmp_path / f"d{i}.{kind}", kind, features, labels, header))
              for i, (kind, header) in enumerate(FORMATS)]
    for ds in loaded[1:]:
        np.testing.assert_array_equal(ds.features, loaded[0].features)
        np.testing.assert_array_equal(ds.targets, loaded[0].targets)
        assert ds.num_classes == loaded[0].num_classes == 4


def test_a_pt_data_file_that_does_not_load_is_one_line_naming_why(tmp_path):
    """A .pt holding a Python object other than tensors and plain containers, or truncated:
    one line saying which (torch's own text spans eight lines with terminal colour codes)."""
    import argparse

    objects, truncated = tmp_path / "objects.pt", tmp_path / "truncated.pt"
    torch.save({"features": torch.zeros(4, 2), "targets": torch.zeros(4),
                "args": argparse.Namespace(lr=0.1)}, objects)
    torch.save({"features": torch.zeros(400, 2), "targets": torch.zeros(400)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:500])
    for path, why in ((objects, "it holds a Python object (argparse.Namespace) that is not a "
                                "tensor or a plain container"),
                      (truncated, "not a complete torch.save file: truncated or corrupt")):
        with pytest.raises(ConfigError) as info:
            load_file(str(path))
        message = str(info.value)
        assert message.startswith(f"data.path={str(path)!r}: cannot load it: {why}"), message
        assert "\n" not in message and "\x1b" not in message, message


def test_load_file_pt_image_shaped_and_pair(tmp_path):
    x = torch.rand(10, 1, 4, 4)
    y = torch.arange(10) % 2
    torch.save((x, y), tmp_path / "pair.pt")
    ds = load_file(str(tmp_path / "pair.pt"))
    assert ds.input_shape == (1, 4, 4)
    np.testing.assert_array_equal(ds.features, x.numpy())
    np.testing.assert_array_equal(ds.targets, y.numpy())


@pytest.mark.parametrize("kind", ["pt", "npz", "csv"])
def test_load_file_task_override(tmp_path, kind):
    features, labels, values = _arrays()
    int_path = _write(tmp_path / f"i.{kind}", kind, features, labels)
    real_path = _write(tmp_path / f"r.{kind}", kind, features, values)

    auto = load_file(int_path, task="auto")
    assert auto.num_classes == 3

    reg = load_file(int_path, task="regression")
    assert reg.num_classes == 0
    assert reg.targets.dtype == np.float32 and reg.targets.shape == (24, 1)
    np.testing.assert_array_equal(reg.targets[:, 0], labels.astype(np.float32))

    cls = load_file(int_path, task="classification")
    assert cls.num_classes == 3
    np.testing.assert_array_equal(cls.targets, labels)

    assert load_file(real_path, task="auto").num_classes == 0
    with pytest.raises(ConfigError, match="data.path"):
        load_file(real_path, task="classification")  # 0.37 is no class label


def _assert_data_path_error(info):
    msg = str(info.value)
    assert "data.path" in msg
    assert "\n" not in msg, msg


def test_load_file_missing(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_file(str(tmp_path / "nope.csv"))
    _assert_data_path_error(info)
    assert "nope.csv" in str(info.value)


def test_load_file_unknown_extension(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("1,2,0\n3,4,1\n")
    with pytest.raises(ConfigError) as info:
        load_file(str(path))
    _assert_data_path_error(info)
    assert ".txt" in str(info.value)


@pytest.mark.parametrize("kind", ["pt", "npz"])
def test_load_file_missing_keys(tmp_path, kind):
    a, b = np.zeros((4, 2), np.float32), np.zeros(4, np.int64)
    path = str(tmp_path / f"d.{kind}")
    if kind == "pt":
        torch.save({"inputz": torch.from_numpy(a), "outputz": torch.from_numpy(b)}, path)
    else:
        np.savez(path, inputz=a, outputz=b)
    with pytest.raises(ConfigError) as info:
        load_file(path)
    _assert_data_path_error(info)


@pytest.mark.parametrize("kind", ["pt", "npz"])
def test_load_file_length_mismatch(tmp_path, kind):
    features, labels, _ = _arrays(n=10)
    path = _write(tmp_path / f"d.{kind}", kind, features, labels[:9])
    with pytest.raises(ConfigError) as info:
        load_file(path)
    _assert_data_path_error(info)


@pytest.mark.parametrize("kind", ["pt", "npz", "csv"])
def test_load_file_nan_features(tmp_path, kind):
    features, labels, _ = _arrays(n=10)
    features[3, 1] = np.nan
    path = _write(tmp_path / f"d.{kind}", kind, features, labels)
    with pytest.raises(ConfigError) as info:
        load_file(path)
    _assert_data_path_error(info)


@pytest.mark.parametrize("content", [
    "1.0,2.0,0\n3.0,abc,1\n5.0,6.0,0\n",          # a non-numeric cell in the body
    "a,b,label\n1.0,2.0,0\nx,y,z\n",               # header, then a non-numeric row
    "1.0,x,cat\n3.0,4.0,dog\n",                    # a word among the features (names as
                                                   # targets are classes: test_string_labels)
])
def test_load_file_non_numeric_csv(tmp_path, content):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_file(str(path))
    _assert_data_path_error(info)


@pytest.mark.parametrize(("content", "says"), [
    ("a,b,label\n", "no data rows (a header of 3 column(s) only)"),  # fresh-user finding
    ("", "no data rows"),
])
def test_load_file_csv_without_rows_says_so(tmp_path, content, says):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        load_file(str(path))
    _assert_data_path_error(info)


@pytest.mark.parametrize("kind", ["pt", "npz", "csv"])
def test_load_file_negative_labels_for_classification(tmp_path, kind):
    features, labels, _ = _arrays(n=12)
    labels = labels - 1  # -1, 0, 1
    path = _write(tmp_path / f"d.{kind}", kind, features, labels)
    with pytest.raises(ConfigError) as info:
        load_file(path, task="classification")
    _assert_data_path_error(info)


# ---------------------------------------------------------------------- the per-rank path
def _index_tensors(n: int):
    """x[i] = [i, -i] (float), y[i] = i: every batch names the samples it holds."""
    idx = torch.arange(n)
    return torch.stack([idx.float(), -idx.float()], dim=1), idx.clone()


def _epochs(loader, sampler, epochs):
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.append([(xb.clone(), yb.clone()) for xb, yb in loader])
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n,world_size", [(1, 1), (2, 3), (3, 8), (37, 3), (40, 4), (41, 5)])
def test_shard_order_is_distributed_samplers_order(n, world_size, drop_last, shuffle):
    """The tensor order equals DistributedSampler's own list, padding (also when the padding is
    longer than the data) and dropping included, every rank and epoch."""
    if drop_last and n < world_size:
        return  # DistributedSampler would give ranks nothing: not a configuration we run
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, seed=7, drop_last=drop_last)
        for epoch in (0, 1, 5):
            sampler.set_epoch(epoch)
            order = shard_order(sampler)
            assert order.dtype == torch.long
            assert order.tolist() == list(sampler)


def test_shard_order_lists_any_other_sampler():
    assert shard_order([4, 2, 9]).tolist() == [4, 2, 9]


@pytest.mark.parametrize("n,world_size,batch_size", [(37, 1, 5), (37, 2, 4), (37, 3, 5),
                                                     (40, 4, 3)])
def test_train_loader_batched_equals_dataloader(n, world_size, batch_size):
    x, y = _index_tensors(n)
    epochs = (0, 1, 2)
    per_rank = []
    for rank in range(world_size):
        runs = []
        for workers in (0, 1):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                         shuffle=True, seed=11, drop_last=False)
            if workers == 0:
                loader = TrainLoader(x, y, sampler, batch_size)
            else:  # torch's DataLoader with a worker process, one key per batch
                arrays = ArrayDataset(x.numpy(), y.numpy(), num_classes=n)
                loader = KeyedLoader(arrays, BatchKeys(sampler, batch_size),
                                     {"num_workers": workers, "persistent_workers": True},
                                     seed=11, rank=rank)
            runs.append(_epochs(loader, sampler, epochs))
            assert len(loader) == len(runs[-1][0])
            del loader
            gc.collect()
        fast, reference = runs
        for e_fast, e_ref in zip(fast, reference, strict=True):
            assert len(e_fast) == len(e_ref)
            for (xf, yf), (xr, yr) in zip(e_fast, e_ref, strict=True):
                assert xf.dtype == xr.dtype and yf.dtype == yr.dtype
                assert torch.equal(xf, xr) and torch.equal(yf, yr)
                assert torch.equal(xf[:, 0].long(), yf)  # features travel with targets
        per_rank.append(fast)

    shard = math.ceil(n / world_size)
    for e in range(len(epochs)):
        idx = [torch.cat([yb for _, yb in per_rank[r][e]]).tolist() for r in range(world_size)]
        # every rank serves the same number of samples: ceil(n / world_size)
        assert all(len(i) == shard for i in idx)
        assert all(len(b) <= batch_size for r in range(world_size) for _, b in per_rank[r][e])
        union = [i for rank_idx in idx for i in rank_idx]
        assert set(union) == set(range(n))                      # covers the training set
        assert len(union) == shard * world_size                 # padded by n % ws repeats
        assert len(union) - len(set(union)) == (-n) % world_size
    # a new order every epoch (set_epoch), on each rank
    for r in range(world_size):
        orders = [torch.cat([yb for _, yb in per_rank[r][e]]).tolist() for e in range(3)]
        assert orders[0] != orders[1] and orders[1] != orders[2]


@pytest.mark.parametrize("gather_bytes", [1, 3 * 8 * 2, 7 * 8 * 2, 2**20])
def test_train_loader_gathers_in_chunks_of_whole_batches(monkeypatch, gather_bytes):
    """Gathering the shard a chunk at a time (one batch, several, or the whole shard per chunk)
    yields the batches of a single whole-shard gather, in order."""
    import ddp_exp.data.loaders as loaders

    n, batch_size = 53, 3
    x, y = _index_tensors(n)  # 8 bytes of x and 8 of y per row
    sampler = DistributedSampler(range(n), num_replicas=2, rank=1, shuffle=True, seed=3,
                                 drop_last=False)
    sampler.set_epoch(4)
    order = torch.tensor(list(sampler))
    expected = [order[i:i + batch_size].tolist() for i in range(0, len(order), batch_size)]
    monkeypatch.setattr(loaders, "GATHER_BYTES", gather_bytes)
    loader = TrainLoader(x, y, sampler, batch_size)
    assert loader.chunk_rows() % batch_size == 0 and loader.chunk_rows() >= batch_size
    batches = list(loader)
    assert [yb.tolist() for _, yb in batches] == expected
    assert all(torch.equal(xb[:, 0].long(), yb) for xb, yb in batches)


def test_train_loader_unshuffled_is_strided():
    x, y = _index_tensors(10)
    sampler = DistributedSampler(range(10), num_replicas=3, rank=1, shuffle=False,
                                 drop_last=False)
    batches = list(TrainLoader(x, y, sampler, batch_size=3))
    # 10 samples padded to 12 with samples 0 and 1; rank 1 takes positions 1, 4, 7, 10
    assert [b.tolist() for _, b in batches] == [[1, 4, 7], [0]]


@pytest.mark.parametrize("val_size", [0, 1, 2, 3, 5, 101])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_val_batches_disjoint_unpadded_covering(val_size, world_size):
    x, y = _index_tensors(val_size)
    seen = []
    for rank in range(world_size):
        batches = list(val_batches(x, y, rank, world_size, batch_size=4))
        shard = [i for xb, yb in batches for i in yb.tolist()]
        assert all(0 < len(yb) <= 4 for _, yb in batches)
        for xb, yb in batches:
            assert torch.equal(xb[:, 0].long(), yb)
        expected_len = len(range(rank, val_size, world_size))
        assert len(shard) == expected_len
        if expected_len == 0:
            assert batches == []  # an empty shard yields nothing
        seen.extend(shard)
    assert len(seen) == val_size == len(set(seen))  # no sample twice, none padded
    assert set(seen) == set(range(val_size))


@pytest.mark.parametrize("n", [1, 7, 100, 1500, 1501])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 16, 32, 50])
def test_steps_per_epoch_matches_train_loader(n, world_size, batch_size):
    x, y = _index_tensors(n)
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=world_size - 1,
                                 shuffle=True, seed=0, drop_last=False)
    loader = TrainLoader(x, y, sampler, batch_size)
    counted = sum(1 for _ in loader)
    assert len(loader) == counted
    assert counted == math.ceil(math.ceil(n / world_size) / batch_size)  # padded shards


@pytest.mark.parametrize(("n", "world_size", "batch_size", "steps"), [
    (1500, 2, 16, 47), (1500, 2, 32, 24),  # C03: 750 per rank
    (1501, 2, 10, 76),  # C07: 751 per rank after padding
])
def test_steps_per_epoch_cases(n, world_size, batch_size, steps):
    x, y = _index_tensors(n)
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=0, shuffle=True,
                                 seed=0, drop_last=False)
    assert len(TrainLoader(x, y, sampler, batch_size)) == steps


# ------------------------------------------------------------------ end to end, real CLI
def _frozen_forward(state: dict, x: np.ndarray) -> torch.Tensor:
    """The MLP's forward written out from its saved weights: flatten, (Linear, ReLU)*, Linear."""
    layers = sorted({k.rsplit(".", 1)[0] for k in state}, key=lambda k: int(k.split(".")[-1]))
    h = torch.from_numpy(x).reshape(len(x), -1).double()
    for i, name in enumerate(layers):
        h = h @ state[f"{name}.weight"].double().T + state[f"{name}.bias"].double()
        if i < len(layers) - 1:
            h = torch.relu(h)
    return h


def _check_frozen_run(run, dataset: ArrayDataset, val_size: int, batch_size: int) -> None:
    """``optim.lr=0.0``, 1 epoch, 2 ranks, a training set divisible by 2: the reported losses
    are the plain means over the split, computed here in float64 from the saved weights."""
    m = run.ok().metrics
    split = build_datasets(dataset, val_size, seed=0, world_size=2)
    n_train = len(dataset) - val_size
    assert n_train % 2 == 0  # no padding: each training sample is seen exactly once
    assert m["world_size"] == 2
    assert m["global_batch_size"] == 2 * batch_size
    assert m["val/num_samples"] == val_size
    assert m["train/num_samples"] == n_train
    assert m["steps_per_epoch"] == m["global_step"] == math.ceil(n_train / 2 / batch_size)
    state = torch.load(run.job_dir / "model.pt", weights_only=True)

    def losses(part: ArrayDataset) -> torch.Tensor:
        out = _frozen_forward(state, part.features)
        if dataset.num_classes:
            return torch.nn.functional.cross_entropy(out, torch.from_numpy(part.targets),
                                                     reduction="none")
        return (out - torch.from_numpy(part.targets).double()).pow(2).mean(dim=1)

    assert m["val/loss"] == pytest.approx(losses(split.val).mean().item(), rel=1e-6)
    assert m["train/epoch_loss"] == pytest.approx(losses(split.train).mean().item(), rel=1e-6)
    if dataset.num_classes:
        predicted = _frozen_forward(state, split.val.features).argmax(dim=1).numpy()
        correct = int((predicted == split.val.targets).sum())
        assert m["val/accuracy"] == pytest.approx(correct / val_size, abs=1e-12)
    else:
        assert m["val/accuracy"] is None


@pytest.mark.smoke
@pytest.mark.float_sensitive
def test_cli_data_file_csv(run_cli, tmp_path):
    features, labels, _ = _arrays(n=64, f=4, seed=3, classes=3)
    path = _write(tmp_path / "train.csv", "csv", features, labels, header=True)
    run = run_cli("world_size=2", "trainer.epochs=1", "data=file", f"data.path={path}",
                  "data.val_size=14", "data.batch_size=8", "optim.lr=0.0")
    _check_frozen_run(run, load_file(path), val_size=14, batch_size=8)
    assert load_file(path).num_classes == 3


@pytest.mark.float_sensitive
def test_cli_data_file_pt_regression(run_cli, tmp_path):
    features, _, values = _arrays(n=50, f=5, seed=4)
    path = _write(tmp_path / "train.pt", "pt", features, values)
    run = run_cli("world_size=2", "trainer.epochs=1", "data=file", f"data.path={path}",
                  "data.val_size=10", "data.batch_size=8", "optim.lr=0.0")
    _check_frozen_run(run, load_file(path), val_size=10, batch_size=8)


def test_cli_data_file_default_has_no_validation(run_cli, tmp_path):
    features, labels, _ = _arrays(n=30, f=4, seed=5)
    path = _write(tmp_path / "d.npz", "npz", features, labels)
    m = run_cli("world_size=2", "trainer.epochs=1", "data=file", f"data.path={path}").ok().metrics
    assert m["val/num_samples"] == 0  # data=file defaults to data.val_size=0
    assert m["val/loss"] is None and m["val/accuracy"] is None
    assert m["train/num_samples"] == 30


def _synthetic(num_classes: int) -> ArrayDataset:
    return make_synthetic(4096, 32, num_classes=num_classes, noise_std=0.1, seed=0)


def test_cli_synthetic_regression(run_cli):
    m = run_cli("world_size=2", "trainer.epochs=1", "data=synthetic").ok().metrics
    n_train, val = 4096 - 512, 512
    assert m["val/accuracy"] is None
    assert m["val/num_samples"] == val
    assert m["train/num_samples"] == n_train
    assert m["steps_per_epoch"] == m["global_step"] == math.ceil(n_train / 2 / 32)
    assert m["global_batch_size"] == 64
    # it learned: well below the loss of always predicting the mean
    held_out = build_datasets(_synthetic(0), val, seed=0, world_size=2).val.targets
    assert math.isfinite(m["val/loss"]) and m["val/loss"] < 0.5 * float(np.var(held_out))


@pytest.mark.float_sensitive
def test_cli_synthetic_classification(run_cli):
    m = run_cli("world_size=2", "trainer.epochs=1", "data=synthetic",
                "data.num_classes=4").ok().metrics
    val = 512
    assert m["val/num_samples"] == val
    assert m["train/num_samples"] == 4096 - val
    correct = round(m["val/accuracy"] * val)
    assert m["val/accuracy"] == pytest.approx(correct / val, abs=1e-12)  # a count over 512
    # it learned: far above the accuracy of predicting the most frequent class
    held_out = build_datasets(_synthetic(4), val, seed=0, world_size=2).val.targets
    majority = np.bincount(held_out, minlength=4).max() / val
    assert m["val/accuracy"] > max(0.5, majority + 0.1)
    assert math.isfinite(m["val/loss"])


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_data_path_says_so(path):
    """``data.path=''`` said "is a directory" (an empty path resolves to the current folder)."""
    with pytest.raises(ConfigError, match=r"^data.path='\s*' is empty; give a .pt, .npz or "
                                          r"\.csv file$"):
        load_file(path)
