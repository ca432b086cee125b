"""GpuMultiCrop (data/gpu_augment.py) on CPU tensors: shapes, per-sample randomness,
seeding, each photometric op against torchvision's, and the loader-side transform."""
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from resmlp.core.errors import UserError
from resmlp.data import build_multicrop_transform
from resmlp.data.resumable import KeyedDataset
from resmlp.data.decode import Source, SourceDecoder, collate_sources
from resmlp.data.gpu_augment import (GpuMultiCrop, _blend_step, adjust_hue,
                                     blur_matrix, counter_uniforms, crop_boxes)

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PLAIN = dict(jitter_prob=0.0, gray_prob=0.0, blur_probs=(0.0, 0.0, 0.0), solarize_prob=0.0, flip_prob=0.0)


def photos(n, size=48, seed=0):
    """Smooth, colourful uint8 images (n, 3, size, size): a coarse random grid upsampled."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 5, 5, generator=g)
    x = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    x = x + 0.05 * torch.randn(n, 3, size, size, generator=g)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def aug(**kw):
    args = dict(global_size=32, local_size=16, n_local=3, mean=MEAN, std=STD)
    args.update(kw)
    return GpuMultiCrop(**args)


def test_shapes_dtypes_and_count():
    out = aug()(photos(4), seed=0)
    assert len(out) == 5
    assert [tuple(c.shape) for c in out] == [(4, 3, 32, 32)] * 2 + [(4, 3, 16, 16)] * 3
    assert all(c.dtype == torch.float32 and c.is_contiguous() for c in out)
    assert out[0].min() < 0  # normalized
    half = aug(out_dtype=torch.bfloat16, n_local=0)(photos(2), seed=0)
    assert len(half) == 2 and half[0].dtype == torch.bfloat16
    bil = aug(interpolation="bilinear")(photos(3, size=40), seed=1)
    assert [tuple(c.shape) for c in bil] == [(3, 3, 32, 32)] * 2 + [(3, 3, 16, 16)] * 3
    assert all(torch.isfinite(c).all() for c in out + bil)


def test_every_sample_draws_its_own_parameters():
    one = photos(1)
    out = aug()(one.repeat(2, 1, 1, 1), seed=3)
    for view in out:
        assert not torch.allclose(view[0], view[1])


def test_seed_determines_the_output_and_keys_follow_the_sample():
    imgs = photos(3)
    a, b, c = aug()(imgs, seed=7), aug()(imgs, seed=7), aug()(imgs, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.allclose(x, y) for x, y in zip(a, c))
    # with keys, a sample's crops do not depend on its place in the batch
    keys = torch.tensor([10, 11, 12])
    fwd = aug()(imgs, seed=7, keys=keys)
    rev = aug()(imgs.flip(0), seed=7, keys=keys.flip(0))
    assert all(torch.allclose(x, y.flip(0), atol=1e-5) for x, y in zip(fwd, rev))


def test_uniforms_look_uniform():
    u = counter_uniforms(123, torch.arange(2000), 2)
    assert u.shape == (2, 2000, 54) and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs((u < 0.2).float().mean().item() - 0.2) < 0.01
    flat = u.flatten()
    assert np.corrcoef(flat[:-1].numpy(), flat[1:].numpy())[0, 1] < 0.02


def small(**kw):
    return aug(global_size=16, local_size=8, n_local=2, **kw)


def test_solarize_only_on_the_second_global_view():
    imgs = photos(300, size=24)
    base = small(solarize_prob=0.0)(imgs, seed=1)
    forced = small(solarize_prob=1.0)(imgs, seed=1)
    assert torch.equal(base[0], forced[0]) and all(torch.equal(x, y) for x, y in zip(base[2:], forced[2:]))
    differs = [not torch.equal(base[1][i], forced[1][i]) for i in range(len(imgs))]
    assert sum(differs) >= 0.95 * len(imgs)  # all but crops with no pixel >= 128 after jitter
    dino = small()(imgs, seed=1)  # p = 0.2
    changed = torch.tensor([not torch.equal(base[1][i], dino[1][i]) for i in range(len(imgs))])
    assert abs(changed.float().mean().item() - 0.2) < 0.07
    assert torch.equal(base[0], dino[0])


def test_grayscale_gives_equal_channels_before_normalization():
    imgs = photos(300, size=24)
    gray = small(gray_prob=1.0, normalize=False)(imgs, seed=2)
    for view in gray:
        assert torch.allclose(view[:, 0], view[:, 1], atol=1e-5) and torch.allclose(view[:, 1], view[:, 2], atol=1e-5)
    raw = small(normalize=False)(imgs, seed=2)  # p = 0.2
    assert all(-1e-5 <= v.min() and v.max() <= 1 + 1e-5 for v in raw)
    is_gray = ((raw[0][:, 0] - raw[0][:, 1]).abs().amax(dim=(1, 2)) < 1e-5).float()
    assert abs(is_gray.mean().item() - 0.2) < 0.07


def test_statistics_roughly_match_the_cpu_transform():
    imgs = photos(48, size=40, seed=5)
    cfg = OmegaConf.create({"mean": list(MEAN), "std": list(STD)})
    cpu = build_multicrop_transform(cfg, 32, 16, 2)
    torch.manual_seed(0)
    cpu_crops = [cpu(Image.fromarray(im.permute(1, 2, 0).numpy())) for im in imgs]
    cpu_g = torch.stack([c[0] for c in cpu_crops] + [c[1] for c in cpu_crops])
    cpu_l = torch.stack([c[2] for c in cpu_crops] + [c[3] for c in cpu_crops])
    gpu = aug(n_local=2)(imgs, seed=0)
    gpu_g, gpu_l = torch.cat(gpu[:2]), torch.cat(gpu[2:])
    for a, b in ((cpu_g, gpu_g), (cpu_l, gpu_l)):
        assert torch.allclose(a.mean(dim=(0, 2, 3)), b.mean(dim=(0, 2, 3)), atol=0.15)
        assert torch.allclose(a.std(dim=(0, 2, 3)), b.std(dim=(0, 2, 3)), rtol=0.15)


def test_bicubic_crop_is_torchvisions_resized_crop():
    imgs = photos(6, size=48)
    plain = aug(normalize=False, **PLAIN)
    out = plain(imgs, seed=4)
    u = counter_uniforms(4, torch.arange(6), plain.n_views)
    for v in (0, 2):
        size, scale = plain.views[v].size, plain.views[v].scale
        top, left, h, w = crop_boxes(u[v], 48, 48, scale, plain.ratio)
        for i in range(6):
            want = TF.resized_crop(imgs[i].float() / 255, int(top[i]), int(left[i]), int(h[i]), int(w[i]),
                                   [size, size], interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
            assert (out[v][i] - want.clamp(0, 1)).abs().max() < 2e-3
    flipped = aug(normalize=False, **{**PLAIN, "flip_prob": 1.0})(imgs, seed=4)
    assert all(torch.allclose(a, b.flip(-1), atol=1e-5) for a, b in zip(out, flipped))


def test_crop_boxes_follow_scale_and_ratio():
    u = counter_uniforms(0, torch.arange(4000), 1)[0]
    top, left, h, w = crop_boxes(u, 64, 64, (0.05, 0.4), (3 / 4, 4 / 3))
    area = h * w / 64 ** 2
    assert area.min() > 0.04 and area.max() < 0.42 and abs(area.mean().item() - 0.225) < 0.02
    assert ((w / h) > 0.7).all() and ((w / h) < 1.45).all()
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 64).all() and (left + w <= 64).all()


def test_color_ops_match_torchvision():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 20, 20, generator=g)
    hcw = x.permute(0, 2, 1, 3).contiguous()               # the module's (N, S, 3, S) layout
    back = lambda t: t.permute(0, 2, 1, 3)                 # noqa: E731
    shift = torch.tensor([0.1, -0.1, 0.05, 0.0])
    got = back(adjust_hue(hcw, shift))
    for i in range(4):
        assert torch.allclose(got[i], TF.adjust_hue(x[i], float(shift[i])), atol=1e-5)
    factors = torch.tensor([[1.3, 0.7, 1.2]]).repeat(4, 1)
    fns = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
    for op, fn in enumerate(fns):
        ops = torch.full((4,), op)
        active = torch.tensor([True, True, False, True])
        got = back(_blend_step(hcw, ops, active, factors))
        for i in range(4):
            want = fn(x[i], float(factors[i, op])) if active[i] else x[i]
            assert torch.allclose(got[i], want, atol=1e-5)


def test_blur_matrix_is_torchvisions_gaussian_blur():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 3, 24, 24, generator=g)
    sigma = torch.tensor([0.5, 1.7, 1.0])
    apply = torch.tensor([True, True, False])
    m = blur_matrix(sigma, apply, 24, radius=4)
    got = m.unsqueeze(1) @ x @ m.transpose(1, 2).unsqueeze(1)
    for i in range(3):
        want = TF.gaussian_blur(x[i], [9, 9], [float(sigma[i])] * 2) if apply[i] else x[i]
        assert torch.allclose(got[i], want, atol=1e-5)


def test_loader_side_transform_and_keyed_dataset():
    t = SourceDecoder(64)
    wide = t(Image.new("RGB", (300, 200), (10, 200, 30)))  # shrunk to fit, never cropped
    assert type(wide) is Source and wide.size == (43, 64) and wide.file_size == (200, 300)
    assert wide.pixels.dtype == torch.uint8 and tuple(wide.pixels.shape) == (3, 43, 64)
    assert wide.pixels[:, 21, 32].tolist() == [10, 200, 30]

    class Two(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return Image.new("RGB", (40 + 20 * i, 30), (i, i, i)), i

    ds = KeyedDataset(Two(), t)
    src, label, key = ds[5]  # epoch 2, index 1
    assert label == 1 and key == 5 and src.size == (30, 60) and src.pixels[0, 0, 0].item() == 1
    batch = collate_sources([ds[2], ds[3]])
    assert tuple(batch.images.shape) == (2, 3, 32, 64) and batch.sizes.tolist() == [[30, 40], [30, 60]]
    assert batch.keys.tolist() == [2, 3] and batch.labels.tolist() == [0, 1]
    assert batch.images[0, :, :, 40:].eq(0).all() and batch.images[0, :, 30:].eq(0).all()
    with pytest.raises(UserError):
        SourceDecoder(1)


def test_bad_inputs_are_user_errors():
    with pytest.raises(UserError, match="uint8"):
        aug()(torch.rand(2, 3, 32, 32), seed=0)
    with pytest.raises(UserError, match="keys"):
        aug()(photos(2), seed=0, keys=torch.arange(3))
    with pytest.raises(UserError, match="interpolation"):
        aug(interpolation="nearest")


@pytest.mark.cuda
def test_same_crops_on_gpu_and_cpu():
    imgs = photos(4)
    cpu = aug()(imgs, seed=9)
    gpu = aug()(imgs.cuda(), seed=9)
    assert all(torch.allclose(a, b.cpu(), atol=2e-2) for a, b in zip(cpu, gpu))
    assert math.isfinite(float(gpu[0].sum()))
