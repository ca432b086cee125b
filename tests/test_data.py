"""resmlp.data: datasets, the RGB rule, errors, subsets, transforms, loaders, `run.sh data`."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from resmlp.core.errors import UserError
from resmlp.data import (ShardSampler, build_dataset, build_eval_transform,
                         build_linear_train_transform, build_loader, build_multicrop_transform,
                         class_names, num_classes, set_epoch, train_split_for_ssl,
                         worker_error_message)
from resmlp.data import fashion_mnist
from resmlp.data.images import to_rgb
from resmlp.data.multicrop import blur_kernel_size
from resmlp.data.subset import balanced_subset_indices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FMNIST_DIR = fashion_mnist.DEBIAN_DIR
HAVE_FMNIST = fashion_mnist.find_idx_dir(FMNIST_DIR) is not None
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason=f"no Fashion-MNIST in {FMNIST_DIR}")


def data_cfg(**kw):
    """The defaults' data section with overrides (a DictConfig, as commands pass it)."""
    base = OmegaConf.load(os.path.join(REPO, "configs", "defaults.yaml")).data
    return OmegaConf.merge(base, {"download": False, **kw})


# --------------------------------------------------------------------------- image trees

def save(path, img, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, **kw)
    return path


def palette_image():
    img = Image.new("P", (12, 10))
    img.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)
    img.paste(1, (0, 0, 6, 10))
    return img


def truncated_jpeg(path):
    rng = np.random.default_rng(0)
    save(path, Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)), quality=95)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    return path


def make_tree(root, train=("cat", "dog"), val=("cat", "dog"), per_class=3):
    """root/train/<c>/ and root/val/<c>/ with small RGB PNGs, a README.txt beside them."""
    for split, classes in (("train", train), ("val", val)):
        for ci, c in enumerate(classes):
            for i in range(per_class):
                save(str(root / split / c / f"{i}.png"), Image.new("RGB", (10 + i, 8), (40 * ci, i, 0)))
            (root / split / c / "README.txt").write_text("not an image")
    (root / "train" / "notes.txt").write_text("ignored")
    return root


# --------------------------------------------------------------------------- the RGB rule

def test_every_mode_becomes_rgb(tmp_path):
    d = tmp_path / "train" / "mixed"
    save(str(d / "rgb.JPG"), Image.new("RGB", (16, 12), (200, 10, 10)))  # upper-case extension
    save(str(d / "gray.png"), Image.new("L", (16, 12), 77))
    save(str(d / "alpha.png"), Image.new("RGBA", (16, 12), (10, 20, 30, 0)))
    save(str(d / "pal.png"), palette_image())
    save(str(d / "pal.gif"), palette_image())
    save(str(d / "cmyk.jpg"), Image.new("CMYK", (16, 12), (0, 0, 0, 0)))
    save(str(d / "deep.png"), Image.fromarray(np.full((6, 5), 32896, dtype=np.uint16)))
    save(str(d / "sub" / "nested.bmp"), Image.new("RGB", (4, 4)))
    (d / "README.txt").write_text("not an image")
    (d / "data.csv").write_text("1,2")
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "mixed").symlink_to(d, target_is_directory=True)
    ds = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")
    names = sorted(os.path.basename(p) for p, _ in ds.samples)
    assert names == ["alpha.png", "cmyk.jpg", "deep.png", "gray.png", "nested.bmp",
                     "pal.gif", "pal.png", "rgb.JPG"]
    for i in range(len(ds)):
        img, label = ds[i]
        assert img.mode == "RGB" and label == 0
    by_name = {os.path.basename(p): i for i, (p, _) in enumerate(ds.samples)}
    assert ds[by_name["gray.png"]][0].getpixel((0, 0)) == (77, 77, 77)
    assert ds[by_name["deep.png"]][0].getpixel((0, 0)) == (128, 128, 128)  # 16-bit scaled by 1/257
    assert ds[by_name["pal.png"]][0].getpixel((0, 0)) == (0, 255, 0)
    assert ds[by_name["cmyk.jpg"]][0].getpixel((0, 0)) == (255, 255, 255)
    assert ds.classes == ["mixed"] and list(ds.targets) == [0] * 8
    assert str(tmp_path / "train") in ds.source


def test_to_rgb_float_and_32bit():
    assert to_rgb(Image.fromarray(np.full((2, 2), 0.5, dtype=np.float32))).getpixel((0, 0)) == (128,) * 3
    assert to_rgb(Image.fromarray(np.full((2, 2), 65535, dtype=np.int32))).getpixel((0, 0)) == (255,) * 3
    rgb = Image.new("RGB", (2, 2))
    assert to_rgb(rgb) is rgb


