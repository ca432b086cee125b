"""DINO's multi-crop augmentation: one RGB PIL image -> [global_1, global_2, local_1..local_n].

Each view is a geometric stage (RandomResizedCrop, bicubic; horizontal flip p 0.5;
optionally a resize of local crops) followed by a photometric stage, as in DINO:

| view      | color jitter (0.4,0.4,0.2,0.1) | grayscale | Gaussian blur | solarize |
|-----------|--------------------------------|-----------|---------------|----------|
| global 1  | p 0.8                          | p 0.2     | p 1.0         | -        |
| global 2  | p 0.8                          | p 0.2     | p 0.1         | p 0.2    |
| local i   | p 0.8                          | p 0.2     | p 0.5         | -        |

then scaling to [0, 1] and normalization with data.mean/std. Color jitter strength is the
same on every view (lightly's DINOTransform does not pass `cj_strength` to the second
global view; its defaults make the values agree, but this module sets them explicitly).

Gaussian blur: DINO blurs with PIL's `ImageFilter.GaussianBlur(radius=sigma)`, sigma
uniform in (0.1, 2.0) px at 224 px; the "23 px kernel at 224 px" of BYOL/SimCLR holds
that Gaussian whole (+-5.5 sigma). Here sigma scales with the global size,
(0.1, 2.0) * global_size / 224, so small images get the same relative blur (at 32 px,
sigma is at most 0.29 px: little blur, as CIFAR recipes prefer); the kernel that holds
it, `blur_kernel` = int(0.1 * global_size) made odd (>= 3; 23 at 224), is
recorded in each ViewSpec for a kernel-based (GPU) implementation. The CPU path runs
PIL's Gaussian blur (fast; torchvision's GaussianBlur is ~20x slower at 224 px).

Local crops and fixed-grid models: ResMLP's cross-patch layer fixes the patch grid; the
"resize" strategy (resmlp.data.crop_plan) crops the locals straight at the global
resolution by passing local_size=global_size. The parameters of view i are in
`transform.views[i]` (ViewSpec). All randomness comes from torch's RNG (seeded per
DataLoader worker).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2

from resmlp.core.errors import UserError
from resmlp.data.transforms import BICUBIC, mean_std, to_normalized_tensor

DINO_JITTER = (0.4, 0.4, 0.2, 0.1)  # brightness, contrast, saturation, hue
DINO_SIGMA_AT_224 = (0.1, 2.0)


@dataclass(frozen=True)
class ViewSpec:
    """Everything that defines one view."""
    size: int                          # output side in pixels
    scale: tuple[float, float]         # RandomResizedCrop area fraction
    flip_prob: float = 0.5
    jitter: tuple = DINO_JITTER
    jitter_prob: float = 0.8
    gray_prob: float = 0.2
    blur_prob: float = 0.5
    blur_sigma: tuple[float, float] = DINO_SIGMA_AT_224
    blur_kernel: int = 23
    solarize_prob: float = 0.0
    solarize_threshold: int = 128


def blur_kernel_size(global_size: int) -> int:
    """10% of the global size rounded down, then up to odd; at least 3 (23 at 224, 9 at 96, 3 at 32)."""
    k = int(0.1 * global_size)
    return max(3, k if k % 2 else k + 1)


class RandomGaussianBlur(torch.nn.Module):
    """With probability p, PIL's Gaussian blur with sigma ~ U(sigma) (DINO's blur, torch RNG)."""

    def __init__(self, p: float, sigma: tuple[float, float]):
        super().__init__()
        self.p, self.sigma = p, sigma

    def forward(self, img: Image.Image) -> Image.Image:
        if self.p <= 0 or torch.rand(()) >= self.p:
            return img
        s = float(torch.empty(()).uniform_(self.sigma[0], self.sigma[1]))
        return img.filter(ImageFilter.GaussianBlur(radius=s))


def geometric(view: ViewSpec) -> v2.Compose:
    return v2.Compose([v2.RandomResizedCrop(view.size, scale=view.scale, interpolation=BICUBIC, antialias=True),
                       v2.RandomHorizontalFlip(view.flip_prob)])


def photometric(view: ViewSpec) -> v2.Compose:
    """PIL -> PIL photometric stage of one view (torchvision v2 ops + PIL's blur)."""
    b, c, s, h = view.jitter
    return v2.Compose([
        v2.RandomApply([v2.ColorJitter(brightness=b, contrast=c, saturation=s, hue=h)], p=view.jitter_prob),
        v2.RandomGrayscale(p=view.gray_prob),
        RandomGaussianBlur(view.blur_prob, view.blur_sigma),
        v2.RandomSolarize(threshold=view.solarize_threshold, p=view.solarize_prob),
    ])


class MultiCropTransform:
    """Callable: RGB PIL image -> list of tensors, one per view in `views` (see module doc)."""

    def __init__(self, views: list[ViewSpec], mean, std):
        self.views = list(views)
        self.mean, self.std = tuple(mean), tuple(std)
        self.n_global = 2
        self._geometric = [geometric(v) for v in self.views]
        self._photometric = [photometric(v) for v in self.views]
        self._finish = v2.Compose(to_normalized_tensor(mean, std))

    def __call__(self, img: Image.Image) -> list[torch.Tensor]:
        return [self._finish(photo(geo(img))) for geo, photo in zip(self._geometric, self._photometric)]

    def __repr__(self) -> str:
        sizes = ", ".join(str(v.size) for v in self.views)
        return f"MultiCropTransform(views=[{sizes}])"


def build_multicrop_transform(data_cfg, global_size: int, local_size: int, n_local: int,
                              global_scale=(0.4, 1.0), local_scale=(0.05, 0.4),
                              blur_sigma: tuple[float, float] | None = None) -> MultiCropTransform:
    """DINO's 2 global + n_local local views (see the module doc for every default).

    blur_sigma: sigma range in pixels; None scales DINO's (0.1, 2.0) by global_size / 224.
    With n_local=0, DINO widens global_scale to (0.14, 1.0): the caller passes that.
    """
    if n_local < 0 or global_size < 1 or local_size < 1:
        raise UserError(f"multi-crop needs global_size, local_size >= 1 and n_local >= 0 "
                        f"(got {global_size}, {local_size}, {n_local})")
    mean, std = mean_std(data_cfg)
    sigma = tuple(blur_sigma) if blur_sigma is not None else tuple(
        x * global_size / 224 for x in DINO_SIGMA_AT_224)
    kernel = blur_kernel_size(global_size)
    g_scale, l_scale = tuple(global_scale), tuple(local_scale)
    common = dict(blur_sigma=sigma, blur_kernel=kernel)
    views = [ViewSpec(global_size, g_scale, blur_prob=1.0, **common),
             ViewSpec(global_size, g_scale, blur_prob=0.1, solarize_prob=0.2, **common)]
    views += [ViewSpec(local_size, l_scale, blur_prob=0.5, **common) for _ in range(n_local)]
    return MultiCropTransform(views, mean, std)
