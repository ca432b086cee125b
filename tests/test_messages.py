"""Messages that name the key the user gave (issue 36, item 5): a bad eval.root is named as
eval.root, a folder or a list file given to the wrong data set points at the one that reads
it, a key given at the wrong level points at where it lives, the demo's note does not blame a
subset nobody set, and figures name the size of the network they show. Each bad input is one
line, exit 2, nothing created."""

import pytest
import torch

from resmlp.core.cli import main
from resmlp.core.config import load_config

from test_inputs import one_line_error

TINY_DINO = ["demo=false", "model.dim=16", "model.depth=2", "data.img_size=32", "model.patch_size=8",
             "data.local_size=16", "batch_size=4", "epochs=1", "dino.out_dim=32", "dino.hidden_dim=16",
             "dino.bottleneck_dim=8", "dino.n_local_crops=2", "num_workers=0", "eval_every=0"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """An unlabeled folder (images at two depths), a labeled one (train/ and val/ class
    folders) and a text file listing the unlabeled images."""
    from kit import make_jpeg_folder
    root = tmp_path_factory.mktemp("messages")
    make_jpeg_folder(str(root / "labeled"), 8, 36, 48, classes=2)
    unlabeled = root / "photos"
    make_jpeg_folder(str(unlabeled), 8, 36, 48, classes=2)
    for split in ("train", "val"):
        (unlabeled / split).rename(unlabeled / f"trip_{split}")  # no train/: only images, at any depth
    listing = root / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(unlabeled.rglob("*.jpg"))))
    return {"labeled": root / "labeled", "photos": unlabeled, "list": listing}


def refused(argv, tmp_path, capsys) -> str:
    out = tmp_path / "run"
    assert main([*argv, f"out={out}"]) == 2
    line = one_line_error(capsys)
    assert not out.exists()
    return line


@pytest.mark.parametrize("where,says", [
    ("photos", "it holds images without class folders: eval.root needs a labeled set"),
    ("labeled/train", "is a split folder itself: pass eval.root={labeled}"),
])
def test_a_bad_eval_root_is_named_as_eval_root(where, says, folders, tmp_path, capsys):
    root = folders["labeled"] / "train" if where == "labeled/train" else folders[where]
    line = refused(["dino", "resmlp_s12", *TINY_DINO, "data=folder", f"data.root={folders['photos']}",
                    "eval.data=imagefolder", f"eval.root={root}"], tmp_path, capsys)
    assert f"eval.root={root} has no train/ folder" in line and "data.root" not in line
    assert says.format(labeled=folders["labeled"]) in line


def test_a_folder_without_classes_given_to_imagefolder_points_at_data_folder(folders, tmp_path, capsys):
    line = refused(["dino", "resmlp_s12", *TINY_DINO, "data=imagefolder", f"data.root={folders['photos']}"],
                   tmp_path, capsys)
    assert f"data.root={folders['photos']} has no train/ folder" in line
    assert "data=folder reads those" in line
    train = folders["labeled"] / "train"   # the labeled set's split folder, given as its root
    line = refused(["dino", "resmlp_s12", *TINY_DINO, "data=imagefolder", f"data.root={train}"], tmp_path, capsys)
    assert f"pass data.root={folders['labeled']}" in line


@pytest.mark.parametrize("data,says", [("imagefolder", "data.files={list} with data=folder"),
                                       ("folder", "data.files={list}")])
def test_a_list_file_given_as_data_root_points_at_data_files(data, says, folders, tmp_path, capsys):
    line = refused(["dino", "resmlp_s12", *TINY_DINO, f"data={data}", f"data.root={folders['list']}"],
                   tmp_path, capsys)
    assert f"data.root={folders['list']} is a file" in line and line.endswith(says.format(list=folders["list"]))
    archive = tmp_path / "images.tar"   # a file that lists no images: no such hint
    archive.write_bytes(b"\x00" * 512)
    line = refused(["dino", "resmlp_s12", *TINY_DINO, f"data={data}", f"data.root={archive}"], tmp_path, capsys)
    assert line.endswith("name the folder that holds the data set")


def test_a_key_given_at_the_wrong_level_names_where_it_lives(tmp_path, capsys):
    line = refused(["dino", "resmlp_s12", "few_labels=[1,5]"], tmp_path, capsys)
    assert line == "error: unknown config key 'few_labels'; did you mean knn.few_labels?"
    line = refused(["dino", "resmlp_s12", "n_per_class=[1,5]"], tmp_path, capsys)  # the case, renamed since
    assert "knn.few_labels" in line
    line = refused(["dino", "resmlp_s12", "root=/data"], tmp_path, capsys)
    assert line.endswith("did you mean data.root or eval.root?")
    line = refused(["dino", "resmlp_s12", "nosuchkey=1"], tmp_path, capsys)  # no such leaf: the keys there
    assert "valid keys at the top level: command, name" in line


def test_the_demo_note_blames_no_subset_the_user_did_not_set(folders):
    from resmlp.data.datasets import fit_demo_subset
    given = ["demo=true", "data=imagefolder", f"data.root={folders['labeled']}"]
    cfg = load_config("dino", "resmlp_s12", given)
    note = fit_demo_subset(cfg)
    assert note.startswith("the CPU demo takes all 8 images of the training split, fewer than the ")
    assert "the recipe demo asks for" in note and "data.subset" not in note
    assert cfg.data.subset is None
    note = fit_demo_subset(load_config("dino", "resmlp_s12", [*given, "data.subset=300"]))
    assert note.endswith("fewer than the data.subset=300 asked for")


def test_figures_name_the_size_of_the_network_they_show(tmp_path, monkeypatch):
    """A 64-dim, 4-deep network trained as `resmlp_s12 model.dim=64 model.depth=4` is titled
    by its sizes, in the figures and in viz.json's `loaded` line; a real resmlp_s12 by name."""
    import resmlp.eval.viz as viz
    from resmlp.models import create_model
    from resmlp.models.load import load_backbone, model_label
    arch = {"img_size": 32, "patch_size": 8, "dim": 64, "depth": 4}
    net = create_model("resmlp_s12", **arch, num_classes=0)
    config = {"model": {"name": "resmlp_s12", **arch}, "data": {"name": "fashion_mnist", "img_size": 32}}
    torch.save({"format": "resmlp-ssl", "command": "dino", "config": config, "epoch": 1,
                "teacher": {"backbone." + k: v for k, v in net.state_dict().items()}}, tmp_path / "checkpoint.pth")
    model, info = load_backbone(str(tmp_path / "checkpoint.pth"))
    titles = []
    monkeypatch.setattr(viz, "draw_sparsity", lambda sp, path, title, *a, **k: titles.append(title))
    result = viz.make_figures(model, info, tmp_path / "viz", figures=["sparsity"], log=None)
    assert titles and titles[0].startswith("ResMLP (dim 64, depth 4) (dino") and "resmlp_s12" not in titles[0]
    assert result["loaded"].startswith("ResMLP (dim 64, depth 4) from dino")
    full = {"model": "resmlp_s12", "is_resmlp": True, "arch": {"dim": 384, "depth": 12}}
    assert model_label(full) == "resmlp_s12"
    assert model_label({"model": "regnety_002", "is_resmlp": False, "arch": {}}) == "regnety_002"