# --------------------------------------------------------------------------- folder errors

def test_imagefolder_root_errors(tmp_path):
    with pytest.raises(UserError, match="data.root is not set"):
        build_dataset(data_cfg(name="imagefolder"), "train")
    with pytest.raises(UserError, match="does not exist"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path / "nope")), "train")
    with pytest.raises(UserError, match="has no train/ folder"):
        build_dataset(data_cfg(name="imagenet", root=str(tmp_path)), "train")
    (tmp_path / "train").mkdir()
    save(str(tmp_path / "train" / "loose.jpg"), Image.new("RGB", (4, 4)))
    with pytest.raises(UserError, match=r"no class folders \(1 images lie directly"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")


def test_imagefolder_missing_val(tmp_path):
    make_tree(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "val")
    assert len(build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")) == 6
    with pytest.raises(UserError, match="no val/ folder"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "test")


def test_empty_class_folder_is_named(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "train" / "empty_one").mkdir()
    (tmp_path / "train" / "empty_one" / "README.txt").write_text("no images here")
    with pytest.raises(UserError, match="empty class folder .*empty_one"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")


def test_no_images_at_all(tmp_path):
    for c in ("a", "b"):
        (tmp_path / "train" / c).mkdir(parents=True)
        (tmp_path / "train" / c / "README.txt").write_text("x")
    with pytest.raises(UserError, match="no images under"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")


def test_val_class_mismatch_names_them(tmp_path):
    make_tree(tmp_path / "extra", val=("cat", "dog", "zebra"))
    with pytest.raises(UserError, match=r"extra class folders \['zebra'\]"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path / "extra")), "test")
    make_tree(tmp_path / "missing", val=("cat",))
    with pytest.raises(UserError, match=r"missing class folders \['dog'\]"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path / "missing")), "test")
    ok = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path / "extra")), "train")
    assert ok.classes == ["cat", "dog"] and len(ok) == 6


def test_class_counts_and_helpers(tmp_path):
    make_tree(tmp_path, train=("b", "a", "c"), val=("a", "b", "c"), per_class=2)
    cfg = data_cfg(name="imagefolder", root=str(tmp_path))
    assert num_classes(cfg) == 3 and class_names(cfg) == ["a", "b", "c"]
    test = build_dataset(cfg, "test")
    assert len(test) == 6 and sorted(set(test.targets)) == [0, 1, 2]
    assert num_classes(data_cfg(name="cifar100")) == 100
    assert class_names(data_cfg(name="fashion_mnist"))[:2] == ["T-shirt/top", "Trouser"]
    assert [train_split_for_ssl(data_cfg(name=n)) for n in ("stl10", "cifar10", "fashion_mnist")] \
        == ["unlabeled", "train", "train"]
    with pytest.raises(UserError, match="not a dataset"):
        build_dataset(data_cfg(name="mnist3d"), "train")
    with pytest.raises(UserError, match="splits train, test"):
        build_dataset(cfg, "unlabeled")


# --------------------------------------------------------------------------- corrupt files

def test_truncated_jpeg_named_at_load(tmp_path):
    make_tree(tmp_path)
    bad = truncated_jpeg(str(tmp_path / "train" / "dog" / "broken.jpg"))
    ds = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train")
    idx = [p for p, _ in ds.samples].index(bad)
    with pytest.raises(UserError, match="cannot read image .*broken.jpg") as err:
        ds[idx]
    assert "\n" not in str(err.value) and "skip_corrupt" in str(err.value)
    with pytest.raises(UserError, match=r"1 unreadable image\(s\).*broken.jpg"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path), check=True), "train")


def test_skip_corrupt_counts(tmp_path, capsys):
    make_tree(tmp_path)
    truncated_jpeg(str(tmp_path / "train" / "dog" / "broken.jpg"))
    (tmp_path / "train" / "cat" / "garbage.png").write_bytes(b"not a png at all")
    ds = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path), skip_corrupt=True), "train")
    assert len(ds) == 6 and len(ds.unreadable) == 2
    assert "skipped 2 unreadable image(s)" in capsys.readouterr().out
    assert all(ds[i][0].mode == "RGB" for i in range(len(ds)))


