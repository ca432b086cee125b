"""Evaluation package (k-NN itself: test_knn.py): feature cache, checkpoint loading, linear probe, figures."""
from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from resmlp.core.errors import UserError
from resmlp.models import load as ck
from resmlp.eval import features as fe
from resmlp.eval.knn_search import knn_search
from resmlp.eval.linear import train_linear_on_features

FMNIST = "/usr/share/datasets/fashion-mnist"
TINY = dict(img_size=32, patch_size=4, dim=32, depth=2)


# --------------------------------------------------------------------------- checkpoints

def tiny_model(seed=0, num_classes=0, **over):
    from resmlp.models import create_model
    torch.manual_seed(seed)
    m = create_model("resmlp_s12", **{**TINY, **over}, num_classes=num_classes)
    with torch.no_grad():   # make LayerScale / Aff non-trivial so every weight matters
        for name, p in m.named_parameters():
            if name.endswith(("ls1", "ls2", "alpha", "beta")) or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def dino_checkpoint(model, student=None):
    sd = {"backbone." + k: v for k, v in model.state_dict().items()}
    sd["head.mlp.0.weight"] = torch.randn(16, 32)
    sd["head.last_layer.weight_g"] = torch.ones(1, 8)
    st = student if student is not None else sd
    cfg = {"model": {"name": "resmlp_s12", **TINY, "drop_path_rate": 0.1},
           "data": {"name": "fashion_mnist", "img_size": 32}}
    return {"format": "resmlp-ssl", "command": "dino", "config": cfg, "teacher": sd, "student": st,
            "epoch": 3, "iteration": 10}


def to_official_keys(sd):
    out = {}
    for k, v in sd.items():
        k = k.replace(".cross_patch.", ".attn.").replace(".ls1", ".gamma_1").replace(".ls2", ".gamma_2")
        out[k] = v
    return out


def test_every_checkpoint_format_gives_the_same_features(tmp_path):
    model = tiny_model()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
    student_model = tiny_model(seed=1)
    student = {"backbone." + k: v for k, v in student_model.state_dict().items()}
    clf = tiny_model(num_classes=10)
    clf.load_state_dict(model.state_dict(), strict=False)   # same backbone, a 10-class head

    files = {
        "dino": dino_checkpoint(model, student),
        "supervised": {"format": "resmlp-ssl", "command": "supervised",
                       "config": {"model": {"name": "resmlp_s12", **TINY}}, "model": clf.state_dict()},
        "dino_official": {"teacher": {"module." + k: v for k, v in dino_checkpoint(model)["teacher"].items()},
                          "student": {"module." + k: v for k, v in student.items()}, "epoch": 5},
        "official_wrapped": {"model": to_official_keys(clf.state_dict())},
        "bare": model.state_dict(),
    }
    hashes = set()
    for name, obj in files.items():
        path = tmp_path / f"{name}.pth"
        torch.save(obj, path)
        bb, info = ck.load_backbone(path)
        assert not bb.training and info["is_resmlp"], name
        assert info["arch"]["dim"] == 32 and info["arch"]["depth"] == 2 and info["arch"]["img_size"] == 32
        with torch.no_grad():
            torch.testing.assert_close(bb(x), ref, rtol=1e-5, atol=1e-6, msg=name)
        hashes.add(info["weights_hash"])
    assert len(hashes) == 1                                  # same weights, same cache key
    assert ck.load_backbone(tmp_path / "supervised.pth")[1]["head_num_classes"] == 10
    # the student network of both DINO layouts
    for name in ("dino", "dino_official"):
        bb, info = ck.load_backbone(tmp_path / f"{name}.pth", key="student")
        assert info["key"] == "student"
        with torch.no_grad():
            torch.testing.assert_close(bb(x), student_model(x))
    # a run directory
    run = tmp_path / "run"
    run.mkdir()
    torch.save(files["dino"], run / "checkpoint.pth")
    bb, info = ck.load_backbone(run)
    assert info["run_dir"] == str(run) and info["source"] == "dino" and info["epoch"] == 3
    with torch.no_grad():
        torch.testing.assert_close(bb(x), ref)
    # the backbone's weights load into a classifier for fine-tuning (head only missing)
    from resmlp.models import create_model
    fresh = create_model(info["model"], **info["arch"], num_classes=7)
    missing, unexpected = fresh.load_state_dict(bb.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["head.bias", "head.weight"]
    # a trained classifier, head and all (what distillation uses as its teacher)
    teacher, name = ck.load_classifier(tmp_path / "supervised.pth")
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), clf(x))


