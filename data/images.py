"""Opening image files: which files count as images, and the one RGB rule.

Rule: every image a dataset yields is a 3-channel 8-bit RGB PIL image, whatever it was
stored as (gray L, 1-bit, palette P, RGBA/LA with alpha dropped, CMYK, 16-bit or float
gray). One input format means the same models, and ImageNet/timm weights, fit every
dataset. Alpha is dropped as `Image.convert("RGB")` drops it (as torchvision and timm
loaders do), not composited over a background.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import numpy as np
from PIL import Image

from resmlp.core.dist import cpu_cores
from resmlp.core.errors import UserError

# Lower-case file name extensions that are read as images; every other file is ignored.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")

_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def is_image_file(name: str) -> bool:
    """True when the file name has one of IMG_EXTENSIONS (case-insensitive)."""
    return name.lower().endswith(IMG_EXTENSIONS)


def to_rgb(img: Image.Image) -> Image.Image:
    """Return `img` as an 8-bit RGB image (the image itself when it already is one).

    16-bit gray is scaled to 8 bits (x / 257), 32-bit integer gray too when its values
    exceed 255; float gray is taken as 0..1 when its maximum is at most 1, else as 0..255.
    """
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _HIGH_DEPTH_MODES:
        a = np.asarray(img).astype(np.float64)
        if mode.startswith("I;16") or (mode == "I" and a.size and a.max() > 255):
            a = a / 257.0
        elif mode == "F" and a.size and a.max() <= 1.0:
            a = a * 255.0
        gray = np.clip(np.rint(a), 0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")  # palette transparency is only honoured via RGBA
    return img.convert("RGB")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_rgb(path: str) -> Image.Image:
    """Open and fully decode an image file as RGB; a UserError naming the file if that fails."""
    try:
        with Image.open(path) as img:  # leaving the block closes the file, keeps the pixels
            img.load()  # decode now: a truncated or corrupt file fails here, not later
            return to_rgb(img)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
        raise UserError(
            f"cannot read image {path} ({type(e).__name__}: {_one_line(e)}); replace or delete it, "
            f"or set data.skip_corrupt=true to skip unreadable images") from e


def unreadable_reason(path: str) -> str | None:
    """None when `path` opens and decodes as an image, else why not (one line)."""
    try:
        load_rgb(path)
    except UserError as e:
        cause = e.__cause__
        return f"{type(cause).__name__}: {_one_line(cause)}" if cause else str(e)
    return None


def find_unreadable(paths: Iterable[str], threads: int | None = None) -> list[tuple[str, str]]:
    """Open and decode every file; return [(path, reason)] for those that fail, in input order.

    Decoding runs on `threads` threads (default: the CPU cores this process may use);
    PIL releases the GIL while decoding, so this scales with cores.
    """
    paths = list(paths)
    if threads is None:
        threads = cpu_cores()
    threads = max(1, min(threads, 32))
    if threads == 1 or len(paths) < 64:
        reasons = [unreadable_reason(p) for p in paths]
    else:
        with ThreadPoolExecutor(threads) as pool:
            reasons = list(pool.map(unreadable_reason, paths, chunksize=64))
    return [(p, r) for p, r in zip(paths, reasons) if r is not None]
