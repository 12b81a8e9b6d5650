"""Image folders: torchvision's ``ImageFolder`` layout, decoded lazily with Pillow, and the batch
transform (scale, augmentation through Kornia, normalisation) that turns decoded images into
model inputs.

Layout (the one torchvision, timm and most papers' code use): ``root/<class>/<image>``, classes
sorted by name and numbered from 0, images sorted by path within a class. If ``root`` holds
``train/`` and ``val/`` sub-folders (and ``test/``), they are the splits and must use the same
class names (the training folder's list numbers them: a class missing from ``val/`` is fine, an
extra one is an error, since torchvision would silently renumber it).

Only a file list is built in the launching process; pixels are read when an item is indexed,
in the rank or in its DataLoader workers. Items are ``(uint8 tensor [C, H, W], class index)``:
uint8 keeps the workers' shared-memory batches four times smaller than float32, and
:class:`ImageBatch` converts once per batch.

``python -m ddp_exp.data.images ROOT [--split]`` writes the bundled digits as such a folder.

May use: :mod:`ddp_exp.data.arrays` (the digits, for :func:`write_digits`), :mod:`ddp_exp.config`
(``ConfigError``), NumPy, Pillow, torch, Kornia.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ddp_exp.config.errors import ConfigError

# The extensions torchvision's ImageFolder accepts (torchvision.datasets.folder.IMG_EXTENSIONS).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLIT_FOLDERS = ("train", "val", "test")
CHANNEL_MODES = {1: "L", 3: "RGB"}


class ImageFolder:
    """A map-style dataset over ``root/<class>/<image>`` files.

    Args:
        root: the folder holding one sub-folder per class.
        image_size: side in pixels: the centred square of each image (the whole of its shorter
            side) resized to it, bilinear and antialiased (Pillow's ``ImageOps.fit``; see
            :func:`decode`); None keeps the files' size (they must then agree: checked by
            :func:`load_image_folder`).
        channels: 1 (Pillow mode ``L``) or 3 (``RGB``, what torchvision's default loader gives).
        classes: the class names to number by (default: ``root``'s sub-folders, sorted).

    Item ``i`` is ``(image, label)``: ``image`` a uint8 tensor ``[channels, H, W]``, ``label``
    an int in ``0..len(classes)-1``.

    Raises:
        ConfigError: no class folder, one class only, no image, or a class not in ``classes``.
    """

    def __init__(self, root: str, image_size: int | None = None, channels: int = 3,
                 classes: Sequence[str] | None = None):
        self.root = root
        self.image_size = image_size
        self.channels = channels
        found = sorted(e.name for e in os.scandir(root) if e.is_dir()
                       and not e.name.startswith("."))
        own_classes = classes is None  # the classes are this folder's (not train/'s)
        if own_classes:
            if not found:
                raise ConfigError(f"data.path={root!r} holds no class folder: expected "
                                  "<data.path>/<class>/<image> (or train/ and val/ holding them)")
            if len(found) == 1:
                raise ConfigError(f"data.path={root!r} holds one class folder ({found[0]!r}); "
                                  "classification needs at least 2, one per class")
            classes = found
        else:
            extra = sorted(set(found) - set(classes))
            if extra:
                raise ConfigError(f"data.path={root!r} has class folder(s) {extra} that the "
                                  f"training split has not (its classes: {list(classes)})")
        self.classes = list(classes)
        index = {name: i for i, name in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in found:
            folder = os.path.join(root, name)
            for dirpath, _, files in sorted(os.walk(folder, followlinks=True)):
                for fname in sorted(files):
                    if fname.lower().endswith(IMG_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, fname), index[name]))
        if not self.samples:
            raise ConfigError(f"data.path={root!r}: no image files in its class folders "
                              f"(looked for {', '.join(IMG_EXTENSIONS)})")
        empty = sorted(set(found) - {self.classes[label] for _, label in self.samples})
        if empty and own_classes:  # torchvision refuses them too: a class never seen
            raise ConfigError(f"data.path={root!r}: class folder(s) {empty} hold no image "
                              f"({', '.join(IMG_EXTENSIONS)}); remove them or add images")

    draws = False  # reading an image draws no random number: the loader seeds no item

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        import torch

        path, label = self.samples[i]
        return torch.from_numpy(decode(path, self.image_size, self.channels)), label

    def sizes(self) -> dict[tuple[int, int], str]:
        """``(width, height)`` -> the first file of that size (headers only, no decoding)."""
        from PIL import Image

        seen: dict[tuple[int, int], str] = {}
        for path, _ in self.samples:
            try:
                with Image.open(path) as img:
                    seen.setdefault(img.size, path)
            except OSError as exc:
                raise ConfigError(f"data.path: cannot read image {path!r} ({exc})") from None
            if len(seen) > 1:
                break
        return seen

    def fingerprint(self) -> int:
        """CRC-32 of the file list (relative paths, labels, byte sizes): what the nodes of a
        multi-node world compare instead of reading every image."""
        crc = 0
        for path, label in self.samples:
            rel = os.path.relpath(path, self.root)
            crc = zlib.crc32(f"{rel}\0{label}\0{os.path.getsize(path)}\n".encode(), crc)
        return crc


def decode(path: str, image_size: int | None, channels: int) -> np.ndarray:
    """Read one image with Pillow: uint8 ``[channels, H, W]``, resized and centre-cropped to
    ``image_size`` if given: Pillow's ``ImageOps.fit`` (bilinear, antialiased), which resamples
    the exact centred square once (torchvision's ``Resize`` + ``CenterCrop``, ddp_exp's before,
    crops whole pixels after resizing: up to half a pixel off centre); an image whose shorter
    side is ``image_size`` already is cropped to whole pixels, not resampled.

    Raises:
        ConfigError: the file is not an image Pillow can read (named; found while training when
            ``image_size`` is set, since only then are the headers not all read up front).
        OSError: the file cannot be read at all (``FileNotFoundError``: deleted or moved while
            the run reads the folder), a runtime failure, not the config's.
    """
    try:
        return _decode(path, image_size, channels)
    except OSError as exc:
        if exc.errno is not None:  # gone or unreadable mid-run (not Pillow's): no config error
            raise OSError(exc.errno, f"data.path: cannot read image ({exc.strerror})",
                          path) from None
        raise ConfigError(_unreadable(path, exc)) from None
    except (ValueError, SyntaxError) as exc:  # what Pillow raises for a bad file
        raise ConfigError(_unreadable(path, exc)) from None


def _unreadable(path: str, exc: BaseException) -> str:
    return (f"data.path: cannot read image {path!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})")


def _decode(path: str, image_size: int | None, channels: int) -> np.ndarray:
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        img = img.convert(CHANNEL_MODES[channels])
        if image_size is not None and min(img.size) == image_size:
            # Our own path, measured: only a crop is needed, and whole pixels keep the file's
            # values (fit resamples a half-pixel shift when the sides differ by an odd number)
            # at a third of fit's time (0.6 vs 1.8 ms, 224x301 RGB).
            left, top = (img.size[0] - image_size) // 2, (img.size[1] - image_size) // 2
            img = img.crop((left, top, left + image_size, top + image_size))
        elif image_size is not None:
            img = ImageOps.fit(img, (image_size, image_size), Image.BILINEAR)
        array = np.array(img, dtype=np.uint8)  # a writable copy: torch shares its memory
    return array[None] if array.ndim == 2 else np.ascontiguousarray(array.transpose(2, 0, 1))


def load_image_folder(path: str, image_size: int | None = None, channels: int = 3):
    """``data=image_folder``: the folder under ``path``, or its ``train/`` and ``val/`` splits.

    Returns:
        One :class:`ImageFolder` (validation and test held out later by ``data.val_size`` and
        ``data.test_size``), or, when ``path`` holds ``train/``, a mapping ``{"train", "val",
        "test"}`` of the split folders, None where one is absent (then held out of ``train/``).

    Raises:
        ConfigError: a missing folder, no class or one class, no image, a class folder without
            images, ``val/`` or ``test/`` without ``train/``, class folders of ``val/`` unknown
            to ``train/``, or (``image_size`` null) images of different sizes.
    """
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(root):
        what = "is a file" if os.path.exists(root) else "does not exist"
        raise ConfigError(f"data.path={path!r} {what}: data=image_folder needs a folder "
                          "<data.path>/<class>/<image> (or train/ and val/ holding them)")
    if channels not in CHANNEL_MODES:
        raise ConfigError(f"data.channels={channels!r} is invalid: 1 (grey) or 3 (RGB)")
    if image_size is not None and image_size < 1:
        raise ConfigError(f"data.image_size={image_size!r} is invalid: null (the files' size) "
                          "or a positive side in pixels")
    present = [s for s in SPLIT_FOLDERS if os.path.isdir(os.path.join(root, s))]
    if present and "train" not in present:
        raise ConfigError(f"data.path={root!r} holds {'/ and '.join(present)}/ but no train/: "
                          "split folders need train/ (val/ and test/ are optional), or give "
                          "the class folders directly")
    if present:
        train = ImageFolder(os.path.join(root, "train"), image_size, channels)
        splits: dict[str, ImageFolder | None] = {"train": train, **{
            s: ImageFolder(os.path.join(root, s), image_size, channels, train.classes)
            if s in present else None for s in ("val", "test")}}
        parts: tuple[ImageFolder, ...] = tuple(p for p in splits.values() if p is not None)
    else:
        splits = {"train": ImageFolder(root, image_size, channels)}
        parts = (splits["train"],)
    if image_size is None:
        sizes: dict[tuple[int, int], str] = {}
        for part in parts:
            for size, file in part.sizes().items():
                sizes.setdefault(size, file)
        if len(sizes) > 1:
            (s1, f1), (s2, f2) = list(sizes.items())[:2]
            raise ConfigError(f"data.image_size=null needs images of one size, but {f1!r} is "
                              f"{s1[0]}x{s1[1]} and {f2!r} is {s2[0]}x{s2[1]}: set "
                              "data.image_size=<side> to resize and centre-crop them")
    return splits["train"] if len(parts) == 1 else splits


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

    keyed = True  # takes each sample's key (ddp_exp.data.lazy.collate_inputs)

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 augment: bool = False, transform: Callable[[Any], Any] | None = None):
        self.mean = None if mean is None else [float(m) for m in mean]
        self.std = None if std is None else [float(s) for s in std]
        self.augment = augment
        self.transform = transform
        self._augmentation = None  # built in the process that uses it (Kornia imports there)

    def __call__(self, images, keys=None):
        import torch

        from ddp_exp.data.lazy import TRANSFORM_SALT
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


def write_digits(root: str, split: bool = False, limit: int | None = None) -> str:
    """Write scikit-learn's bundled digits as 8x8 grey PNG files, ``root/<digit>/<i>.png``, a
    demo image folder made without a download (with ``split``: the first 1500 under
    ``root/train/``, the other 297 under ``root/val/``). Pixel values: ``round(255 * p / 16)``.

    ``python -m ddp_exp.data.images ROOT [--split]`` does the same. Returns ``root``.
    """
    from PIL import Image

    from ddp_exp.data.arrays import load_digits

    data = load_digits()
    for i in range(len(data) if limit is None else limit):
        pixels = np.round(data.features[i, 0] * 255).astype(np.uint8)
        part = ("train" if i < 1500 else "val") if split else ""
        folder = os.path.join(root, part, str(int(data.targets[i])))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{i:04d}.png"))
    return root


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddp_exp.data.images",
                                     description="Write the bundled digits as an image folder.")
    parser.add_argument("root", help="the folder to write, e.g. outputs/digits_png")
    parser.add_argument("--split", action="store_true", help="train/ and val/ sub-folders")
    args = parser.parse_args()
    if os.path.exists(args.root) and (not os.path.isdir(args.root) or os.listdir(args.root)):
        what = "is a file" if not os.path.isdir(args.root) else "is not empty"
        print(f"error: {args.root} {what}: give a new or empty folder", file=sys.stderr)
        raise SystemExit(2)  # bad input, as everywhere in ddp_exp
    print(write_digits(args.root, args.split))