def test_timm_state_dict_and_timm_models(tmp_path):
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    torch.manual_seed(0)
    timm_model = MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=2, embed_dim=32, mlp_ratio=4,
                          block_layer=partial(ResBlock, init_values=0.1), norm_layer=Affine).eval()
    torch.save(timm_model.state_dict(), tmp_path / "timm.pth")
    bb, info = ck.load_backbone(tmp_path / "timm.pth")
    assert info["head_num_classes"] == 10 and info["arch"]["patch_size"] == 4
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expect = timm_model.forward_head(timm_model.forward_features(x), pre_logits=True)
        torch.testing.assert_close(bb(x), expect, rtol=1e-5, atol=1e-6)
    # timm:<name>?random: timm's own model, random but reproducible weights, built for the data size
    m1, i1 = ck.load_backbone("timm:resmlp_12_224?random", img_size=32)
    m2, i2 = ck.load_backbone("timm:resmlp_12_224", pretrained=False, img_size=32)
    assert i1["source"] == "timm" and not i1["is_resmlp"] and i1["weights_hash"] == i2["weights_hash"]
    with torch.no_grad():
        assert m1(x).shape == (2, 384)
    with pytest.raises(UserError, match="timm has no model"):
        ck.load_backbone("timm:no_such_model?random")
    # a project checkpoint of a timm architecture (the supervised command trains any)
    import timm
    rn = timm.create_model("resnet18", num_classes=4).eval()
    torch.save({"format": "resmlp-ssl", "command": "supervised", "model": rn.state_dict(),
                "config": {"model": {"name": "resnet18", "img_size": 32}}}, tmp_path / "rn.pth")
    bb, info = ck.load_backbone(tmp_path / "rn.pth")
    assert not info["is_resmlp"] and info["head_num_classes"] == 4
    with torch.no_grad():
        torch.testing.assert_close(bb(x), rn.forward_head(rn.forward_features(x), pre_logits=True))


def test_bad_checkpoints_raise_one_line_user_errors(tmp_path):
    model = tiny_model()
    obj = dino_checkpoint(model)
    del obj["teacher"]["backbone.blocks.1.mlp.fc2.weight"]
    obj["teacher"]["backbone.blocks.1.extra.weight"] = torch.zeros(3)
    torch.save(obj, tmp_path / "bad.pth")
    with pytest.raises(UserError) as e:
        ck.load_backbone(tmp_path / "bad.pth")
    msg = str(e.value)
    assert "missing" in msg and "blocks.1.mlp.fc2.weight" in msg
    assert "unexpected" in msg and "blocks.1.extra.weight" in msg
    (tmp_path / "notes.txt").write_text("hello, not a checkpoint\n")
    torch.save({"foo": 1, "bar": "x"}, tmp_path / "nothing.pth")
    torch.save({"model": {"fc.weight": torch.zeros(2, 2)}}, tmp_path / "notresmlp.pth")
    for spec in (tmp_path / "missing.pth", tmp_path / "notes.txt", tmp_path / "nothing.pth",
                 tmp_path / "notresmlp.pth", tmp_path):
        with pytest.raises(UserError) as e:
            ck.load_backbone(spec)
        assert "\n" not in str(e.value) and str(e.value)
    with pytest.raises(UserError, match="student"):
        torch.save({"format": "resmlp-ssl", "teacher": obj["teacher"]}, tmp_path / "t.pth")
        ck.load_backbone(tmp_path / "t.pth", key="student")


# --------------------------------------------------------------------------- feature cache

class FakeImages(torch.utils.data.Dataset):
    classes = ["a", "b", "c"]

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.targets = torch.randint(0, 3, (n,), generator=g).tolist()

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.x[i], self.targets[i]


