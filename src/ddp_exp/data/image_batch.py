"""An image folder's batch transform: decoded uint8 images ``[B, C, H, W]`` -> float32 model
inputs (:class:`ImageBatch`: scale to [0, 1], the user's ``data.transform``, the built-in
``data.augment`` through Kornia, ``data.mean``/``data.std``), and the augmentation's draws,
taken from each sample's key (:func:`keyed_affine`) so a sample is augmented alike whichever
batch, rank or world serves it.

The folder itself (the file list, decoding with Pillow) is :mod:`ddp_exp.data.images`; the
transform runs on each collated batch (:func:`ddp_exp.data.collate.collate_inputs`), in the
rank or in its DataLoader workers.

May use: :mod:`ddp_exp.data.seeds` (the sample keys' draws), :mod:`ddp_exp.data.collate`
(``TRANSFORM_SALT``), torch, Kornia.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class ImageBatch:
    """Decoded uint8 images ``[B, C, H, W]`` -> float32 model inputs ``[B, C, H', W']``.

    In order: scale to [0, 1]; on the training split only, the user's transform
    (``data.transform``, called per sample on ``[C, H, W]``) and the built-in augmentation
    (``data.augment``: :func:`build_augmentation`, a small random rotation, shift and zoom);
    then per-channel ``(x - mean) / std`` if ``mean``/``std`` are given. Random draws follow
    each sample's key (``keys``, :func:`ddp_exp.data.seeds.sample_keys`, which the loader
    gives): the user's transform runs under its sample's seed and the augmentation's
    parameters are drawn from the keys (:func:`keyed_affine`), so a sample is augmented alike
    whichever batch, rank or world serves it. Without keys (a probe outside the loader) they
    come from the global torch RNG.

    Args:
        mean, std: per-channel lists of ``channels`` floats, or None.
        augment: apply the built-in augmentation.
        transform: a callable ``[C, H, W] -> [C, H, W]`` (a Kornia or torchvision transform),
            or None.
    """

    keyed = True  # takes each sample's key (ddp_exp.data.collate.collate_inputs)

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 augment: bool = False, transform: Callable[[Any], Any] | None = None):
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self.augment = augment
        self.transform = transform
        self._augmentation = None  # built in the process that uses it (Kornia imports there)

    def __call__(self, images, keys=None):
        import torch

        from ddp_exp.data.collate import TRANSFORM_SALT
        from ddp_exp.data.seeds import reseed

        x = images.to(torch.float32).div_(255.0) if images.dtype == torch.uint8 \
            else images.to(torch.float32)
        if self.transform is not None:
            rows = []
            for i, sample in enumerate(x):
                if keys is not None:  # the caller puts the global RNGs back
                    reseed(int(keys[i]) ^ TRANSFORM_SALT)
                rows.append(_as_chw(self.transform(sample)))
            x = torch.stack(rows)
        if self.augment:
            if self._augmentation is None:
                self._augmentation = build_augmentation(tuple(x.shape[-2:]))
            x = (self._augmentation(x) if keys is None
                 else keyed_affine(self._augmentation, x, keys))
        if self.mean is not None:
            c = x.shape[1]
            mean = torch.tensor(self.mean, dtype=x.dtype).view(1, c, 1, 1)
            std = torch.tensor(self.std, dtype=x.dtype).view(1, c, 1, 1)
            x = (x - mean) / std
        return x

    def __getstate__(self):  # the Kornia modules are rebuilt where they are used
        state = dict(self.__dict__)
        state["_augmentation"] = None
        return state


# data.augment's draws, sized for small images such as the bundled 8x8 digits.
AUGMENT_DEGREES = 10.0  # rotation within +-10 degrees
AUGMENT_TRANSLATE = 0.1  # shift within +-10% of the width and height
AUGMENT_SCALE = (0.9, 1.1)  # zoom


def build_augmentation(size: tuple[int, int]):
    """``data.augment``'s module, taking and returning ``[B, C, H, W]`` float tensors of side
    ``size`` (unchanged): Kornia's ``RandomAffine`` per image, a rotation within
    :data:`AUGMENT_DEGREES`, a shift within :data:`AUGMENT_TRANSLATE` of each side and a zoom in
    :data:`AUGMENT_SCALE`; uncovered pixels are 0 (before ``data.mean``/``data.std``).

    No flip and no small crop: a mirrored digit or letter is another shape, and torchvision's
    ImageNet recipe (``RandomResizedCrop`` down to 8% of the area, then a horizontal flip) took
    the image-folder recipe on the 8x8 digits from test accuracy 0.98 to 0.92 (docs/data.md,
    "A folder of images"). For photos, add a flip with ``data.transform`` (e.g.
    ``kornia.augmentation.RandomHorizontalFlip``).
    """
    import kornia.augmentation as K
    from torch import nn

    del size  # an affine draw keeps the side
    return nn.Sequential(K.RandomAffine(degrees=AUGMENT_DEGREES,
                                        translate=(AUGMENT_TRANSLATE, AUGMENT_TRANSLATE),
                                        scale=AUGMENT_SCALE))


def keyed_affine(augmentation, x, keys):
    """:func:`build_augmentation`'s module on ``x`` ``[B, C, H, W]`` with each sample's
    draws from its key (:func:`ddp_exp.data.seeds.uniforms`), not from the global RNG: the
    same ranges and probability as Kornia's own draws (whether to apply it, ``p``; an angle in
    +-:data:`AUGMENT_DEGREES`; a shift in +-:data:`AUGMENT_TRANSLATE` of each side, in pixels;
    one zoom in :data:`AUGMENT_SCALE` for both axes), given to Kornia as its parameters
    (``forward_parameters`` gives the rest: centre, zero shear; written for kornia 0.9)."""
    import torch

    from ddp_exp.data.seeds import uniforms

    affine = augmentation[0]
    u = torch.from_numpy(uniforms(keys, 5)).to(x.dtype)
    params = affine.forward_parameters(x.shape)
    height, width = x.shape[-2:]
    low, high = AUGMENT_SCALE
    scale = low + (high - low) * u[:, 4]
    params.update(
        batch_prob=(u[:, 0] < affine.p).to(params["batch_prob"].dtype),
        angle=(2 * u[:, 1] - 1) * AUGMENT_DEGREES,
        translations=torch.stack([(2 * u[:, 2] - 1) * AUGMENT_TRANSLATE * width,
                                  (2 * u[:, 3] - 1) * AUGMENT_TRANSLATE * height], 1),
        scale=torch.stack([scale, scale], 1))
    return affine(x, params=params)


def _as_chw(sample):
    """A user transform's output as a ``[C, H, W]`` float tensor (Kornia returns ``[1, C, H,
    W]`` for one image)."""
    import torch

    out = torch.as_tensor(sample)
    if out.ndim == 4 and out.shape[0] == 1:
        out = out[0]
    return out.to(torch.float32)
