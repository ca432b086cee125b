"""resmlp.data.decode and `run.sh data data.preview=N`: whole images decoded fast, large
ones shrunk only while enough detail is left, batched with their sizes, decoded on the
GPU on request, and the preview drawn by the trainer's own data path."""
import json
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.transforms import v2

from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.data import build_dataset, build_eval_transform
from resmlp.data.decode import (EncodedImage, SourceBatch, SourceDecoder, collate_sources, decode_rgb,
                                read_encoded, source_side)
from resmlp.data.images import load_rgb
from resmlp.data.resumable import build_train_loader
from resmlp.data.transforms import BICUBIC, to_normalized_tensor
from resmlp.data.crop_plan import build_views, crop_plan

from kit import synthetic_image
from test_data import data_cfg

needs_cuda = pytest.mark.cuda  # skipped without a GPU (conftest.py)
SIZES = [(500, 375), (375, 500), (1200, 900), (3000, 2000), (1400, 300), (300, 200)]  # (W, H)


def jpeg(path, w, h, seed=0, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    synthetic_image(w, h, seed).save(path, quality=90, **kw)
    return str(path)


def tree(root, sizes=SIZES):
    """root/train/<a|b>/ and root/val/<a|b>/ of photo-like JPEGs of the given sizes."""
    for i, (w, h) in enumerate(sizes):
        jpeg(root / "train" / "ab"[i % 2] / f"{i}.jpg", w, h, seed=i)
    for c in "ab":
        jpeg(root / "val" / c / "0.jpg", 64, 48)
    return root


def pixels(path):
    return torch.from_numpy(np.array(load_rgb(path))).permute(2, 0, 1)


def test_small_jpegs_decode_whole_and_exactly_as_pil(tmp_path):
    path = jpeg(tmp_path / "a.jpg", 500, 375)
    x, file_size = decode_rgb(read_encoded(path), 256, 512)
    assert file_size == (375, 500) and torch.equal(x, pixels(path))
    src = SourceDecoder(512)(read_encoded(path))
    assert src.size == (375, 500) and torch.equal(src.pixels, x)
    for mode in ("L", "CMYK"):
        other = tmp_path / f"{mode}.jpg"
        synthetic_image(60, 40, 1).convert(mode).save(other, quality=90)
        assert torch.equal(decode_rgb(read_encoded(str(other)))[0], pixels(str(other)))
    png = tmp_path / "p.png"
    synthetic_image(70, 50, 2).save(png)
    assert torch.equal(decode_rgb(read_encoded(str(png)))[0], pixels(str(png)))


def test_large_images_shrink_at_decode_keeping_a_256_px_short_side(tmp_path, monkeypatch):
    from PIL import JpegImagePlugin
    drafts = []
    real = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft",
                        lambda self, mode, size: drafts.append(size) or real(self, mode, size))
    decoder = SourceDecoder(512)
    for w, h in SIZES:
        drafts.clear()
        src = decoder(read_encoded(jpeg(tmp_path / f"{w}x{h}.jpg", w, h)))
        sh, sw = src.size
        assert src.file_size == (h, w) and max(sh, sw) <= 512 and src.pixels.shape[1:] == (sh, sw)
        assert abs(sw / sh - w / h) < 0.02 * w / h           # the whole image, not a crop
        if max(w, h) <= 512:
            assert (sh, sw) == (h, w)
        elif max(w, h) <= 2 * min(w, h):                     # at most 2:1: the short side keeps 256 px
            assert min(sh, sw) >= 256
        assert bool(drafts) == (min(w, h) >= 512)            # reduced by libjpeg when it can
    assert source_side(OmegaConf.create({"img_size": 224, "source_side": None})) == 512
    with pytest.raises(UserError, match="data.source_side"):  # its limit, before any work
        load_config("dino", "resmlp_s12", ["data.source_side=1"])