def test_feature_cache_reuse_and_keys(tmp_path, monkeypatch):
    import resmlp.data as rdata
    from omegaconf import OmegaConf
    monkeypatch.setattr(rdata, "build_dataset", lambda cfg, split, transform=None:
                        FakeImages(40 if split == "train" else 24, seed=len(split)))
    data_cfg = OmegaConf.create({"name": "fake", "root": None, "subset": None, "img_size": 32,
                                 "crop_ratio": 1.0, "mean": [0.5] * 3, "std": [0.25] * 3})
    model = tiny_model()
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda x: calls.append(len(x)) or forward(x))
    info = {"weights_hash": ck.weights_hash(model), "run_dir": str(tmp_path / "run")}
    lines = []
    kw = dict(batch_size=16, transform="eval-v1", log=lines.append)

    first = fe.features_for(model, info, data_cfg, "train", **kw)
    assert sum(calls) == 40 and not first["cached"] and first["features"].shape == (40, 32)
    assert Path(first["cache"]).parent == tmp_path / "run" / "features"   # default: the run dir
    second = fe.features_for(model, info, data_cfg, "train", **kw)
    assert sum(calls) == 40 and second["cached"]                          # no forward at all
    assert any(line.startswith("features: loaded from cache") for line in lines)
    assert torch.equal(first["features"], second["features"]) and torch.equal(first["labels"], second["labels"])
    with torch.no_grad():
        torch.testing.assert_close(first["features"][:5], model(FakeImages(40, 5).x[:5]))

    paths = {first["cache"]}
    variants = [dict(split="test"), dict(transform="eval-v2"), dict(n_last_blocks=2),
                dict(info={**info, "weights_hash": "0" * 16}),
                dict(data_cfg=OmegaConf.merge(data_cfg, {"subset": 10}))]
    for v in variants:
        args = {"info": info, "data_cfg": data_cfg, "split": "train", **kw, **v}
        out = fe.features_for(model, args.pop("info"), args.pop("data_cfg"), args.pop("split"), **args)
        assert not out["cached"], v
        paths.add(out["cache"])
    assert len(paths) == 1 + len(variants)
    two = fe.features_for(model, info, data_cfg, "test", **{**kw, "n_last_blocks": 2})
    assert two["features"].shape == (24, 64)
    # cache off: extracts again, writes nothing
    n = sum(calls)
    off = fe.features_for(model, info, data_cfg, "train", use_cache=False, **kw)
    assert sum(calls) == n + 40 and off["cache"] is None


# --------------------------------------------------------------------------- linear probe

def test_linear_probe_on_separable_features_picks_best_lr():
    g = torch.Generator().manual_seed(0)
    centers = 4.0 * torch.randn(5, 16, generator=g)
    ytr, yte = torch.randint(0, 5, (1000,), generator=g), torch.randint(0, 5, (300,), generator=g)
    xtr = centers[ytr] + torch.randn(1000, 16, generator=g)
    xte = centers[yte] + torch.randn(300, 16, generator=g)
    res = train_linear_on_features(xtr, ytr, xte, yte, 5, lrs=[1e-7, 1e-3, 0.1], epochs=5, batch_size=64)
    per = {r["lr"]: r["top1"] for r in res["per_lr"]}
    assert res["top1"] >= 95.0 and res["top1"] == max(per.values())
    assert per[res["lr"]] == res["top1"] and per[1e-7] < res["top1"]
    assert res["lr_effective"] == pytest.approx(res["lr"] * 64 / 256)
    with pytest.raises(UserError):
        train_linear_on_features(xtr, ytr, xte, yte, 5, lrs=[-1.0], epochs=1)


# --------------------------------------------------------------------------- commands

def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


@pytest.fixture(scope="module")
def mini_fmnist(tmp_path_factory):
    """A small Fashion-MNIST folder cut from the real files (fast, same code paths)."""
    if not os.path.isdir(FMNIST):
        pytest.skip("Fashion-MNIST files are not installed")
    from resmlp.data.fashion_mnist import FILES, _file, read_idx
    root = tmp_path_factory.mktemp("fmnist")
    for split, n in (("train", 600), ("test", 200)):
        for stem in FILES[split]:
            write_idx(root / stem, read_idx(_file(FMNIST, stem))[:n])
    return root


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "dino_tiny"
    run.mkdir()
    torch.save(dino_checkpoint(tiny_model()), run / "checkpoint.pth")
    lines = [{"epoch": 0, "iteration": i, "loss": 5.0 - 0.1 * i, "lr": 1e-4 * i} for i in range(1, 6)]
    lines += [{"epoch": 0, "knn_top1": 41.0}, {"epoch": 1, "iteration": 7, "loss": 4.0}, {"epoch": 1}]
    (run / "log.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n")
    return run


