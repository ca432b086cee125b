"""Photo-like synthetic JPEG files for the benchmark's data-path rows and the campaign's
tiny profile. No torch here: the campaign's orchestrator writes its tiny image folder
without paying for torch's import."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB PIL image: a coarse random colour grid, upsampled, plus noise
    (compresses and decodes like a photograph, unlike white noise)."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.int16)
    noisy = smooth + rng.integers(-12, 13, smooth.shape, dtype=np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def make_jpeg_folder(root: str, n: int, min_px: int, max_px: int, classes: int = 10, seed: int = 0,
                     shape: tuple[int, int] | None = None, quality: int = 90) -> float:
    """Write n synthetic JPEGs of random sides in [min_px, max_px] (or every one `shape`,
    width x height, every other one turned to portrait, as ImageNet's photos) as
    root/train/<class>/ (one more per class in root/val/); returns the mean file size in KB."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n + classes):
        split, c = ("train", i % classes) if i < n else ("val", i - n)
        w, h = (int(x) for x in rng.integers(min_px, max_px + 1, 2))
        if shape is not None:
            w, h = shape if i % 2 == 0 else shape[::-1]
        jobs.append((os.path.join(root, split, f"c{c:02d}", f"{i:06d}.jpg"), w, h, int(rng.integers(2**31))))
    for split in ("train", "val"):
        for c in range(classes):
            os.makedirs(os.path.join(root, split, f"c{c:02d}"), exist_ok=True)

    def write(job):
        path, w, h, s = job
        synthetic_image(w, h, s).save(path, quality=quality)
        return os.path.getsize(path)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # PIL's encoder releases the GIL
        sizes = list(pool.map(write, jobs))
    return float(np.mean(sizes[:n])) / 1024