def test_worker_error_surfaces_as_one_line(tmp_path):
    make_tree(tmp_path, per_class=1)
    truncated_jpeg(str(tmp_path / "train" / "dog" / "broken.jpg"))
    ds = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train",
                       transform=build_eval_transform(data_cfg(img_size=8, crop_ratio=1.0)))
    loader = build_loader(ds, batch_size=3, train=False, num_workers=1)
    with pytest.raises(UserError) as err:
        list(loader)
    msg = str(err.value)
    assert msg.startswith("cannot read image ") and "broken.jpg" in msg and "\n" not in msg
    wrapped = UserError("Caught UserError in DataLoader worker process 0.\nOriginal Traceback "
                        "(most recent call last):\n  File \"x.py\", line 1\n"
                        "resmlp.core.errors.UserError: cannot read image /a/b.jpg (OSError: x)\n")
    assert worker_error_message(wrapped) == "cannot read image /a/b.jpg (OSError: x)"
    assert worker_error_message(UserError("plain")) == "plain"


# --------------------------------------------------------------------------- subsets

def test_subset_balanced_and_deterministic():
    targets = np.repeat(np.arange(5), [100, 50, 30, 8, 200])
    a = balanced_subset_indices(targets, 103, 5)
    b = balanced_subset_indices(targets, 103, 5)
    assert np.array_equal(a, b) and len(a) == 103 and len(set(a.tolist())) == 103
    counts = np.bincount(targets[a], minlength=5)
    assert counts[3] == 8  # the small class gives all it has, the rest share equally
    assert max(counts[[0, 1, 2, 4]]) - min(counts[[0, 1, 2, 4]]) <= 1
    torch.manual_seed(123)
    np.random.seed(123)  # the global seeds do not matter
    assert np.array_equal(balanced_subset_indices(targets, 103, 5), a)
    with pytest.raises(UserError, match="smaller than the 5 classes"):
        balanced_subset_indices(targets, 4, 5)
    with pytest.raises(UserError, match="larger than the 388 images"):
        balanced_subset_indices(targets, 389, 5)
    unl = balanced_subset_indices(np.full(50, -1), 7, 10)
    assert len(unl) == 7


def test_subset_on_imagefolder_keeps_test_whole(tmp_path):
    make_tree(tmp_path, train=("a", "b", "c"), val=("a", "b", "c"), per_class=4)
    cfg = data_cfg(name="imagefolder", root=str(tmp_path), subset=7)
    train = build_dataset(cfg, "train")
    assert len(train) == 7 and sorted(np.bincount(train.targets).tolist()) == [2, 2, 3]
    assert train.classes == ["a", "b", "c"] and train[0][0].mode == "RGB"
    assert np.array_equal(train.indices, build_dataset(cfg, "train").indices)
    assert len(build_dataset(cfg, "test")) == 12
    with pytest.raises(UserError, match="data.subset=2 is smaller than the 3 classes"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path), subset=2), "train")
    with pytest.raises(UserError, match="larger than the 12 images"):
        build_dataset(data_cfg(name="imagefolder", root=str(tmp_path), subset=13), "train")


# --------------------------------------------------------------------------- transforms

