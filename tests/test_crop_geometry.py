"""DINO's crops come from the whole image on the device path, as torchvision draws them.

Each distribution test also runs the centre-square behaviour (crops drawn inside the
centred square of side min(H, W), what the device path did before) and checks that it
fails the same test: the tolerances are tight enough to tell the two apart."""
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from resmlp.data.gpu_augment import GpuMultiCrop, counter_uniforms, crop_boxes
from resmlp.data.multicrop import MultiCropTransform, ViewSpec

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GLOBAL, LOCAL = (0.4, 1.0), (0.05, 0.4)
RATIO = (3 / 4, 4 / 3)
PLAIN = dict(jitter_prob=0.0, gray_prob=0.0, blur_probs=(0.0, 0.0, 0.0), solarize_prob=0.0)
SHAPES = [(160, 240), (300, 100), (80, 320)]  # (H, W): 3:2 landscape, 1:3 portrait, 4:1 panorama


def ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two
    empirical distribution functions."""
    a, b = np.sort(np.asarray(a, float)), np.sort(np.asarray(b, float))
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max())


def ks_limit(n: int, m: int) -> float:
    """The KS statistic two samples of one distribution stay under with probability
    0.999 (c(alpha) = 1.95); the draws are seeded, so a pass is repeatable."""
    return 1.95 * math.sqrt((n + m) / (n * m))


def shape_stats(top, left, h, w, H, W):
    """(area fraction of the image, log aspect ratio) of boxes, as numpy arrays."""
    h, w = np.asarray(h, float), np.asarray(w, float)
    return h * w / (H * W), np.log(w / h)


def device_draw(H, W, n, scale, seed=0, pad=16):
    """Boxes the device path draws for n images of H x W sitting top-left in a padded
    batch (one view of the given scale)."""
    aug = GpuMultiCrop(32, 16, 1, global_scale=GLOBAL, local_scale=scale, normalize=False)
    images = torch.zeros(1, 3, H + pad, W + pad, dtype=torch.uint8).expand(n, -1, -1, -1)
    sizes = torch.tensor([[H, W]]).expand(n, 2)
    view = aug.draw(images, seed=seed, keys=torch.arange(n), sizes=sizes)[2]
    return [view[k].numpy() for k in ("top", "left", "h", "w")]


def torchvision_draw(H, W, n, scale, seed=0):
    torch.manual_seed(seed)
    img = torch.zeros(3, H, W, dtype=torch.uint8)
    return [np.array(v) for v in zip(*(T.RandomResizedCrop.get_params(img, list(scale), list(RATIO))
                                       for _ in range(n)))]


def centre_square_draw(H, W, n, scale, seed=0):
    """The previous device path: boxes drawn over the centred square, in image pixels."""
    s = min(H, W)
    u = counter_uniforms(seed, torch.arange(n), 1)[0]
    top, left, h, w = (t.numpy() for t in crop_boxes(u, s, s, scale, RATIO))
    return top + (H - s) // 2, left + (W - s) // 2, h, w


@pytest.mark.parametrize("H,W", SHAPES)
@pytest.mark.parametrize("scale", [GLOBAL, LOCAL], ids=["global", "local"])
def test_device_boxes_have_torchvisions_distribution_over_the_whole_image(H, W, scale):
    n = 3000
    ours = shape_stats(*device_draw(H, W, n, scale), H, W)
    ref = shape_stats(*torchvision_draw(H, W, n, scale), H, W)
    old = shape_stats(*centre_square_draw(H, W, n, scale), H, W)
    limit = ks_limit(n, n)
    for name, a, b, c in zip(("area fraction", "log aspect ratio"), ours, ref, old):
        assert ks(a, b) < limit, (name, ks(a, b), limit)
    # the centre square shrinks every area fraction by min(H, W) / max(H, W)
    assert ks(old[0], ref[0]) > 2 * limit


@pytest.mark.parametrize("H,W", SHAPES[:2])  # on the 4:1 panorama every global draw falls back to the centre
def test_device_boxes_reach_every_border_and_stay_inside(H, W):
    for scale in (GLOBAL, LOCAL):
        top, left, h, w = device_draw(H, W, 3000, scale, seed=1)
        assert top.min() == 0 and left.min() == 0
        assert (top + h).max() == H and (left + w).max() == W
        assert (top >= 0).all() and (left >= 0).all() and (top + h <= H).all() and (left + w <= W).all()
    def reaches_all(top, left, h, w):
        return top.min() == 0 and left.min() == 0 and (top + h).max() == H and (left + w).max() == W
    assert not reaches_all(*centre_square_draw(H, W, 3000, LOCAL, seed=1))  # the long axis' ends


# ---- the pixels: a coordinate ramp reads back its box --------------------------------------

def ramp(H, W):
    """uint8 (3, H, W): red = column, green = row (H, W <= 256), blue 0."""
    x = torch.zeros(3, H, W, dtype=torch.uint8)
    x[0] = torch.arange(W, dtype=torch.uint8).view(1, W)
    x[1] = torch.arange(H, dtype=torch.uint8).view(H, 1)
    return x


def read_box(crop: np.ndarray):
    """(top, left, h, w, flipped) of the box a crop (3, S, S) of ramp() was cut from,
    values in 0..255. Output pixel j samples the ramp at left + (j + 0.5) w / S, whose
    value is that coordinate - 0.5 (pixel centres); a line fitted over the middle half
    (away from the box edges, where the filter is cut short) gives w and left."""
    S = crop.shape[-1]
    j = np.arange(S // 4, S - S // 4)

    def axis(profile):
        a, b = np.polyfit(j, profile[j], 1)
        length = abs(a) * S
        start = b + 0.5 - (0.5 * a if a > 0 else (S - 0.5) * abs(a))
        return start, length, a < 0
    left, w, flipped = axis(crop[0].mean(axis=0))
    top, h, _ = axis(crop[1].mean(axis=1))
    return top, left, h, w, flipped


def test_device_crops_read_back_their_boxes_and_never_see_the_padding():
    H, W, n = 160, 240, 48
    canvas = torch.full((n, 3, 256, 256), 255, dtype=torch.uint8)  # padding no crop may touch
    canvas[:, :, :H, :W] = ramp(H, W)
    sizes = torch.tensor([[H, W]]).expand(n, 2)
    aug = GpuMultiCrop(32, 16, 2, normalize=False, **PLAIN)
    crops = aug(canvas, seed=3, keys=torch.arange(n), sizes=sizes)
    drawn = aug.draw(canvas, seed=3, keys=torch.arange(n), sizes=sizes)
    for view, params in zip(crops, drawn):
        assert view[:, 0].max() <= (W - 1) / 255 + 1e-4 and view[:, 1].max() <= (H - 1) / 255 + 1e-4
        for i in range(n):
            top, left, h, w, flipped = read_box(view[i].numpy() * 255)
            want = [float(params[k][i]) for k in ("top", "left", "h", "w")]
            assert np.allclose([top, left, h, w], want, atol=0.05), ([top, left, h, w], want)
            assert flipped == bool(params["flip"][i])


def test_workers_and_device_paths_draw_the_same_crops():
    """The per-image CPU path (torchvision on PIL) and the device path, read back from the
    pixels of a ramp image, give the same distribution of boxes."""
    H, W, n = 160, 240, 1500
    image = ramp(H, W)
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    plain = dict(jitter_prob=0.0, gray_prob=0.0, blur_prob=0.0, solarize_prob=0.0)
    cpu = MultiCropTransform([ViewSpec(32, GLOBAL, **plain), ViewSpec(16, LOCAL, **plain)], (0, 0, 0), (1, 1, 1))
    torch.manual_seed(0)
    cpu_boxes = [[], []]
    for _ in range(n):
        for v, crop in enumerate(cpu(pil)):
            cpu_boxes[v].append(read_box(crop.numpy() * 255))
    aug = GpuMultiCrop(32, 16, 1, normalize=False, **PLAIN)
    dev_boxes = [[], []]
    for start in range(0, n, 250):
        crops = aug(image.expand(250, -1, -1, -1), seed=11, keys=torch.arange(start, start + 250),
                    sizes=torch.tensor([[H, W]]).expand(250, 2))
        for v, c in ((0, crops[0]), (1, crops[2])):
            dev_boxes[v] += [read_box(x * 255) for x in c.numpy()]
    limit = ks_limit(n, n)
    for v, scale in enumerate((GLOBAL, LOCAL)):
        a, b = np.round(np.array(cpu_boxes[v])[:, :4]), np.round(np.array(dev_boxes[v])[:, :4])
        for stat_a, stat_b in zip(shape_stats(*a.T, H, W), shape_stats(*b.T, H, W)):
            assert ks(stat_a, stat_b) < limit
        assert abs(np.array(cpu_boxes[v])[:, 4].mean() - 0.5) < 0.05  # flips
        assert abs(np.array(dev_boxes[v])[:, 4].mean() - 0.5) < 0.05
        old = shape_stats(*centre_square_draw(H, W, n, scale), H, W)
        assert ks(old[0], shape_stats(*a.T, H, W)[0]) > limit