def cli(*args):
    from resmlp.core.cli import main
    return main([str(a) for a in args])


def test_linear_and_knn_commands_end_to_end(mini_fmnist, run_dir, tmp_path, capsys):
    common = [f"data.root={mini_fmnist}", "num_workers=0", "device=cpu"]
    assert cli("linear", run_dir, *common, "linear.l2=[1e-3,1e-1]", f"out={tmp_path}/lin") == 0
    res = json.loads((tmp_path / "lin" / "linear.json").read_text())
    assert res["protocol"] == "lbfgs" and res["mode"] == "cached" and res["n_train"] == 600 and res["n_test"] == 200
    assert 0 <= res["top1"] <= res["top5"] <= 100 and [r["l2"] for r in res["per_l2"]] == [1e-3, 1e-1]
    assert res["l2"] in (1e-3, 1e-1) and res["n_holdout"] == 120 and res["holdout"] == 0.2
    assert sorted(p.name.split("-")[0] for p in (run_dir / "features").glob("*.pt")) == ["test", "train"]
    assert "linear top1=" in capsys.readouterr().out.splitlines()[-2]    # then "wrote ..."
    assert cli("linear", run_dir, *common, "linear.protocol=dino", "linear.epochs=3", f"out={tmp_path}/dino") == 0
    res = json.loads((tmp_path / "dino" / "linear.json").read_text())
    assert res["protocol"] == "dino" and res["epochs"] == 3 and len(res["per_lr"]) == 9
    assert res["top1"] == max(r["top1"] for r in res["per_lr"])
    assert "chosen on the test split" in capsys.readouterr().out

    assert cli("knn", run_dir, *common, "k=5,10", "T=0.1") == 0
    out = capsys.readouterr().out
    assert "features: loaded from cache" in out                     # the linear run's features
    assert "DINO protocol: cosine, T=0.1" in out and "200 queries / 600 train" in out
    knn = json.loads((run_dir / "knn.json").read_text())            # beside the checkpoint
    assert set(knn["results"]) == {"5", "10"} and knn["protocol"]["temperature"] == 0.1
    assert 10 < knn["results"]["10"]["top1"] <= 100                 # well above chance (10%)

    # the DINO trainer's online k-NN: same features, same numbers, no cache
    from resmlp.core.config import load_config
    from resmlp.eval.knn import online_knn
    cfg = load_config("knn", None, [f"data.root={mini_fmnist}"])
    online = online_knn(ck.load_backbone(run_dir)[0], cfg.data, "cpu", ks=[5, 10], temperature=0.1)
    assert online["knn_k"] == 10 and online["n_train"] == 600
    assert online["knn_top1"] == pytest.approx(knn["results"]["10"]["top1"])

    assert cli("linear", run_dir, *common, "linear.mode=augmented", "linear.epochs=1",
               "linear.batch_size=128", f"out={tmp_path}/aug") == 0
    aug = json.loads((tmp_path / "aug" / "linear.json").read_text())
    assert aug["mode"] == "augmented" and aug["protocol"] == "dino" and aug["lr"] == 0.001
    assert aug["lr_effective"] == 0.0005

    for bad in (["k=0"], ["k=601"], ["T=0"], ["key=middle"]):
        assert cli("knn", run_dir, *common, *bad) == 2, bad
    assert cli("knn", run_dir / "nope", *common) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 5 and "k=601 is larger than the train set" in err


