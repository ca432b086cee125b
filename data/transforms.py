"""Evaluation and linear-probe transforms: an image -> normalized float tensor (3, S, S).

- `build_eval_transform`: resize the shorter side to round(img_size / crop_ratio)
  (bicubic, antialiased), center-crop img_size, scale to [0, 1], normalize with
  data.mean/std. crop_ratio 0.875 at 224 px gives DINO's and ResMLP's resize 256 +
  crop 224; crop_ratio 1.0 (28/32/96 px datasets) resizes straight to img_size.
- `build_linear_train_transform`: DINO's eval_linear training augmentation:
  RandomResizedCrop(img_size, scale (0.08, 1), bilinear as in DINO) + horizontal flip
  + normalize.
Both take image files' bytes (decode.Decoded: libjpeg-turbo straight to a uint8
tensor, large JPEGs shrunk while decoding) or PIL images, and run the torchvision v2
ops on the uint8 tensor: what feature extraction (k-NN, linear probe, fine-tuning
evaluation) spends per image. torchvision's tensor resize follows PIL's antialiased
filters; its uint8 results may differ from PIL's by a rounding step.
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


class NormalizeUint8(torch.nn.Module):
    """uint8 (3, H, W) -> float32 (x / 255 - mean) / std, in one new tensor and two
    in-place passes (ToDtype then Normalize make more tensors and passes: a large
    share of an eval transform's time once decoding is fast)."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self._scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(3, 1, 1)
        self._bias = torch.tensor([-m / s for m, s in zip(self.mean, self.std)]).view(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"NormalizeUint8 takes uint8 images, got {x.dtype}")
        # contiguous first: torch's resize returns channels-last strides, on which the
        # broadcast over channels takes a slow path
        return x.contiguous().to(torch.float32).mul_(self._scale).add_(self._bias)

    def extra_repr(self) -> str:
        return f"mean={list(self.mean)}, std={list(self.std)}"


def to_normalized_tensor(mean, std) -> list:
    """Steps from a PIL image (or uint8 tensor) to a plain normalized float32 tensor."""
    return [v2.ToImage(), v2.ToPureTensor(), NormalizeUint8(mean, std)]


def build_eval_transform(data_cfg):
    """Resize to img_size / crop_ratio (bicubic), center-crop img_size, normalize."""
    size = img_size(data_cfg)
    ratio = float(data_cfg.crop_ratio)
    if not 0 < ratio <= 1:
        raise UserError(f"data.crop_ratio={ratio} must be in (0, 1]: the fraction of the resized "
                        f"image kept by the center crop")
    resize = int(round(size / ratio))
    mean, std = mean_std(data_cfg)
    from resmlp.data.decode import Decoded
    return Decoded(v2.Compose([v2.Resize(resize, interpolation=BICUBIC, antialias=True),
                               v2.CenterCrop(size), *to_normalized_tensor(mean, std)]), min_short=resize)


def build_linear_train_transform(data_cfg, scale: tuple[float, float] = (0.08, 1.0)):
    """RandomResizedCrop(img_size, scale) + horizontal flip + normalize (DINO eval_linear),
    over the whole image (a large JPEG decoded down to a short side >= data.source_side / 2)."""
    from resmlp.data.decode import Decoded, source_side
    mean, std = mean_std(data_cfg)
    return Decoded(v2.Compose([v2.RandomResizedCrop(img_size(data_cfg), scale=scale, interpolation=BILINEAR,
                                                    antialias=True),
                               v2.RandomHorizontalFlip(), *to_normalized_tensor(mean, std)]),
                   min_short=source_side(data_cfg) // 2)