def photo(w=40, h=30, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_multicrop_views():
    cfg = data_cfg(img_size=32)
    t = build_multicrop_transform(cfg, global_size=32, local_size=16, n_local=4)
    crops = t(photo())
    assert len(crops) == 6
    assert [tuple(c.shape) for c in crops] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 4
    assert all(c.dtype == torch.float32 and type(c) is torch.Tensor for c in crops)
    assert not torch.equal(crops[0], crops[1])
    assert crops[0].min() < 0  # normalized, not in [0, 1]
    assert [v.blur_prob for v in t.views] == [1.0, 0.1] + [0.5] * 4
    assert [v.solarize_prob for v in t.views] == [0.0, 0.2] + [0.0] * 4
    assert all(v.jitter == (0.4, 0.4, 0.2, 0.1) and v.jitter_prob == 0.8 and v.gray_prob == 0.2
               for v in t.views)
    assert blur_kernel_size(224) == 23 and blur_kernel_size(96) == 9 and blur_kernel_size(32) == 3

    resized = build_multicrop_transform(cfg, 32, 32, 2)(photo())  # the "resize" strategy's locals
    assert [tuple(c.shape) for c in resized] == [(3, 32, 32)] * 4


def test_eval_and_linear_transforms():
    small = build_eval_transform(data_cfg(img_size=32, crop_ratio=1.0))
    assert tuple(small(Image.new("RGB", (28, 28))).shape) == (3, 32, 32)
    big = build_eval_transform(data_cfg(img_size=224, crop_ratio=0.875))
    assert big.transforms[0].size == [256]
    out = big(photo(300, 200))
    assert tuple(out.shape) == (3, 224, 224) and out.dtype == torch.float32
    white = build_eval_transform(data_cfg(img_size=8, crop_ratio=1.0, mean=[0.5] * 3, std=[0.5] * 3))
    assert torch.allclose(white(Image.new("RGB", (8, 8), (255, 255, 255))), torch.ones(3, 8, 8))
    lin = build_linear_train_transform(data_cfg(img_size=24))
    assert tuple(lin(photo()).shape) == (3, 24, 24)
    with pytest.raises(UserError, match="crop_ratio"):
        build_eval_transform(data_cfg(crop_ratio=1.5))


# --------------------------------------------------------------------------- loaders

class Indices(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i, 0


def order(loader):
    return [int(x) for batch, _ in loader for x in batch]


def test_loader_drop_last_and_eval_order():
    train = build_loader(Indices(10), batch_size=4, train=True, num_workers=0)
    batches = [b for b, _ in train]
    assert len(train) == 2 and [len(b) for b in batches] == [4, 4]
    ev = build_loader(Indices(10), batch_size=4, train=False, num_workers=0)
    assert [len(b) for b, _ in ev] == [4, 4, 2] and order(ev) == list(range(10))
    with pytest.raises(UserError, match="larger than the 10 images"):
        build_loader(Indices(10), batch_size=16, train=True, num_workers=0)


def test_set_epoch_is_deterministic():
    def epoch_order(epoch, seed=0, workers=0):
        loader = build_loader(Indices(50), batch_size=5, train=True, num_workers=workers, seed=seed)
        set_epoch(loader, epoch)
        return order(loader)

    first = build_loader(Indices(50), batch_size=5, train=True, num_workers=0)
    runs = []
    for e in range(3):
        set_epoch(first, e)
        runs.append(order(first))
    assert runs[0] != runs[1] != runs[2]
    assert epoch_order(2) == runs[2]  # a resumed run sees the same order
    assert epoch_order(2, workers=2) == runs[2]
    assert epoch_order(2, seed=1) != runs[2]
    assert sorted(runs[1]) == list(range(50))


def test_shards_without_process_group(monkeypatch):
    from resmlp.data import loader as loader_mod

    blocks = [list(ShardSampler(10, num_replicas=3, rank=r)) for r in range(3)]
    assert blocks == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    train_shards, eval_shards = [], []
    for r in range(2):
        monkeypatch.setattr(loader_mod.dist, "world_size", lambda: 2)
        monkeypatch.setattr(loader_mod.dist, "rank", lambda r=r: r)
        tl = build_loader(Indices(21), batch_size=2, train=True, num_workers=0, seed=5)
        set_epoch(tl, 1)
        train_shards.append(order(tl))
        eval_shards.append(order(build_loader(Indices(21), batch_size=4, train=False, num_workers=0)))
    assert len(train_shards[0]) == len(train_shards[1]) == 10
    assert not set(train_shards[0]) & set(train_shards[1])
    assert eval_shards[0] + eval_shards[1] == list(range(21))  # no padding, rank order = data order


def test_multicrop_batches_with_default_collate(tmp_path):
    make_tree(tmp_path, per_class=4)
    t = build_multicrop_transform(data_cfg(img_size=16), 16, 8, 3)
    ds = build_dataset(data_cfg(name="imagefolder", root=str(tmp_path)), "train", transform=t)
    crops, labels = next(iter(build_loader(ds, batch_size=4, train=True, num_workers=2)))
    assert isinstance(crops, list) and len(crops) == 5
    assert [tuple(c.shape) for c in crops] == [(4, 3, 16, 16)] * 2 + [(4, 3, 8, 8)] * 3
    assert labels.dtype == torch.int64 and labels.shape == (4,)


# --------------------------------------------------------------------------- Fashion-MNIST

@needs_fmnist
def test_fashion_mnist_real_files():
    cfg = data_cfg(name="fashion_mnist")
    train, test = build_dataset(cfg, "train"), build_dataset(cfg, "test")
    assert len(train) == 60000 and len(test) == 10000
    assert train.classes == test.classes and len(train.classes) == 10
    with gzip.open(os.path.join(FMNIST_DIR, "train-labels-idx1-ubyte.gz")) as f:
        first_label = f.read(9)[8]
    img, label = train[0]
    assert label == first_label == int(train.targets[0])
    assert img.mode == "RGB" and img.size == (28, 28)
    assert np.bincount(test.targets).tolist() == [1000] * 10
    assert FMNIST_DIR in train.source


@needs_fmnist
def test_fashion_mnist_root_layouts(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in os.listdir(FMNIST_DIR):
        (raw / name).symlink_to(os.path.join(FMNIST_DIR, name))
    ds = build_dataset(data_cfg(name="fashion_mnist", root=str(tmp_path)), "test")
    assert len(ds) == 10000 and str(raw) in ds.source
    loader = build_loader(build_dataset(data_cfg(name="fashion_mnist", root=FMNIST_DIR, subset=20), "train",
                                        transform=build_eval_transform(data_cfg(img_size=32, crop_ratio=1.0))),
                          batch_size=8, train=True, num_workers=0)
    x, y = next(iter(loader))
    assert x.shape == (8, 3, 32, 32) and len(loader) == 2


@needs_fmnist
def test_fashion_mnist_yaml_mean_std_match_measured():
    cfg = OmegaConf.load(os.path.join(REPO, "configs", "data", "fashion_mnist.yaml"))
    images, _ = fashion_mnist.load_split(fashion_mnist.find_idx_dir(FMNIST_DIR), "train")
    x = images.astype(np.float64) / 255
    assert cfg.data.mean == [round(float(x.mean()), 4)] * 3
    assert cfg.data.std == [round(float(x.std()), 4)] * 3


def test_fashion_mnist_not_found_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv(fashion_mnist.SEARCH_ENV, str(tmp_path / "empty"))
    with pytest.raises(UserError) as err:
        build_dataset(data_cfg(name="fashion_mnist"), "train")
    msg = str(err.value)
    assert "data.root=" in msg and "online" in msg and "apt-get install dataset-fashion-mnist" in msg
    assert "\n" not in msg
    with pytest.raises(UserError, match=r"data.root=.*nowhere holds no Fashion-MNIST"):
        build_dataset(data_cfg(name="fashion_mnist", root=str(tmp_path / "nowhere")), "train")


def test_torchvision_sets_not_found(tmp_path):
    for name, folder in (("cifar10", "cifar-10-batches-py"), ("stl10", "stl10_binary")):
        with pytest.raises(UserError, match=f"not found in .*{folder}.*data.root="):
            build_dataset(data_cfg(name=name, root=str(tmp_path)), "train")


# --------------------------------------------------------------------------- run.sh data, yamls

def test_inspect_lists_unreadable(tmp_path, capsys):
    from resmlp.data.inspect import run

    make_tree(tmp_path)
    bad = truncated_jpeg(str(tmp_path / "val" / "cat" / "broken.jpg"))
    cfg = OmegaConf.create({"data": data_cfg(name="imagefolder", root=str(tmp_path), check=True)})
    with pytest.raises(UserError, match="1 unreadable image"):
        run(cfg)
    out = capsys.readouterr().out
    assert bad in out and "train: 6 images" in out and "test: 7 images" in out
    cfg.data.skip_corrupt = True
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "skip these 1 file(s)" in out and "3 channels (RGB)" in out


@needs_fmnist
def test_inspect_fashion_mnist(capsys):
    from resmlp.data.inspect import run

    cfg = OmegaConf.create({"data": data_cfg(name="fashion_mnist", img_size=32, crop_ratio=1.0)})
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "train: 60000 images" in out and "28x28, 1 channel (gray) -> converted to RGB" in out
    assert "Ankle boot" in out


@pytest.mark.parametrize("name", ["fashion_mnist", "imagefolder", "imagenet", "cifar10", "cifar100", "stl10"])
def test_data_yamls(name):
    y = OmegaConf.load(os.path.join(REPO, "configs", "data", f"{name}.yaml"))
    # no file reaches into a method's section (its CPU demo's sizes are configs/recipe/demo/data/'s)
    assert set(y) <= {"data", "model"} and y.data.name == name
    assert set(y.get("model", {})) <= {"patch_size"}
    assert y.data.img_size % y.model.patch_size == 0 and y.data.local_size % y.model.patch_size == 0
    merged = OmegaConf.merge(OmegaConf.load(os.path.join(REPO, "configs", "defaults.yaml")), y)
    assert tuple(build_eval_transform(merged.data)(photo(50, 40)).shape) == (3, y.data.img_size, y.data.img_size)