def test_few_label_knn_and_linear_commands(mini_fmnist, run_dir, tmp_path, capsys):
    """few_labels= and tries= (knn.* / linear.*) on the cached features: the tables and the
    JSON hold mean and std per n (and k); a clipped k is said once; refused before work
    where the mode cannot take them."""
    common = [f"data.root={mini_fmnist}", "num_workers=0", "device=cpu", f"features.cache_dir={tmp_path}/cache"]
    assert cli("knn", run_dir, *common, "k=5,20", "few_labels=[1,5]", "tries=3", f"out={tmp_path}/k") == 0
    out = capsys.readouterr().out
    assert "k-NN with few labels" in out and "±" in out
    assert out.count("n=1: k=20 clipped to the bank's 10 images") == 1     # once, not once per try
    knn = json.loads((tmp_path / "k" / "knn.json").read_text())
    assert set(knn["results"]) == {"5", "20"}                              # the whole bank, as without the keys
    few = knn["few_labels"]
    assert few["per_class"] == [1, 5] and few["tries"] == 3 and few["results"]["5"]["bank"] == 50
    cell = few["results"]["1"]["k"]["20"]
    assert cell["k_used"] == 10 and len(cell["tries"]) == 3 and {"top1", "top1_std", "top5", "top5_std"} <= set(cell)
    assert 0 <= cell["top1"] <= 100 and cell["top1_std"] >= 0

    assert cli("linear", run_dir, *common, "linear.protocol=dino", "linear.epochs=2", "linear.lrs=[0.01,0.1]",
               "few_labels=[2]", "tries=2", f"out={tmp_path}/l") == 0   # the same two short keys as knn's
    out = capsys.readouterr().out
    assert "features: loaded from cache" in out and "linear probe with few labels" in out
    lin = json.loads((tmp_path / "l" / "linear.json").read_text())["few_labels"]
    r = lin["results"]["2"]
    assert r["bank"] == 20 and r["batch_size"] == 20 and len(r["tries"]) == 2 and {"top1_std", "top5_std"} <= set(r)
    assert all(t["lr"] in (0.01, 0.1) for t in r["tries"])
    assert cli("linear", run_dir, *common, "linear.l2=[0.01,1]", "few_labels=[2]", "tries=2", f"out={tmp_path}/lb") == 0
    assert "held-out training images outside the picks" in capsys.readouterr().out
    lin = json.loads((tmp_path / "lb" / "linear.json").read_text())["few_labels"]
    assert lin["protocol"] == "lbfgs" and all(t["l2"] in (0.01, 1) for t in lin["results"]["2"]["tries"])

    for bad in (["linear.mode=augmented", "linear.few_labels=[2]"], ["linear.few_labels=[0]"],
                ["linear.tries=0"], ["linear.few_labels=[1.5]"]):
        assert cli("linear", run_dir, *common, *bad, f"out={tmp_path}/bad") == 2, bad
    for bad in (["knn.few_labels=[0,5]"], ["knn.tries=0"], ["knn.few_labels=abc"], ["T=1e-320"]):
        assert cli("knn", run_dir, *common, *bad, f"out={tmp_path}/bad") == 2, bad
    err = capsys.readouterr().err
    assert err.count("error:") == 8 and "use linear.mode=cached" in err and not (tmp_path / "bad").exists()


def test_knn_refuses_val_classes_unlike_train_before_extracting(tmp_path, capsys):
    """An image folder whose val/ lacks a class of train/ (or has another): one line, exit
    2, before any feature is extracted or cached."""
    from kit import make_jpeg_folder
    make_jpeg_folder(str(tmp_path / "data"), 12, 32, 40, classes=3)
    os.rename(tmp_path / "data" / "val" / "c02", tmp_path / "data" / "val" / "other")
    run = tmp_path / "run"
    run.mkdir()
    torch.save(dino_checkpoint(tiny_model()), run / "checkpoint.pth")
    common = ["data=imagefolder", f"data.root={tmp_path / 'data'}", "data.img_size=32", "num_workers=0",
              "device=cpu", f"features.cache_dir={tmp_path}/cache"]
    assert cli("knn", run, *common) == 2
    assert cli("linear", run, *common) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "Traceback" not in err
    assert "extra class folders ['other'] not in train/; missing class folders ['c02']" in err
    assert not (tmp_path / "cache").exists() and not (run / "features").exists()


