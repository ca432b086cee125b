"""data=folder (images without labels), eval.data / eval.root (a DINO run judged on a labeled
set), the evaluators on unlabeled sets, and viz's map of the features (embedding.png), on
folders the tests write."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.data import build_dataset
from resmlp.data import folder as folder_mod
from resmlp.data.folder import HIDDEN, LOOP, NOT_IMAGE, TWICE, FileLists, scan_folder

from test_data import data_cfg

REPO = Path(__file__).resolve().parent.parent
# A tiny DINO at 16 px (4x4 patches of 4 px, local crops of 8 px).
TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.img_size=16", "model.patch_size=4",
        "data.local_size=8", "batch_size=8", "epochs=1", "dino.out_dim=32", "dino.hidden_dim=16",
        "dino.bottleneck_dim=8", "dino.n_local_crops=2", "optim.warmup_epochs=0", "num_workers=0",
        "eval_every=0", "log_every=1", "dino.final_linear=false", "model.drop_path_rate=0.0",
        "dino.tensorboard_neighbours=false", "knn.k=3"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def picture(seed: int, size=(14, 12), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)


def photos(root: Path, n: int, start: int = 0) -> Path:
    """n small PNGs over two levels of folders."""
    for i in range(start, start + n):
        path = root / f"part{i % 3}" / ("deep" if i % 2 else "") / f"img{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        picture(i, (16 + i % 5, 16)).save(path)
    return root


def labeled(root: Path, per_class: int = 6) -> Path:
    """root/train/<c>/ and root/val/<c>/: two classes a network can tell apart (dark, bright)."""
    for split in ("train", "val"):
        for c, level in (("dark", 30), ("bright", 220)):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.new("RGB", (16, 16), (level, (i * 37) % 255, level)).save(root / split / c / f"{i}.png")
    return root


@pytest.fixture
def mixed(tmp_path) -> Path:
    """Nested folders, every format and extension case, a corrupt file, a non-image, a photo
    without its extension, hidden entries and a symlink loop."""
    root = tmp_path / "mixed"
    files = {"a/one.JPG": "JPEG", "a/b/two.png": "PNG", "a/b/c/three.Jpeg": "JPEG", "four.WEBP": "WEBP",
             "e/five.bmp": "BMP", "e/six.TIF": "TIFF", "e/seven.tiff": "TIFF", "e/eight.PnG": "PNG"}
    for i, (rel, fmt) in enumerate(files.items()):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        picture(i, mode="L" if i % 3 == 0 else "RGB").save(root / rel, format=fmt)
    (root / "e" / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    (root / "notes.txt").write_text("not an image")
    picture(99).save(root / "a" / "noext", format="PNG")
    picture(98).save(root / ".hidden.png")
    (root / ".cache").mkdir()
    picture(97).save(root / ".cache" / "thumb.png")
    os.symlink("..", root / "a" / "b" / "up")          # a loop back to a/
    os.symlink(root / "e", root / "also_e")            # a second way into e/
    return root


# --------------------------------------------------------------------------- finding files

def test_scan_finds_every_image_at_any_depth_and_counts_what_it_skips(mixed):
    scan = scan_folder(str(mixed))
    rel = [os.path.relpath(p, mixed) for p in scan.paths]
    assert rel == sorted(rel) == ["a/b/c/three.Jpeg", "a/b/two.png", "a/one.JPG", "e/broken.jpg", "e/eight.PnG",
                                  "e/five.bmp", "e/seven.tiff", "e/six.TIF", "four.WEBP"]
    counts = scan.skipped.counts
    assert counts[NOT_IMAGE] == 2 and counts[HIDDEN] == 2 and counts[LOOP] == 2   # up -> a/, also_e -> e/
    assert sorted(os.path.basename(p) for p in scan.skipped.names[NOT_IMAGE]) == ["noext", "notes.txt"]
    assert scan_folder(str(mixed)).paths == scan.paths                               # deterministic


def test_folder_dataset_corrupt_files_and_subset(mixed, capsys):
    cfg = data_cfg(name="folder", root=str(mixed), files=None)
    ds = build_dataset(cfg, "train")
    assert len(ds) == 9 and (ds.targets == -1).all() and ds.classes == []
    ok = [i for i in range(len(ds)) if not ds.path(i).endswith("broken.jpg")]
    assert all(ds[i][0].mode == "RGB" and ds[i][1] == -1 for i in ok)     # gray files become RGB too
    with pytest.raises(UserError, match="broken.jpg"):
        ds[[i for i in range(len(ds)) if i not in ok][0]]
    with pytest.raises(UserError, match=r"1 unreadable image\(s\).*broken.jpg"):
        build_dataset(OmegaConf.merge(cfg, {"check": True}), "train")
    kept = build_dataset(OmegaConf.merge(cfg, {"skip_corrupt": True}), "train")
    assert len(kept) == 8 and [os.path.basename(p) for p, _ in kept.unreadable] == ["broken.jpg"]
    assert "skipped 1 unreadable image(s)" in capsys.readouterr().out
    # data.subset: a seeded pick, the same every time, within the folder's images
    a, b = (build_dataset(OmegaConf.merge(cfg, {"subset": 4}), "train") for _ in range(2))
    assert len(a) == 4 and list(a.indices) == list(b.indices) and len(set(a.indices)) == 4
    with pytest.raises(UserError, match="one split of unlabeled images"):
        build_dataset(cfg, "test")


def test_a_file_list_takes_relative_and_absolute_paths_and_names_a_missing_one(tmp_path, capsys):
    root = photos(tmp_path / "imgs", 6)
    paths = sorted(str(p) for p in root.rglob("*.png"))
    lst = tmp_path / "list.txt"
    lst.write_text(f"# my images\n{os.path.relpath(paths[0], root)}\n\n{paths[1]}\n{paths[2]}\n"
                   f"{os.path.relpath(paths[2], root)}\n")
    cfg = data_cfg(name="folder", root=str(root), files=str(lst))
    ds = build_dataset(cfg, "train")
    assert [p for p, _ in ds.samples] == sorted(paths[:3]) and ds.skipped.counts[TWICE] == 1

    lst.write_text(f"{paths[0]}\nnot/there.png\n{paths[1]}\ngone.jpg\n")
    out = tmp_path / "run"
    assert main(["dino", "resmlp_s12", *TINY, "data=folder", f"data.root={root}", f"data.files={lst}",
                 f"out={out}"]) == 2
    line = one_line_error(capsys)
    assert "2 listed path(s) are not files" in line and "line 2" in line and "not/there.png" in line
    assert not out.exists()                                 # checked before any work


def test_an_empty_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "readme.md").write_text("x")
    assert main(["data", "data=folder", f"data.root={tmp_path / 'empty'}"]) == 2
    line = one_line_error(capsys)
    assert "no images under data.root=" in line and "skipped 1 other entries" in line
    assert main(["data", "data=folder"]) == 2 and "data.root is not set" in one_line_error(capsys)
    assert main(["data", "data=imagefolder", "data.files=x.txt"]) == 2
    assert "unknown config key 'data.files'" in one_line_error(capsys)   # a key of data=folder only


def test_the_data_report_counts_skipped_and_corrupt_files(mixed, tmp_path, capsys):
    assert main(["data", "data=folder", f"data.root={mixed}", "data.check=true", "data.skip_corrupt=true"]) == 0
    out = capsys.readouterr().out
    assert "train: 9 images without labels" in out and "labels: none" in out and "eval.data=" in out
    assert "skipped in train: 6 entries" in out and "noext" in out and ".hidden.png" in out
    assert "2 links to a folder already scanned" in out
    assert "1 unreadable image(s)" in out and "broken.jpg" in out and "skip these 1 file(s)" in out
    assert "sampled files" in out and "1 channel (gray)" in out
    # an image folder names what it does not read too: a photo saved without its extension
    labeled(tmp_path / "lab", per_class=2)
    picture(5).save(tmp_path / "lab" / "train" / "dark" / "photo", format="PNG")
    assert main(["data", "data=imagefolder", f"data.root={tmp_path / 'lab'}", "data.check=true"]) == 0
    out = capsys.readouterr().out
    assert "1 files without an image extension" in out and "dark/photo" in out
    assert "check: all 8 images are readable; 1 other entries were not read" in out


def test_preview_draws_a_folders_crops(tmp_path, capsys):
    root = photos(tmp_path / "imgs", 5)
    out = tmp_path / "prev"
    assert main(["data", "data=folder", f"data.root={root}", "data.img_size=16", "model.patch_size=4",
                 "data.local_size=8", "data.preview=2", f"out={out}"]) == 0
    crops = json.loads((out / "crops.json").read_text())
    assert len(crops["images"]) == 2 and all(Path(i["path"]).is_relative_to(root) for i in crops["images"])


# --------------------------------------------------------------------------- scanned once per run dir

def test_rank_zero_scans_and_the_others_take_its_list(tmp_path, monkeypatch):
    root = photos(tmp_path / "imgs", 4)
    cfg = data_cfg(name="folder", root=str(root))
    lists = FileLists(tmp_path / "run")
    sent = FileLists(None).get(cfg)
    monkeypatch.setattr(folder_mod.dist, "is_main", lambda: False)
    monkeypatch.setattr(folder_mod.dist, "broadcast_object", lambda obj: ("ok", sent) if obj is None else obj)
    monkeypatch.setattr(folder_mod, "scan_folder", lambda *a: pytest.fail("a rank other than 0 scanned"))
    assert lists.get(cfg).paths == sent.paths and lists.scan_count == 0
    lists.save()
    assert not (tmp_path / "run").exists()                  # rank 0 writes the list


def test_rank_zero_hands_over_its_scan_in_one_collective(mixed, tmp_path, monkeypatch):
    """Rank 0 scans (and opens every image for data.skip_corrupt) alone: the other ranks wait
    in the one broadcast that carries the whole result."""
    sent = []
    monkeypatch.setattr(folder_mod.dist, "broadcast_object", lambda obj: sent.append(obj) or obj)
    cfg = data_cfg(name="folder", root=str(mixed), skip_corrupt=True)
    scan = FileLists(tmp_path / "run").get(cfg)
    assert len(sent) == 1 and sent[0][0] == "ok" and sent[0][1] is scan
    assert len(scan.paths) == 8 and [os.path.basename(p) for p, _ in scan.unreadable] == ["broken.jpg"]
    sent.clear()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no images under"):
        FileLists(None).get(data_cfg(name="folder", root=str(tmp_path / "empty")))
    assert len(sent) == 1 and sent[0][0] == "error"       # an error reaches every rank too


def count_scans(monkeypatch) -> list:
    calls = []
    real = folder_mod.scan_folder
    monkeypatch.setattr(folder_mod, "scan_folder", lambda root: calls.append(root) or real(root))
    return calls


@pytest.mark.slow
def test_a_resumed_run_reads_the_saved_list_instead_of_scanning(tmp_path, monkeypatch, capsys):
    root = photos(tmp_path / "imgs", 16)
    out = tmp_path / "run"
    argv = ["dino", "resmlp_s12", *TINY, "data=folder", f"data.root={root}", f"out={out}"]
    calls = count_scans(monkeypatch)
    assert main(argv) == 0
    assert len(calls) == 1                                   # one scan for the whole run
    listing = out / folder_mod.LISTING
    head = json.loads(listing.read_text().splitlines()[0])
    assert head["root"] == str(root) and head["count"] == 16
    photos(root, 4, start=16)                                # the folder grows: the run keeps its images
    assert main([*argv, "epochs=2"]) == 0                    # resumed for one more epoch
    assert len(calls) == 1 and "(not scanned again)" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["epochs"] == 2
    # a list that does not hold what it says is not trusted: scanned again, with a word
    lines = listing.read_text().splitlines()
    listing.write_text("\n".join(lines[:-1]) + "\n")
    assert main([*argv, "epochs=3"]) == 0
    assert len(calls) == 2 and "scanning again" in capsys.readouterr().out


# --------------------------------------------------------------------------- judged with labels

@pytest.fixture(scope="module")
def folder_run(tmp_path_factory) -> dict:
    """A tiny DINO run on a folder of unlabeled images, judged on a labeled image folder."""
    base = tmp_path_factory.mktemp("folder_run")
    root, lab, out = photos(base / "imgs", 24), labeled(base / "lab"), base / "run"
    assert main(["dino", "resmlp_s12", *TINY, "data=folder", f"data.root={root}", "eval.data=imagefolder",
                 f"eval.root={lab}", "eval_every=1", "epochs=2", "dino.final_linear=true", f"out={out}"]) == 0
    return {"root": root, "lab": lab, "run": out}


def test_dino_on_a_folder_is_judged_on_the_labeled_set_it_names(folder_run):
    res = json.loads((folder_run["run"] / "results.json").read_text())
    assert res["data"] == "folder" and res["eval_data"] == "imagefolder" and "warning" not in res
    assert 0 <= res["knn_top1"] <= 100 and 0 <= res["linear_top1"] <= 100 and "init_knn_top1" in res
    log = [json.loads(line) for line in (folder_run["run"] / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log if "knn_top1" in r] == [0, 1, 2]   # at init, every epoch, the end
    cfg = OmegaConf.load(folder_run["run"] / "config.yaml")
    assert cfg.eval.data == "imagefolder" and cfg.data.name == "folder"


def test_without_labels_dino_reports_its_health_and_says_how_to_name_a_set(tmp_path, capsys):
    root = photos(tmp_path / "imgs", 16)
    assert main(["dino", "resmlp_s12", *TINY, "data=folder", f"data.root={root}", f"out={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    note = "no labeled set was named"
    assert out.count(note) == 2 and "eval.data=<" in out and "knn top1" not in out   # at the start and the end
    assert out.index(note) < out.index("ep 1/1")
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert note in res["warning"] and res["eval_data"] is None and "knn_top1" not in res
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all({"loss", "teacher_entropy", "teacher_kl_mean"} <= set(r) for r in log if "iteration" in r)


def test_eval_keys_are_checked_before_any_work(tmp_path, capsys):
    root = photos(tmp_path / "imgs", 8)
    argv = ["dino", "resmlp_s12", *TINY, "data=folder", f"data.root={root}", f"out={tmp_path / 'run'}"]
    for extra, why in ((["eval.data=folder"], "eval.data=folder is not allowed"),
                       (["eval.data=imagefolder"], "needs eval.root=DIR"),
                       ([f"eval.root={root}"], "eval.data is not"),
                       (["eval.data=imagefolder", f"eval.root={tmp_path / 'nope'}"], "eval.root=" + str(tmp_path / "nope") + " is not there"),
                       (["eval.subset=0", "eval.data=fashion_mnist"], "eval.subset=0 is not allowed")):
        assert main([*argv, *extra]) == 2, extra
        assert why in one_line_error(capsys), extra
    assert not (tmp_path / "run").exists()


def test_evaluators_refuse_an_unlabeled_set_and_take_a_labeled_one(folder_run, tmp_path, capsys):
    run = folder_run["run"]
    for command, what in (("knn", "a k-NN accuracy"), ("linear", "a linear probe's accuracy"),
                          ("finetune", "finetune's top-1")):
        assert main([command, str(run), f"out={tmp_path / command}"]) == 2
        line = one_line_error(capsys)
        assert "holds images without labels" in line and what in line and "data=<" in line
        assert not (tmp_path / command).exists()
    # the labeled set named instead: the run's data root is not carried over to it
    assert main(["knn", str(run), "data=imagefolder", f"data.root={folder_run['lab']}", "k=3",
                 f"out={tmp_path / 'knn'}"]) == 0
    report = json.loads((tmp_path / "knn" / "knn.json").read_text())
    assert report["data"]["name"] == "imagefolder" and report["data"]["train"] == 12
    cfg = load_config("knn", None, [f"checkpoint={run}", "data=fashion_mnist"],
                      base=OmegaConf.to_container(OmegaConf.load(run / "config.yaml")))
    assert cfg.data.root is None and cfg.data.img_size == 16 and cfg.data.crop_ratio == 1.0


# --------------------------------------------------------------------------- viz without labels, the map

def test_thumbnail_cells_take_the_point_nearest_each_cells_centre():
    from resmlp.eval.embedding import thumbnail_cells
    xy = np.array([[0.0, 0.0], [1.0, 1.0], [0.26, 0.74], [0.4, 0.6], [0.74, 0.26], [0.0, 1.0]])
    cells = thumbnail_cells(xy, 2)
    # row 0 is the top (large y): points 5 (0, 1), 2 and 3 share the top-left cell, 2 is nearest its centre
    assert cells == [(0, 0, 2), (0, 1, 1), (1, 0, 0), (1, 1, 4)]
    for r, c, p in cells:   # against a plain loop over every point
        centre = np.array([(c + 0.5) / 2, 1 - (r + 0.5) / 2])
        inside = [i for i in range(len(xy)) if min(int(xy[i, 0] * 2), 1) == c and min(int((1 - xy[i, 1]) * 2), 1) == r]
        assert p == min(inside, key=lambda i: (((xy[i] - centre) ** 2).sum(), i))


def test_viz_on_a_folder_draws_without_labels(folder_run, tmp_path):
    out = tmp_path / "viz"
    assert main(["viz", str(folder_run["run"]), "k=3", "viz.dpi=40", "viz.embedding_grid=4",
                 "viz.figures=[neighbours,patch_pca,embedding,sparsity]", f"out={out}"]) == 0
    v = json.loads((out / "viz.json").read_text())
    assert {"neighbours.png", "patch_pca.png", "embedding.png", "sparsity.png"} <= set(v["files"])
    nb = v["neighbours"]
    assert nb["labels"] is None and nb["match"] is None and len(nb["queries"]) == 8
    assert all(q not in row for q, row in zip(nb["queries"], nb["indices"]))   # the query is left out
    cache = torch.load(nb["train_cache"], weights_only=True)
    from resmlp.eval.knn import knn_search
    _, idx = knn_search(cache["features"], cache["features"][nb["queries"]], 4)
    assert nb["indices"] == [[i for i in row if i != q][:3] for q, row in zip(nb["queries"], idx.tolist())]
    emb = v["embedding"]
    assert emb["split"] == "train" and emb["labels"] is None and len(emb["xy"]) == len(emb["images"]) == 24
    cells = emb["thumbnails"]["cells"]
    assert emb["thumbnails"]["grid"] == 4 and 1 <= len(cells) <= 16 and len({(r, c) for r, c, _ in cells}) == len(cells)
    assert set(i for _, _, i in cells) <= set(emb["images"])


def test_viz_map_of_a_labeled_set_is_coloured_by_class(folder_run, tmp_path):
    out = tmp_path / "viz"
    assert main(["viz", str(folder_run["run"]), "data=imagefolder", f"data.root={folder_run['lab']}",
                 "viz.figures=[embedding]", "viz.embedding_images=10", "viz.dpi=40", "seed=3", f"out={out}"]) == 0
    emb = json.loads((out / "viz.json").read_text())["embedding"]
    test = build_dataset(data_cfg(name="imagefolder", root=str(folder_run["lab"])), "test")
    assert emb["split"] == "test" and len(emb["images"]) == 10 and "thumbnails" not in emb
    assert emb["labels"] == [int(test.targets[i]) for i in emb["images"]] and len(emb["xy"]) == 10
    again = tmp_path / "again"
    assert main(["viz", str(folder_run["run"]), "data=imagefolder", f"data.root={folder_run['lab']}",
                 "viz.figures=[embedding]", "viz.embedding_images=10", "viz.dpi=40", "seed=3", f"out={again}"]) == 0
    assert json.loads((again / "viz.json").read_text())["embedding"]["xy"] == emb["xy"]   # seeded: the same map
    assert (out / "embedding.png").stat().st_size > 1000