def test_unreadable_files_are_named(tmp_path):
    path = jpeg(tmp_path / "t.jpg", 64, 64)
    data = open(path, "rb").read()
    with pytest.raises(UserError, match=r"cannot read image .*t\.jpg.*skip_corrupt"):
        decode_rgb(EncodedImage(path, data[: len(data) // 2]))
    with pytest.raises(UserError, match="cannot read image"):
        SourceDecoder(64)(EncodedImage(path, b"not an image"))


def test_eval_transform_on_files_matches_pils_resize(tmp_path):
    cfg = OmegaConf.create({"img_size": 224, "crop_ratio": 0.875, "mean": [0.485, 0.456, 0.406],
                            "std": [0.229, 0.224, 0.225]})
    fast = build_eval_transform(cfg)
    pil_path = v2.Compose([v2.Resize(256, interpolation=BICUBIC, antialias=True), v2.CenterCrop(224),
                           *to_normalized_tensor(cfg.mean, cfg.std)])
    std = torch.tensor(cfg.std).view(3, 1, 1)
    for w, h, worst in [(500, 375, 1.01), (1200, 900, 4.01)]:  # the large one is reduced by libjpeg first
        path = jpeg(tmp_path / f"{w}.jpg", w, h)
        a, b = fast(read_encoded(path)), pil_path(load_rgb(path))
        levels = ((a - b) * std * 255).abs()
        assert a.shape == (3, 224, 224) and levels.mean() < 0.6 and levels.max() <= worst, (levels.mean(), levels.max())
    tree(tmp_path / "d")
    ds = build_dataset(data_cfg(**cfg, name="imagefolder", root=str(tmp_path / "d")), "train",
                       transform=fast)
    assert ds.encoded and tuple(ds[0][0].shape) == (3, 224, 224)


def dino_cfg(root, *extra):
    return load_config("dino", "resmlp_s12", ["demo=false", "data=imagefolder", f"data.root={root}",
                                              "data.img_size=64", "model.patch_size=8", "data.local_size=32",
                                              "dino.n_local_crops=2", "num_workers=0", *extra])


def test_trainer_batches_carry_whole_images_and_their_sizes(tmp_path):
    cfg = dino_cfg(tree(tmp_path))
    views = build_views(cfg, crop_plan(cfg))
    ds = build_dataset(cfg.data, "train")
    loader, sampler = build_train_loader(ds, views.transform, 6, 0, 0, keyed=True, collate_fn=views.collate)
    sampler.set_epoch(0)
    batch = next(iter(loader))
    assert isinstance(batch, SourceBatch) and ds.encoded
    side = source_side(cfg.data)  # 146 at 64 px
    assert tuple(batch.images.shape[:2]) == (6, 3) and batch.images.shape[2] % 32 == 0
    for i, key in enumerate(batch.keys.tolist()):
        path, _ = ds.samples[key % len(ds)]
        (h, w), (fh, fw) = batch.sizes[i].tolist(), batch.file_sizes[i].tolist()
        assert Image.open(path).size == (fw, fh) and max(h, w) <= side
        assert batch.images[i, :, h:].eq(0).all() and batch.images[i, :, :, w:].eq(0).all()
    crops = views.to_device(batch, torch.device("cpu"))
    assert [tuple(c.shape) for c in crops] == [(6, 3, 64, 64)] * 2 + [(6, 3, 32, 32)] * 2


def test_deferred_jpegs_assemble_the_same_batch(tmp_path):
    """data.decode=gpu's loader side (bytes for plain JPEGs) and its device-side assembly,
    run with torchvision's CPU decoder: the same batch as data.decode=cpu."""
    paths = [jpeg(tmp_path / f"{i}.jpg", w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    paths.append(jpeg(tmp_path / "progressive.jpg", 200, 150, progressive=True))
    items = [(read_encoded(p), 0, i) for i, p in enumerate(paths)]
    eager = collate_sources([(SourceDecoder(512)(x), y, k) for x, y, k in items])
    deferred = collate_sources([(SourceDecoder(512, defer_jpeg=True)(x), y, k) for x, y, k in items])
    assert deferred.jpeg_slots == [0, 1, 5] and len(deferred.images) == 4  # large/elongated/progressive: CPU
    assert torch.equal(deferred.sizes, eager.sizes) and torch.equal(deferred.file_sizes, eager.file_sizes)
    assert torch.equal(deferred.decode_on(torch.device("cpu")), eager.decode_on(torch.device("cpu")))


def test_decode_gpu_needs_cuda_the_device_path_and_image_files(tmp_path, capsys):
    cfg = dino_cfg(tmp_path, "data.decode=gpu")
    with pytest.raises(UserError, match="CUDA"):
        build_views(cfg, crop_plan(cfg), device=torch.device("cpu"))
    with pytest.raises(UserError, match="dino.augment=device"):
        cfg2 = dino_cfg(tmp_path, "data.decode=gpu", "dino.augment=workers")
        build_views(cfg2, crop_plan(cfg2), device=torch.device("cuda"))
    # an in-memory set (Fashion-MNIST, CIFAR, STL-10) has no files: data.decode=gpu would defer nothing
    out = tmp_path / "run"
    assert main(["dino", "resmlp_s12", "demo=false", "data=cifar10", "data.decode=gpu", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data=cifar10 holds its images decoded in memory" in err[0], err
    assert "use data.decode=cpu" in err[0] and not out.exists()


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # the trainer pins for CUDA
def test_the_trainers_loader_hands_plain_jpegs_to_the_device_as_bytes(tmp_path):
    """data.decode=gpu through the loader the trainer builds (ssl/train.py build_data, one loader
    worker): the baseline colour JPEGs the workers would decode at their own size reach the
    device stage as the files' bytes, every other file is decoded in the workers, and the
    batch the device stage assembles (torchvision's CPU decoder standing in for the GPU's) is
    the data.decode=cpu batch."""
    from types import SimpleNamespace

    from resmlp.ssl.step import dino_path
    from resmlp.ssl.train import build_data
    side = 146  # source_side at data.img_size=64
    files = {"a/plain.jpg": (120, 90, {}), "a/tall.jpg": (90, 140, {}), "b/at_side.jpg": (146, 100, {}),
             "b/progressive.jpg": (100, 80, {"progressive": True}), "a/cmyk.jpg": (100, 80, {"mode": "CMYK"}),
             "b/gray.jpg": (100, 80, {"mode": "L"}), "a/image.png": (100, 80, {}),
             "b/large.jpg": (300, 200, {}),  # shrunk to the source side in the workers
             "a/square.jpg": (side, side, {})}  # libjpeg would halve it while decoding (short side >= 2 x 73)
    on_device = {"a/plain.jpg", "a/tall.jpg", "b/at_side.jpg"}
    for name, (w, h, kw) in files.items():
        path = tmp_path / "train" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        img = synthetic_image(w, h, len(name)).convert(kw.pop("mode", "RGB"))
        img.save(path, **({"quality": 90} if path.suffix == ".jpg" else {}), **kw)
    with Image.open(tmp_path / "train" / "b/progressive.jpg") as im:
        assert im.info.get("progressive")  # the file is what its name says
    run = SimpleNamespace(device=torch.device("cuda"), amp_dtype=torch.bfloat16, batch_per_rank=len(files), print=print)
    batches = {}
    for decode in ("gpu", "cpu"):
        cfg = dino_cfg(tmp_path, f"data.decode={decode}", "num_workers=1")
        assert source_side(cfg.data) == side
        _, ds, loader, sampler = build_data(cfg, run, crop_plan(cfg), dino_path(cfg, run.device, False))
        sampler.set_epoch(0)
        batches[decode] = batch = next(iter(loader))
        names = [os.path.relpath(ds.samples[int(k) % len(ds)][0], tmp_path / "train") for k in batch.keys]
        assert sorted(names) == sorted(files)  # every file, in one batch
        deferred = {names[i]: x for i, x in zip(batch.jpeg_slots, batch.jpegs)}
        if decode == "cpu":
            assert not deferred and batch.pixel_slots == list(range(len(files)))
            continue
        assert set(deferred) == on_device, sorted(deferred)  # the rest: decoded on the CPU
        assert {names[i] for i in batch.pixel_slots} == set(files) - on_device
        for name, x in deferred.items():
            assert x.dtype == torch.uint8 and bytes(x.numpy()) == (tmp_path / "train" / name).read_bytes()
    gpu, cpu = batches["gpu"], batches["cpu"]
    assert torch.equal(gpu.keys, cpu.keys) and torch.equal(gpu.sizes, cpu.sizes)
    assert torch.equal(gpu.decode_on(torch.device("cpu")), cpu.decode_on(torch.device("cpu")))


@needs_cuda
def test_gpu_decode_gives_the_cpu_decoders_pixels_and_crops(tmp_path):
    # at data.img_size=64 the source side is 146 px: the four files within it go to the GPU
    # as bytes, the two larger ones are shrunk in the workers (SIZES alone would all be)
    cfg = dino_cfg(tree(tmp_path, [(120, 90), (90, 140), (500, 375), (146, 100), (1400, 300), (64, 48)]),
                   "data.decode=gpu")
    cpu_cfg = dino_cfg(tmp_path, "data.decode=cpu")
    dev = torch.device("cuda")
    ds = build_dataset(cfg.data, "train")
    batches = {}
    for name, c in (("gpu", cfg), ("cpu", cpu_cfg)):
        views = build_views(c, crop_plan(c), device=dev)
        loader, sampler = build_train_loader(ds, views.transform, 6, 0, 0, keyed=True, collate_fn=views.collate)
        sampler.set_epoch(0)
        batch = next(iter(loader))
        batches[name] = (batch, batch.decode_on(dev), views.to_device(batch, dev))
    (gb, gimg, gcrops), (cb, cimg, ccrops) = batches["gpu"], batches["cpu"]
    assert len(gb.jpegs) == 4 and not cb.jpegs
    assert torch.equal(gb.keys, cb.keys) and torch.equal(gb.sizes, cb.sizes) and gimg.shape == cimg.shape
    diff = (gimg.float() - cimg.float()).abs()
    assert diff.mean() < 1.5 and diff.max() <= 64  # two JPEG decoders: rounding, chroma upsampling
    assert all((a - b).abs().mean() < 0.05 for a, b in zip(gcrops, ccrops))


# ---- the preview ----------------------------------------------------------------------------

def test_preview_writes_the_trainers_crops_in_file_pixels(tmp_path, capsys):
    root = tree(tmp_path / "d")
    out = tmp_path / "out"
    args = ["data", "data=imagefolder", f"data.root={root}", "data.img_size=64", "model.patch_size=8",
            "data.local_size=32", "dino.n_local_crops=3", "data.preview=6", f"out={out}"]
    assert main(args) == 0
    assert "crops.png" in capsys.readouterr().out
    info = json.loads((out / "crops.json").read_text())
    assert set(info) == {"images"} and len(info["images"]) == 6
    png = Image.open(out / "crops.png")
    assert png.width > 64 * 5 and png.height > 6 * 64

    # the same crops, boxes and ops as the trainer's data path draws for those images
    cfg = dino_cfg(root, "dino.n_local_crops=3")
    views = build_views(cfg, crop_plan(cfg))
    ds = build_dataset(cfg.data, "train")
    loader, sampler = build_train_loader(ds, views.transform, 6, 0, 0, keyed=True, collate_fn=views.collate)
    sampler.set_epoch(0)
    batch = next(iter(loader))
    crops, drawn = views.draw(batch, torch.device("cpu"))
    mean, std = torch.tensor(cfg.data.mean).view(1, 3, 1, 1), torch.tensor(cfg.data.std).view(1, 3, 1, 1)
    for i, entry in enumerate(info["images"]):
        path, _ = ds.samples[int(batch.keys[i]) % len(ds)]
        assert entry["path"] == path and Image.open(path).size == (entry["width"], entry["height"])
        assert [c["view"] for c in entry["crops"]] == ["global1", "global2", "local1", "local2", "local3"]
        (h, w), W, H = batch.sizes[i].tolist(), entry["width"], entry["height"]
        for v, c in enumerate(entry["crops"]):
            x0, y0, x1, y1 = c["box"]
            assert 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H and c["size"] == (64 if v < 2 else 32)
            d = drawn[v]
            want = [float(d["left"][i]) * W / w, float(d["top"][i]) * H / h,
                    float(d["left"][i] + d["w"][i]) * W / w, float(d["top"][i] + d["h"][i]) * H / h]
            assert np.allclose(c["box"], want, atol=0.5) and c["flip"] == bool(d["flip"][i])
            assert set(c["ops"]) <= {"jitter", "gray", "blur", "solarize"}
            rgb = crops[v][i:i + 1] * std + mean
            channels_equal = bool((rgb[:, 0] - rgb[:, 1]).abs().max() < 1e-4)
            assert channels_equal == ("gray" in c["ops"]), (c, v)
            assert "solarize" not in c["ops"] or v == 1
    # the 3000 x 2000 file was decoded at most 146 px wide: its boxes are in the file's pixels
    huge = next(e for e in info["images"] if e["width"] == 3000)
    assert max(c["box"][2] for c in huge["crops"]) > 1500


def test_preview_errors_are_one_line(tmp_path, capsys):
    root = tree(tmp_path / "d", sizes=[(80, 60)] * 4)
    base = ["data", "data=imagefolder", f"data.root={root}", "data.img_size=64", "model.patch_size=8",
            "data.local_size=32", f"out={tmp_path / 'o'}"]
    assert main([*base, "data.preview=5"]) == 2
    assert main([*base, "data.preview=2", "dino.augment=workers"]) == 2
    err = capsys.readouterr().err
    assert "more images than the 4" in err and "dino.augment=device" in err
