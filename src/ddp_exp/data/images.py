"""Image folders: torchvision's ``ImageFolder`` layout, decoded lazily with Pillow. The batch
transform that turns decoded images into model inputs (scale, augmentation, normalisation) is
:class:`ddp_exp.data.image_batch.ImageBatch`.

Layout (the one torchvision, timm and most papers' code use): ``root/<class>/<image>``, classes
sorted by name and numbered from 0, images sorted by path within a class. If ``root`` holds
``train/`` and ``val/`` sub-folders (and ``test/``), they are the splits and must use the same
class names (the training folder's list numbers them: a class missing from ``val/`` is fine, an
extra one is an error, since torchvision would silently renumber it).

Only a file list is built in the launching process; pixels are read when an item is indexed,
in the rank or in its DataLoader workers. Items are ``(uint8 tensor [C, H, W], class index)``:
uint8 keeps the workers' shared-memory batches four times smaller than float32, and
:class:`~ddp_exp.data.image_batch.ImageBatch` converts once per batch.

``python -m ddp_exp.data.images ROOT [--split]`` writes the bundled digits as such a folder.

May use: :mod:`ddp_exp.data.arrays` (the digits, for :func:`write_digits`),
:mod:`ddp_exp.config` (``ConfigError``), NumPy, Pillow, torch.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Sequence

import numpy as np

from ddp_exp.config.errors import ConfigError, described

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
    return f"data.path: cannot read image {path!r} ({described(exc)})"


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
