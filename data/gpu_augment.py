"""DINO's multi-crop augmentation for a whole batch at once, on the batch's device.

The CPU path (multicrop.py) augments one PIL image at a time in the loader workers; on
a GPU box with 16 cores that is likely the bottleneck (README, Performance). Here the
workers only decode each whole image (decode.py: `SourceDecoder`
and `collate_sources` put the batch's images top-left in one zero-padded uint8 tensor
and send each image's valid height and width along), and `GpuMultiCrop` makes all the
views of the batch on the device, every sample with its own random parameters:

    crops = GpuMultiCrop.from_plan(crop_plan(cfg), cfg.data)(images_uint8, seed, keys, sizes)
    # -> [global_1, global_2, local_1 .. local_n], float (B, 3, S, S), normalized

Per view, in DINO's order (same probabilities as multicrop.py's table):

1. random resized crop over the whole image: area fraction ~ U(scale) of the image's
   own area, log aspect ratio ~ U(log 3/4, log 4/3), integer box, 10 attempts then a
   centred fallback, exactly as torchvision's RandomResizedCrop draws it on that image;
   then horizontal flip with p 0.5. The padding around an image is never sampled: each
   box lies inside its image's valid (h, w) and the bicubic taps stop at the box.
   Interpolation, `interpolation=`:
     'bicubic' (default): the box is resampled with PIL's antialiased bicubic filter
       (a = -0.5, kernel widened by the downscale factor, taps limited to the box), i.e.
       crop-then-resize as torchvision does on the CPU path. It is separable, so each
       sample's crop + resize + flip is two (S x H) / (S x W) matrices and the whole
       batch is two batched matmuls.
     'bilinear': torchvision.ops.roi_align with one box per sample (aligned=True and
       adaptive sampling: each output pixel averages ceil(box / S)^2 bilinear samples,
       a box-filter antialias when shrinking), then the flip.
2. color jitter, p 0.8: brightness 0.4, contrast 0.4, saturation 0.2, hue 0.1, in a
   random order drawn per sample (as torchvision's ColorJitter), with torchvision's
   float formulas (blend with black / the mean gray level / the gray image, clamp to
   [0, 1]; hue through HSV).
3. grayscale, p 0.2 (0.2989 R + 0.587 G + 0.114 B on every channel).
4. Gaussian blur, p 1.0 / 0.1 / 0.5 (global 1 / global 2 / locals): sigma ~ U(blur_sigma)
   per sample, default DINO's (0.1, 2.0) px scaled by global_size / 224 as in
   multicrop.py; kernel `blur_kernel` taps (default multicrop.blur_kernel_size: 23 at
   224 px), reflect padding. Separable and per sample: again two batched matmuls with
   banded (S x S) matrices, so the kernel width costs nothing.
5. solarization, p 0.2, second global view only (x >= 128/255 -> 1 - x).
6. normalization with mean / std.
Differences from the CPU path: values stay float between steps (PIL rounds to uint8
after each), and an image larger than data.source_side was shrunk when decoded
(decode.py), so its crops are resampled from that copy rather than the file's pixels.
The two paths draw from different generators, so a run cannot switch between them
mid-way and stay exact. tests/test_gpu_augment.py checks the bicubic crop against
torchvision's antialiased `resized_crop`, each colour op against torchvision's
functional ops, the blur against `gaussian_blur`, and the crops' mean / std against the
CPU transform's on the same images; tests/test_crop_geometry.py the boxes' distribution.

Randomness: every random number is a counter-based hash of (seed, key of the sample,
view, draw), no generator state. So the same (seed, keys) give the same crops on any
device, batch composition or process count, and a resumed run needs only the seed.
`keys` defaults to the position in the batch (then the seed must change with every
batch); with `KeyedDataset` the keys are the EpochSampler's global sample ids (epoch * N
+ index) and the augmentation of a sample no longer depends on which rank or batch it
lands in, as resumable.py promises for the CPU path.

Layout inside: images are kept as (N, H, 3, W) ("rows, channels, columns") so that
the row matmul (N, S, H) @ (N, H, 3W) and the column matmul (N, 3S, W) @ (N, W, S)
both run on views, without copies; the output is plain contiguous (B, 3, S, S).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from resmlp.core.errors import UserError
from resmlp.data.multicrop import DINO_JITTER, DINO_SIGMA_AT_224, blur_kernel_size

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("bicubic", "bilinear")

# Columns of the per-(sample, view) table of uniforms.
_AREA, _LOGR, _TOP, _LEFT = 0, 10, 20, 30        # 10 crop attempts each
_FLIP, _JIT, _JFAC, _JORD = 40, 41, 42, 46       # jitter factors b, c, s, h; order keys x4
_GRAY, _BLUR, _SIGMA, _SOLAR = 50, 51, 52, 53
_NCOL = 54
_ATTEMPTS = 10
_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- randomness

def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): split c in 16-bit halves so no product
    leaves int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche) on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniforms(seed: int, keys: torch.Tensor, n_views: int, n_cols: int = _NCOL) -> torch.Tensor:
    """Uniforms in [0, 1), float32 (n_views, B, n_cols), a pure function of
    (seed, keys[b], view, column): no generator, same numbers on any device."""
    keys = keys.to(torch.int64)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    state = _fmix32(torch.full_like(keys, (seed & _M32) ^ 0x9E3779B9))
    state = _fmix32(state ^ (seed >> 32))
    state = _fmix32(state ^ (keys & _M32))
    state = _fmix32(state ^ ((keys >> 32) & _M32))
    counter = torch.arange(n_views * n_cols, device=keys.device, dtype=torch.int64)
    salt = _fmix32(_mul32(counter + 1, 0x9E3779B9))
    h = _fmix32(state.view(1, -1, 1) ^ salt.view(n_views, 1, n_cols))
    h = _fmix32(h ^ 0x5BD1E995)
    return (h >> 8).to(torch.float32) * (1.0 / 2**24)


# --------------------------------------------------------------------------- geometry

def crop_boxes(u: torch.Tensor, height, width, scale, ratio):
    """torchvision's RandomResizedCrop.get_params, vectorized: (top, left, h, w) float (N,)
    from 40 uniforms per sample (10 attempts of area, log-ratio, top, left).

    height, width: the image's size, one for all (ints) or per sample (float tensors
    (N,)): each box is drawn over its own whole image, area and aspect ratio relative to
    it, as torchvision draws it on that image alone."""
    H = height if torch.is_tensor(height) else torch.full_like(u[:, 0], float(height))
    W = width if torch.is_tensor(width) else torch.full_like(u[:, 0], float(width))
    H, W = H.view(-1, 1), W.view(-1, 1)
    a = (H * W) * (scale[0] + (scale[1] - scale[0]) * u[:, _AREA:_AREA + _ATTEMPTS])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    ar = torch.exp(lo + (hi - lo) * u[:, _LOGR:_LOGR + _ATTEMPTS])
    w = torch.round(torch.sqrt(a * ar))
    h = torch.round(torch.sqrt(a / ar))
    ok = (w > 0) & (h > 0) & (w <= W) & (h <= H)
    top = torch.minimum(torch.floor(u[:, _TOP:_TOP + _ATTEMPTS] * (H - h + 1)), H - h)
    left = torch.minimum(torch.floor(u[:, _LEFT:_LEFT + _ATTEMPTS] * (W - w + 1)), W - w)
    first = ok.float().argmax(dim=1, keepdim=True)  # first successful attempt

    def pick(t):
        return t.gather(1, first).squeeze(1)

    # torchvision's fallback after 10 failures: the whole image, ratio clamped, centred
    H, W = H.squeeze(1), W.squeeze(1)
    in_ratio = W / H
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    fw = torch.where(wide, torch.round(H * ratio[1]), W)
    fh = torch.where(narrow, torch.round(W / ratio[0]), H)
    any_ok = ok.any(dim=1)
    top = torch.where(any_ok, pick(top), torch.div(H - fh, 2, rounding_mode="floor"))
    left = torch.where(any_ok, pick(left), torch.div(W - fw, 2, rounding_mode="floor"))
    h = torch.where(any_ok, pick(h), fh)
    w = torch.where(any_ok, pick(w), fw)
    return top, left, h, w


def _cubic(d: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    d = d.abs()
    d2, d3 = d * d, d * d * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return torch.where(d <= 1, near, torch.where(d < 2, far, 0.0))


def resample_matrix(start: torch.Tensor, length: torch.Tensor, size_in: int, size_out: int,
                    gain: float = 1.0, flip: torch.Tensor | None = None) -> torch.Tensor:
    """(N, size_out, size_in) weights of PIL's antialiased bicubic resize of the span
    [start, start + length) of an axis to size_out pixels (taps limited to the span);
    output order reversed for the samples where `flip` (a mirror, at no cost).

    The kernel of output i spans +-2 * max(1, length / size_out) input pixels around its
    centre; only those taps are evaluated (a static bound, no device sync), then
    scattered into the dense matrix for the batched matmul."""
    dev = start.device
    n = start.shape[0]
    scale = (length / size_out).view(-1, 1, 1)
    support = torch.clamp(scale, min=1.0)
    i = torch.arange(size_out, device=dev, dtype=torch.float32).view(1, -1, 1)
    if flip is not None:
        i = torch.where(flip.view(-1, 1, 1), (size_out - 1) - i, i)
    centers = start.view(-1, 1, 1) + (i + 0.5) * scale                               # (N, S, 1)
    n_taps = 2 * math.ceil(2 * max(1.0, size_in / size_out)) + 2
    first = torch.floor(centers - 2 * support - 0.5)                                 # (N, S, 1)
    idx = first + torch.arange(n_taps, device=dev, dtype=torch.float32).view(1, 1, -1)  # (N, S, K)
    pos = idx + 0.5
    w = _cubic((pos - centers) / support)
    w = w * ((pos > start.view(-1, 1, 1)) & (pos < (start + length).view(-1, 1, 1)))
    w = w * (gain / w.sum(dim=-1, keepdim=True).clamp_min(1e-12))
    out = torch.zeros(n, size_out, size_in, device=dev, dtype=torch.float32)
    return out.scatter_add_(2, idx.clamp(0, size_in - 1).long(), w)


def blur_matrix(sigma: torch.Tensor, apply: torch.Tensor, size: int, radius: int) -> torch.Tensor:
    """(N, size, size) banded matrices of a 1-D Gaussian blur with per-sample sigma and
    reflect padding (torchvision's); identity where `apply` is False.

    Entry (i, j) sums the taps t that land on pixel j from output i: t = j - i directly,
    t = -(i + j) reflected off the left edge (j > 0) and t = 2(size - 1) - i - j off the
    right edge (j < size - 1); radius <= size - 1 keeps it to one reflection. Built by
    gathers, no atomic adds: the same bits on every run."""
    dev = sigma.device
    r = max(0, min(radius, size - 1))
    taps = torch.arange(-r, r + 1, device=dev, dtype=torch.float32)
    g = torch.exp(-0.5 * (taps.view(1, -1) / sigma.view(-1, 1)) ** 2)
    g = g / g.sum(dim=1, keepdim=True)
    g = torch.where(apply.view(-1, 1), g, (taps == 0).float().view(1, -1))          # (N, 2r + 1)
    i = torch.arange(size, device=dev).view(-1, 1)
    j = torch.arange(size, device=dev).view(1, -1)
    out = None
    for t, valid in ((j - i, None), (-(i + j), j > 0), (2 * (size - 1) - i - j, j < size - 1)):
        ok = t.abs() <= r
        if valid is not None:
            ok = ok & valid
        term = g[:, (t.clamp(-r, r) + r).reshape(-1)].view(-1, size, size) * ok
        out = term if out is None else out + term
    return out


# --------------------------------------------------------------------------- color
# Images here are (N, S, 3, S) floats in [0, 1]; per-sample parameters are (N,) tensors.

def _gray(x: torch.Tensor) -> torch.Tensor:
    """(N, S, 3, S) -> (N, S, 1, S) luma with torchvision's weights."""
    return torch.add(torch.add(x[:, :, 0:1] * 0.2989, x[:, :, 1:2], alpha=0.587), x[:, :, 2:3], alpha=0.114)


def adjust_hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Rotate the HSV hue by `shift` (N,) turns, keeping HSV's value and saturation
    (torchvision's adjust_hue). With v = max, chroma C = max - min and the hue h6 in
    sectors [0, 6), each channel is v - C * clamp(min(k, 4 - k), 0, 1), k = (n + h6) mod 6,
    n = 5, 3, 1 for R, G, B: the usual HSV -> RGB without materialising s and v."""
    r, g, b = x[:, :, 0], x[:, :, 1], x[:, :, 2]
    maxc = torch.maximum(torch.maximum(r, g), b)
    chroma = maxc - torch.minimum(torch.minimum(r, g), b)
    safe = torch.where(chroma > 0, chroma, 1.0)
    h6 = torch.where(maxc == r, g - b, torch.where(maxc == g, (b - r) + 2 * chroma, (r - g) + 4 * chroma)) / safe
    h6 = h6 + (6.0 * shift).view(-1, 1, 1)
    out = []
    for n in (5.0, 3.0, 1.0):
        k = torch.remainder(h6 + n, 6.0)
        out.append(maxc - chroma * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0))
    return torch.stack(out, dim=2)


def _blend_step(x, op, active, factors):
    """One position of the jitter order: brightness (op 0: blend with black), contrast
    (1: with the mean gray level) or saturation (2: with the gray image), clamped to
    [0, 1], for the samples where `active`; identity (factor 1) elsewhere."""
    f = factors.gather(1, op.clamp(max=2).view(-1, 1)).view(-1, 1, 1, 1)
    f = torch.where(active.view(-1, 1, 1, 1), f, 1.0)
    gray = _gray(x)
    is_con = (op == 1).float().view(-1, 1, 1, 1)
    is_sat = (op == 2).float().view(-1, 1, 1, 1)
    ref = torch.addcmul(gray.mean(dim=(1, 2, 3), keepdim=True) * is_con, gray, is_sat)
    return torch.lerp(ref, x, f).clamp_(0.0, 1.0)


def color_jitter(x: torch.Tensor, u: torch.Tensor, strength, prob: float) -> torch.Tensor:
    """torchvision's ColorJitter under RandomApply(p), per sample, ops in a random order
    per sample. Hue is the costly op, so it runs once for all samples (shift 0 where not
    drawn), between the blends drawn before it and those drawn after it."""
    bri, con, sat, hue = strength
    apply = u[:, _JIT] < prob
    ranges = [(max(0.0, 1 - bri), 1 + bri), (max(0.0, 1 - con), 1 + con), (max(0.0, 1 - sat), 1 + sat)]
    factors = torch.stack([lo + (hi - lo) * u[:, _JFAC + k] for k, (lo, hi) in enumerate(ranges)], dim=1)
    shift = torch.where(apply, -hue + 2 * hue * u[:, _JFAC + 3], 0.0)
    order = u[:, _JORD:_JORD + 4].argsort(dim=1)           # order[:, k] = op at position k
    hue_pos = (order == 3).float().argmax(dim=1)
    for k in range(3):  # a blend at position 3 always comes after the hue op
        op = order[:, k]
        x = _blend_step(x, op, apply & (op != 3) & (k < hue_pos), factors)
    if hue > 0:
        x = adjust_hue(x, shift)
    for k in range(1, 4):  # position 0 is never after the hue op
        op = order[:, k]
        x = _blend_step(x, op, apply & (op != 3) & (k > hue_pos), factors)
    return x


def op_flags(u: torch.Tensor, blur_p: torch.Tensor, sol_p: torch.Tensor, *, jitter, jitter_prob: float,
             gray_prob: float) -> dict:
    """Which photometric ops each sample draws (bool (N,) each): the one place the
    augmentation and the preview (data.preview) read them from."""
    jitters = jitter_prob > 0 and any(jitter)
    return {"jitter": (u[:, _JIT] < jitter_prob) & jitters, "gray": u[:, _GRAY] < gray_prob,
            "blur": u[:, _BLUR] < blur_p, "solarize": u[:, _SOLAR] < sol_p}


def photometric(x: torch.Tensor, u: torch.Tensor, blur_p: torch.Tensor, sol_p: torch.Tensor,
                mean: torch.Tensor, inv_std: torch.Tensor, *, jitter, jitter_prob: float,
                gray_prob: float, sigma, radius: int, threshold: float,
                normalize: bool) -> torch.Tensor:
    """Jitter, grayscale, blur, solarize and normalize crops (N, S, 3, S) in [0, 1];
    returns float32 (N, 3, S, S) (a view of an (N, S, 3, S) tensor). Shapes and Python
    numbers only: torch.compile fuses it (GpuMultiCrop(compile=True))."""
    n, size = x.shape[0], x.shape[1]
    flags = op_flags(u, blur_p, sol_p, jitter=jitter, jitter_prob=jitter_prob, gray_prob=gray_prob)
    if jitter_prob > 0 and any(jitter):
        x = color_jitter(x, u, jitter, jitter_prob)
    x = torch.where(flags["gray"].view(-1, 1, 1, 1), _gray(x), x)
    g = blur_matrix(sigma[0] + (sigma[1] - sigma[0]) * u[:, _SIGMA], flags["blur"], size, radius)
    x = torch.bmm(g, x.reshape(n, size, 3 * size))                            # along rows
    x = torch.bmm(x.view(n, 3 * size, size), g.transpose(1, 2)).view(n, size, 3, size)  # columns
    x = torch.where(flags["solarize"].view(-1, 1, 1, 1) & (x >= threshold), 1.0 - x, x)
    if normalize:
        x = (x - mean.view(1, 1, 3, 1)) * inv_std.view(1, 1, 3, 1)
    return x.permute(0, 2, 1, 3)


# --------------------------------------------------------------------------- views

@dataclass(frozen=True)
class GpuView:
    size: int
    scale: tuple[float, float]
    blur_prob: float
    solarize_prob: float


class GpuMultiCrop:
    """Batched DINO multi-crop on the device (module doc): uint8 (B, 3, H, W) ->
    [global_1, global_2, local_1..local_n], each (B, 3, S, S) normalized `out_dtype`.

    The constructor takes a crop plan's fields (global_size, local_size, n_local,
    global_scale, local_scale; see resmlp.data.crop_plan) and the normalization; the rest
    are DINO's defaults.
    `normalize=False` returns values in [0, 1] (tests, inspection). `compile=True` runs
    the photometric stage through torch.compile (worth it on a GPU; see tools/bench/NOTES.md).
    `on_compile_error(error)`: called where that compilation fails (a compiler's error,
    core.compiling.compiler_error); it raises to stop, or returns and the stage runs eager
    from then on (the trainer's, under compile=auto: ssl/fallback.py). Without it the error
    is raised as it is.
    """

    def __init__(self, global_size: int, local_size: int, n_local: int,
                 global_scale=(0.4, 1.0), local_scale=(0.05, 0.4),
                 mean=IMAGENET_MEAN, std=IMAGENET_STD, *, ratio=(3 / 4, 4 / 3),
                 interpolation: str = "bicubic", flip_prob: float = 0.5, jitter=DINO_JITTER,
                 jitter_prob: float = 0.8, gray_prob: float = 0.2, blur_probs=(1.0, 0.1, 0.5),
                 blur_sigma=None, blur_kernel: int | None = None, solarize_prob: float = 0.2,
                 solarize_threshold: int = 128, normalize: bool = True,
                 out_dtype: torch.dtype = torch.float32, compile: bool = False, on_compile_error=None):
        if global_size < 1 or local_size < 1 or n_local < 0:
            raise UserError(f"GpuMultiCrop needs global_size, local_size >= 1 and n_local >= 0 "
                            f"(got {global_size}, {local_size}, {n_local})")
        if interpolation not in INTERPOLATIONS:
            raise UserError(f"interpolation={interpolation!r} is not one of {', '.join(INTERPOLATIONS)}")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise UserError(f"mean={list(mean)} and std={list(std)} need 3 values each and std > 0")
        self.global_size, self.local_size, self.n_local = int(global_size), int(local_size), int(n_local)
        self.views = [GpuView(self.global_size, tuple(global_scale), blur_probs[0], 0.0),
                      GpuView(self.global_size, tuple(global_scale), blur_probs[1], solarize_prob)]
        self.views += [GpuView(self.local_size, tuple(local_scale), blur_probs[2], 0.0)] * self.n_local
        self.ratio = tuple(ratio)
        self.interpolation = interpolation
        self.flip_prob, self.jitter, self.jitter_prob = flip_prob, tuple(jitter), jitter_prob
        self.gray_prob = gray_prob
        self.blur_sigma = tuple(blur_sigma) if blur_sigma is not None else tuple(
            s * self.global_size / 224 for s in DINO_SIGMA_AT_224)
        self.blur_kernel = int(blur_kernel) if blur_kernel else blur_kernel_size(self.global_size)
        self.solarize_threshold = solarize_threshold / 255.0
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.normalize, self.out_dtype = normalize, out_dtype
        # torch.compile fuses the ~60 elementwise passes of the photometric stage into a
        # few kernels (one compile per crop size; the first call pays it).
        self._compiled = torch.compile(photometric, dynamic=False) if compile else None
        self._on_compile_error = on_compile_error
        self._stats: dict = {}
        self._probs: dict = {}

    @property
    def compiled(self) -> bool:
        """Whether the photometric stage runs compiled (as the step's path says, until a
        compiler's error turns it eager)."""
        return self._compiled is not None

    @classmethod
    def from_plan(cls, plan, data_cfg, **kwargs) -> "GpuMultiCrop":
        """From a crop plan (resmlp.data.crop_plan.CropPlan) and the data section (mean / std)."""
        from resmlp.data.transforms import mean_std
        mean, std = mean_std(data_cfg)
        return cls(plan.global_size, plan.local_size, plan.n_local, plan.global_scale, plan.local_scale,
                   mean=mean, std=std, **kwargs)

    @property
    def n_views(self) -> int:
        return len(self.views)

    def __repr__(self) -> str:
        return (f"GpuMultiCrop(2x{self.global_size}px + {self.n_local}x{self.local_size}px, "
                f"{self.interpolation})")

    # ---- the call -----------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, images: torch.Tensor, seed: int, keys: torch.Tensor | None = None,
                 sizes: torch.Tensor | None = None) -> list[torch.Tensor]:
        """images: uint8 (B, 3, H, W); sizes: int (B, 2), the valid (h, w) of each image,
        which sits top-left in its (H, W) (None: every image fills it). Crops are drawn
        over each image's valid part only, and resampled from nothing else."""
        B, H, W, keys, sizes = self._check(images, keys, sizes)
        dev = images.device
        u_all = counter_uniforms(seed, keys, self.n_views)
        if self.interpolation == "bicubic":
            src = images.permute(0, 2, 1, 3).reshape(B, H, 3 * W).float()   # (B, H, 3W)
        else:
            src = images.float()                                            # (B, 3, H, W)
        out: list[torch.Tensor] = []
        # Views of one size (the 2 globals, the n locals) are made together, as B x V
        # samples in (image, view) order: one crop, resample and photometric pass each.
        for group in self._groups():
            V, view = len(group), self.views[group[0]]
            S = view.size
            u = self._group_uniforms(u_all, group, B)
            crops = torch.empty(B * V, S, 3, S, device=dev, dtype=torch.float32)
            self._crop(src, H, W, u, view, V, crops, self._box(u, view, V, sizes, H, W))
            crops.clamp_(0.0, 1.0)  # bicubic overshoot, as PIL's rounding to uint8 clips it
            blur_p, sol_p = self._view_probs(group, B, dev)
            y = self._photometric(crops, u, blur_p, sol_p)                   # (B*V, 3, S, S) view
            # back to view-major order and out_dtype in one copy
            y = y.reshape(B, V, 3, S, S).transpose(0, 1).to(self.out_dtype).contiguous()
            out.extend(y.unbind(0))
        return out

    @torch.no_grad()
    def draw(self, images: torch.Tensor, seed: int, keys: torch.Tensor | None = None,
             sizes: torch.Tensor | None = None) -> list[dict]:
        """What __call__ draws for the same arguments, per view: {'top', 'left', 'h', 'w'
        (the box on the image, float), 'flip', 'jitter', 'gray', 'blur', 'solarize'
        (bool)}, each a (B,) tensor (the preview and the tests read them)."""
        B, H, W, keys, sizes = self._check(images, keys, sizes)
        u_all = counter_uniforms(seed, keys, self.n_views)
        views: list[dict] = []
        for group in self._groups():
            V, view = len(group), self.views[group[0]]
            u = self._group_uniforms(u_all, group, B)
            top, left, h, w = self._box(u, view, V, sizes, H, W)
            blur_p, sol_p = self._view_probs(group, B, images.device)
            flags = op_flags(u, blur_p, sol_p, jitter=self.jitter, jitter_prob=self.jitter_prob,
                             gray_prob=self.gray_prob)
            drawn = {"top": top, "left": left, "h": h, "w": w, "flip": u[:, _FLIP] < self.flip_prob, **flags}
            for v in range(V):
                views.append({k: t.view(B, V)[:, v] for k, t in drawn.items()})
        return views

    def _check(self, images, keys, sizes):
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise UserError(f"GpuMultiCrop wants uint8 images (B, 3, H, W), got {images.dtype} "
                            f"{tuple(images.shape)}")
        B, _, H, W = images.shape
        dev = images.device
        if keys is None:
            keys = torch.arange(B, device=dev)
        elif keys.shape != (B,):
            raise UserError(f"keys must have shape ({B},), got {tuple(keys.shape)}")
        if sizes is not None and sizes.shape != (B, 2):
            raise UserError(f"sizes must have shape ({B}, 2), got {tuple(sizes.shape)}")
        return B, H, W, keys.to(dev), None if sizes is None else sizes.to(dev)

    def _groups(self) -> list[list[int]]:
        return [g for g in ([0, 1], list(range(2, self.n_views))) if g]

    @staticmethod
    def _group_uniforms(u_all: torch.Tensor, group: list, B: int) -> torch.Tensor:
        # a slice, not u_all[group]: a list index is a fresh host tensor, and copying it
        # to the GPU makes the host wait for the stream
        return u_all[group[0]:group[-1] + 1].transpose(0, 1).reshape(B * len(group), _NCOL)

    def _box(self, u, view: GpuView, V: int, sizes: torch.Tensor | None, H: int, W: int):
        """(top, left, h, w) of the B*V samples, each over its image's valid part."""
        if sizes is None:
            return crop_boxes(u, H, W, view.scale, self.ratio)
        hw = sizes.repeat_interleave(V, dim=0).to(torch.float32)              # (B*V, 2)
        return crop_boxes(u, hw[:, 0], hw[:, 1], view.scale, self.ratio)

    def _crop(self, src, H, W, u, view: GpuView, V: int, out: torch.Tensor, box) -> None:
        """Resized crops of V views of each of the B images (u: (B*V, cols) in (image,
        view) order) at box = (top, left, h, w) per sample, flipped where drawn, into
        out (B*V, S, 3, S), values 0..1."""
        S = view.size
        N = u.shape[0]
        B = N // V
        top, left, h, w = box
        flip = u[:, _FLIP] < self.flip_prob
        if self.interpolation == "bicubic":
            ry = resample_matrix(top, h, H, S, gain=1 / 255)                # (B*V, S, H)
            rx = resample_matrix(left, w, W, S, flip=flip)                  # (B*V, S, W)
            rows = torch.bmm(ry.view(B, V * S, H), src)                     # (B, V*S, 3W): rows done
            torch.bmm(rows.view(N, S * 3, W), rx.transpose(1, 2), out=out.view(N, 3 * S, S))
            return
        from torchvision.ops import roi_align
        image = torch.arange(B, device=u.device, dtype=torch.float32).repeat_interleave(V)
        boxes = torch.stack([image, left, top, left + w, top + h], dim=1)
        t = roi_align(src, boxes, (S, S), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        t = torch.where(flip.view(-1, 1, 1, 1), t.flip(-1), t)
        out.copy_(t.permute(0, 2, 1, 3)).mul_(1 / 255)

    def _view_probs(self, group: list, B: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """Blur and solarize probabilities per (image, view) sample, made once per batch
        size and device (a fresh host-to-device copy on every call would cost a wait)."""
        key = (tuple(group), B, dev)
        if key not in self._probs:
            blur = torch.tensor([self.views[v].blur_prob for v in group]).repeat(B)
            sol = torch.tensor([self.views[v].solarize_prob for v in group]).repeat(B)
            self._probs[key] = (blur.to(dev), sol.to(dev))
        return self._probs[key]

    def _photometric(self, x, u, blur_p, sol_p) -> torch.Tensor:
        """(N, S, 3, S) crops in [0, 1] -> (N, 3, S, S) float32 (a permuted view)."""
        if x.device not in self._stats:  # one host-to-device copy per device, not per call
            self._stats[x.device] = (torch.tensor(self.mean, device=x.device),
                                     torch.tensor([1 / s for s in self.std], device=x.device))
        mean, inv_std = self._stats[x.device]
        args = (x, u, blur_p, sol_p, mean, inv_std)
        kwargs = {"jitter": self.jitter, "jitter_prob": self.jitter_prob, "gray_prob": self.gray_prob,
                  "sigma": self.blur_sigma, "radius": self.blur_kernel // 2, "threshold": self.solarize_threshold,
                  "normalize": self.normalize}
        if self._compiled is None:
            return photometric(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a compiler's error may fall back (on_compile_error)
            from resmlp.core.compiling import compiler_error
            if self._on_compile_error is None or not compiler_error(error):
                raise
            self._on_compile_error(error)
        self._compiled = None   # a pure function of its inputs: the same call again, eager
        return photometric(*args, **kwargs)