def test_viz_figures(run_dir, tmp_path):
    assert cli("viz", run_dir, "viz.figures=[cross_patch,sparsity,curves]") == 0
    # a run without results.json is still training: its figures are marked with the epoch
    [out] = [p.parent for p in (run_dir / "viz").rglob("viz.json")]
    assert out.parent == run_dir / "viz" / "epoch3" and out.name.startswith("fashion_mnist-")
    for name in ("cross_patch.png", "sparsity.png", "curves.png", "viz.json"):
        assert (out / name).stat().st_size > 1000 or name == "viz.json", name
    v = json.loads((out / "viz.json").read_text())
    assert v["cross_patch"]["central"] == 4 and v["cross_patch"]["grid"] == [8, 8]
    for key in ("A", "mlp", "fc1", "fc2"):
        assert len(v["sparsity"][key]) == 2 and all(0 <= s <= 1 for s in v["sparsity"][key])
    assert v["curves"]["loss"]["points"] == 6 and v["curves"]["knn_top1"]["last"] == 41.0
    assert v["curves"]["unreadable_lines"] == 1
    # a random init is far from sparse: about 5% of a N(0, s) matrix is below 5% of its max
    assert all(s < 0.3 for s in v["sparsity"]["A"])

    from resmlp.eval.viz import make_figures, sparsity
    conv = tiny_model(cross_patch="conv3x3")
    info = {"spec": "conv", "model": "resmlp_s12", "source": "test"}
    with pytest.raises(UserError, match="cross_patch=conv3x3"):
        make_figures(conv, info, tmp_path / "conv", log=None)
    r = make_figures(conv, info, tmp_path / "conv", figures=["sparsity"], log=None)
    assert r["sparsity"]["A"] == [None, None] and (tmp_path / "conv" / "sparsity.png").exists()
    # a matrix with 3 of 4 entries tiny is 75% sparse
    model = tiny_model()
    with torch.no_grad():
        model.blocks[0].cross_patch.weight.copy_(torch.tensor([[1.0, 0.01], [0.0, -0.04]]).repeat(32, 32))
    assert sparsity(model)["A"][0] == pytest.approx(0.75)
    assert cli("viz", run_dir, "viz.central=9") == 2


