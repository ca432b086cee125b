"""A tiny image folder of real photographs, for looking at features on photos (README, Looking
at the features).

    python docs/photo_folder.py OUT PHOTO [PHOTO ...]

Each photograph becomes its own class: TRAIN random crops of it in OUT/train/<name>/ and
VAL others in OUT/val/<name>/ (256 x 256 JPEGs, crops of 15-60% of the photo's area, seeded).
A val crop's nearest train crops then say whether the features tell one photograph's
content from another's. The README's figure used scikit-image's sample photographs (the
files in its wheel's skimage/data/) and matplotlib's grace_hopper.jpg.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from PIL import Image
from torchvision.transforms import v2

TRAIN, VAL, SIDE = 8, 2, 256


def main(out: str, photos: list[str]) -> None:
    torch.manual_seed(0)
    crop = v2.RandomResizedCrop(SIDE, scale=(0.15, 0.6), antialias=True)
    for photo in map(Path, photos):
        image = Image.open(photo).convert("RGB")
        for split, n in (("train", TRAIN), ("val", VAL)):
            folder = Path(out) / split / photo.stem
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                crop(image).save(folder / f"{i}.jpg", quality=92)
    print(f"{len(photos)} classes, {TRAIN} train and {VAL} val crops each, in {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
