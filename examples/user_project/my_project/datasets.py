"""A dataset of the user's own: a function returning ddp_exp's ArrayDataset."""

import numpy as np
from sklearn.datasets import load_wine as sklearn_wine

from ddp_exp.data import ArrayDataset


def load_wine(standardize: bool = True) -> ArrayDataset:
    """scikit-learn's bundled wine recognition data: 178 samples, 13 features, 3 classes.

    ``standardize`` uses the statistics of the whole file, validation samples included, which
    is enough for an example; a real project would compute them on its training split.
    """
    bunch = sklearn_wine()
    x = bunch.data.astype(np.float64)
    if standardize:
        x = (x - x.mean(axis=0)) / x.std(axis=0)
    return ArrayDataset(x.astype(np.float32), bunch.target.astype(np.int64), num_classes=3)