def test_online_knn_keeps_the_eval_images_between_calls(tmp_path, monkeypatch):
    """With a cache, the second call builds no dataset and gives the same result."""
    import resmlp.data as rdata
    from kit import make_jpeg_folder
    from resmlp.core.config import load_config
    from resmlp.eval.knn import online_knn
    make_jpeg_folder(str(tmp_path), 40, 24, 40, classes=4)
    cfg = load_config("knn", "resmlp_s12", ["data=imagefolder", f"data.root={tmp_path}", "data.img_size=16"])
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten())
    built = []
    real = rdata.build_dataset
    monkeypatch.setattr(rdata, "build_dataset", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    cache = {}
    first = online_knn(model, cfg.data, "cpu", ks=(3,), batch_size=16, cache=cache)
    assert len(built) == 2 and all(isinstance(cache[s], list) for s in ("train", "test"))
    again = online_knn(model, cfg.data, "cpu", ks=(3,), batch_size=16, cache=cache)
    assert len(built) == 2 and again == first
    assert online_knn(model, cfg.data, "cpu", ks=(3,), batch_size=16) == first and len(built) == 4


# --------------------------------------------------------------------------- feature figures

def test_patch_pca_has_the_grid_and_orthonormal_components():
    from resmlp.eval.patch_pca import patch_pca, patch_tokens
    model = tiny_model()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens, grid, _ = patch_tokens(model, x)
    with torch.no_grad():   # the tokens before pooling: their mean is the pooled feature
        torch.testing.assert_close(tokens.mean(1), model(x), rtol=1e-5, atol=1e-6)
    res = patch_pca(model, x)
    assert grid == res["grid"] == (8, 8) and res["rgb"].shape == (3, 8, 8, 3) and res["mask"].shape == (3, 8, 8)
    v = res["components"]
    torch.testing.assert_close(v @ v.T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-10)
    r = res["explained_variance_ratio"]
    assert (r[:-1] >= r[1:]).all() and 0 < float(r.sum()) <= 1
    assert res["rgb"].min() == 0 and res["rgb"].max() == 1 and 0 < res["mask"].mean() < 1
    # another size: the built 8x8 grid adapted to 12x12 for the call, then restored
    res = patch_pca(model, torch.randn(2, 3, 48, 48))
    assert res["grid"] == (12, 12) and res["grid_adapt"] == "interpolate" and model.grid_adapt == "none"
    assert res["rgb"].shape == (2, 12, 12, 3)
    # timm: a ResMLP (its stem's grid), a ViT (class token dropped), a convnet (its feature map)
    import timm
    for name, size, want in (("resmlp_12_224", 64, (4, 4)), ("vit_tiny_patch16_224", 64, (4, 4)),
                             ("resnet18", 128, (4, 4))):
        m = timm.create_model(name, num_classes=0, **({} if name == "resnet18" else {"img_size": size})).eval()
        res = patch_pca(m, torch.randn(2, 3, size, size))
        assert res["grid"] == want and res["rgb"].shape == (2, *want, 3), name
    with pytest.raises(UserError, match="cannot take 30x30"):
        patch_pca(model, torch.randn(1, 3, 30, 30))


def _ink(png: Path) -> float:
    """Standard deviation of a PNG's pixels: 0 for a blank picture."""
    import matplotlib.image
    return float(matplotlib.image.imread(png)[..., :3].std())


def test_viz_neighbours_and_patch_map(mini_fmnist, run_dir, tmp_path, capsys):
    common = [f"data.root={mini_fmnist}", "num_workers=0", "device=cpu"]
    out = tmp_path / "v"
    assert cli("viz", run_dir, *common, "k=3", "viz.figures=[neighbours,patch_pca]", f"out={out}") == 0
    for name in ("neighbours.png", "patch_pca.png"):
        assert _ink(out / name) > 0.05, name
    v = json.loads((out / "viz.json").read_text())
    nb = v["neighbours"]
    assert nb["k"] == 3 and len(nb["queries"]) == 8 and len(set(nb["query_labels"])) == 8
    # the k-NN command's features (its cache), searched by the evaluator: the same neighbours
    train = torch.load(nb["train_cache"], weights_only=True)
    test = torch.load(nb["test_cache"], weights_only=True)
    sims, idx = knn_search(train["features"], test["features"], 3)
    assert nb["indices"] == idx[nb["queries"]].tolist()
    assert nb["labels"] == train["labels"][idx[nb["queries"]]].tolist()
    pca = v["patch_pca"]
    assert pca["grid"] == [8, 8] and pca["img_size"] == 32 and set(pca["images"]) <= set(nb["queries"])

    # a supervised checkpoint, its patch map at a larger size (a finer grid through the grid
    # adaptation), and a timm checkpoint (timm's own models: test_patch_pca_...)
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    torch.manual_seed(0)
    torch.save(MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=2, embed_dim=32, mlp_ratio=4,
                        block_layer=partial(ResBlock, init_values=0.1), norm_layer=Affine).state_dict(),
               tmp_path / "timm.pth")
    clf = tiny_model(num_classes=10)
    torch.save({"format": "resmlp-ssl", "command": "supervised", "config": {"model": {"name": "resmlp_s12", **TINY}},
                "model": clf.state_dict()}, tmp_path / "sup.pth")
    fast = [*common, "features.cache=false", "viz.figures=[neighbours,patch_pca]", "viz.dpi=50"]
    assert cli("viz", tmp_path / "sup.pth", *fast, "viz.pca_size=64", f"out={tmp_path}/sup") == 0
    pca = json.loads((tmp_path / "sup" / "viz.json").read_text())["patch_pca"]
    assert pca["grid"] == [16, 16] and pca["grid_adapt"] == "interpolate" and pca["img_size"] == 64
    assert cli("viz", tmp_path / "timm.pth", *fast, "viz.queries=4", f"out={tmp_path}/timm") == 0
    v = json.loads((tmp_path / "timm" / "viz.json").read_text())
    assert v["patch_pca"]["grid"] == [8, 8] and len(v["neighbours"]["queries"]) == 4
    for run in ("sup", "timm"):
        assert all(_ink(tmp_path / run / f"{n}.png") > 0.05 for n in ("neighbours", "patch_pca")), run

    for bad in (["k=0"], ["k=3,5"], ["viz.queries=0"], ["viz.pca_size=-3"], ["viz.pca_threshold=1"],
                ["viz.figures=[nope]"]):
        assert cli("viz", run_dir, *common, *bad, f"out={tmp_path}/bad") == 2, bad
    assert not (tmp_path / "bad").exists()
    assert capsys.readouterr().err.count("error:") == 6
