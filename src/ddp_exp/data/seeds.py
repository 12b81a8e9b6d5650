"""The seeds of the data's random draws: per batch (:func:`batch_seed`, the DataLoader's own
generator) and per sample (:func:`sample_keys`: augmentation, a user's transform, draws in a
user's ``__getitem__``), and the context that runs draws under a seed and puts the process's
RNGs back (:func:`seeded`). See :mod:`ddp_exp.data.loaders` for how the loaders use them.

May use: torch, NumPy (nothing of ddp_exp).
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

TRAIN, VAL, TEST = 0, 1, 2  # the streams of batch seeds: no split draws another's numbers


def batch_seed(seed: int, rank: int, epoch: int, batch: int, stream: int = TRAIN) -> int:
    """The seed of one batch's random draws, from NumPy's ``SeedSequence`` (which mixes its
    entropy so that neighbouring tuples give unrelated streams). 63 bits. ``stream`` keeps the
    validation and test batches' draws apart from the training batches' of the same number."""
    entropy = [seed, rank, epoch, batch] + ([stream] if stream != TRAIN else [])
    state = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def sample_keys(seed: int, epoch: int, positions, stream: int = TRAIN) -> np.ndarray:
    """Each sample's key of its random draws, from (``seed``, ``epoch``, its position in the
    split, ``stream``) alone: no rank, batch or world size enters, so a sample draws the same
    wherever it is served. uint64 ``[B]`` (SplitMix64 of the mixed inputs, each below 2^63)."""
    mixed = _splitmix(np.uint64(seed) ^ _splitmix(np.uint64(epoch) ^ _splitmix(
        np.uint64(stream))))
    return _splitmix(np.asarray(positions, dtype=np.uint64) ^ mixed) >> np.uint64(1)


def _splitmix(z):
    """SplitMix64's finalizer (Steele et al. 2014), elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = np.asarray(z, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniforms(keys: np.ndarray, count: int) -> np.ndarray:
    """``count`` uniform draws in [0, 1) per key, float64 ``[len(keys), count]``: what a keyed
    sample draws (its augmentation's parameters)."""
    keys = np.asarray(keys, dtype=np.uint64)[:, None]
    z = _splitmix(keys ^ _splitmix(np.arange(1, count + 1, dtype=np.uint64))[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def reseed(seed: int) -> None:
    """Seed torch's (CPU), Python's and NumPy's global RNGs from ``seed`` (inside
    :func:`seeded`, which puts them back)."""
    seed = int(seed)
    # The CPU generator alone: torch.manual_seed also visits every accelerator's generator,
    # ~0.4 ms a call, which per sample would cost more than reading it.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def seeded(seed: int | None):
    """Run a block with torch's (CPU), Python's and NumPy's global RNGs seeded from ``seed``
    (None: as they are, for a block that seeds them itself, :func:`reseed`); their previous
    states are restored afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            reseed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
