"""Evaluation and linear-probe transforms: RGB PIL image -> normalized float tensor (3, S, S).

- `build_eval_transform`: resize the shorter side to round(img_size / crop_ratio)
  (bicubic, antialiased), center-crop img_size, scale to [0, 1], normalize with
  data.mean/std. crop_ratio 0.875 at 224 px gives DINO's and ResMLP's resize 256 +
  crop 224; crop_ratio 1.0 (28/32/96 px datasets) resizes straight to img_size.
- `build_linear_train_transform`: DINO's eval_linear training augmentation:
  RandomResizedCrop(img_size, scale (0.08, 1), bilinear as in DINO) + horizontal flip
  + normalize.
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

from resmlp.core.errors import UserError

BICUBIC = v2.InterpolationMode.BICUBIC
BILINEAR = v2.InterpolationMode.BILINEAR


def mean_std(data_cfg) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) of data_cfg as tuples of 3 floats."""
    mean = tuple(float(x) for x in data_cfg.mean)
    std = tuple(float(x) for x in data_cfg.std)
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise UserError(f"data.mean={list(mean)} and data.std={list(std)} need 3 values each "
                        f"(RGB) and std > 0")
    return mean, std


def img_size(data_cfg) -> int:
    size = data_cfg.img_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UserError(f"data.img_size={size!r} must be a positive integer (pixels)")
    return size


def to_normalized_tensor(mean, std) -> list:
    """Steps from a PIL image (or uint8 tensor) to a plain normalized float32 tensor."""
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(mean), std=list(std)), v2.ToPureTensor()]


def build_eval_transform(data_cfg) -> v2.Compose:
    """Resize to img_size / crop_ratio (bicubic), center-crop img_size, normalize."""
    size = img_size(data_cfg)
    ratio = float(data_cfg.get("crop_ratio", 1.0))
    if not 0 < ratio <= 1:
        raise UserError(f"data.crop_ratio={ratio} must be in (0, 1]: the fraction of the resized "
                        f"image kept by the center crop")
    resize = int(round(size / ratio))
    mean, std = mean_std(data_cfg)
    return v2.Compose([v2.Resize(resize, interpolation=BICUBIC, antialias=True),
                       v2.CenterCrop(size), *to_normalized_tensor(mean, std)])


def build_linear_train_transform(data_cfg, scale: tuple[float, float] = (0.08, 1.0)) -> v2.Compose:
    """RandomResizedCrop(img_size, scale) + horizontal flip + normalize (DINO eval_linear)."""
    mean, std = mean_std(data_cfg)
    return v2.Compose([v2.RandomResizedCrop(img_size(data_cfg), scale=scale, interpolation=BILINEAR,
                                            antialias=True),
                       v2.RandomHorizontalFlip(), *to_normalized_tensor(mean, std)])
