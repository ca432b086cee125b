"""Writes the user did not ask for (issue 29): out= on a folder of something else, out= or
a cache inside data.root, feature caches outside the installed tree, an export over one of
other weights, relative paths read as the caller's shell reads them, and paths the file
system cannot take. Each is refused in one line before anything is made."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_inputs import RANDOM, TINY_ARCH, commands, image_folder, one_line_error, tiny_run  # noqa: F401

from resmlp.core.cli import main
from resmlp.core.config import load_config, save_config

ROOT = Path(__file__).resolve().parent.parent


def listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def dino_checkpoint(run: Path, seed: int) -> Path:
    """A run dir of this project with a tiny DINO checkpoint of its own weights."""
    from resmlp.models import create_model
    torch.manual_seed(seed)
    sd = {"backbone." + k: v for k, v in create_model("resmlp_s12", **TINY_ARCH, num_classes=0).state_dict().items()}
    run.mkdir(parents=True)
    config = {"model": {"name": "resmlp_s12", **TINY_ARCH}, "data": {"name": "fashion_mnist", "img_size": 32}}
    torch.save({"format": "resmlp-ssl", "command": "dino", "config": config, "teacher": sd, "student": sd,
                "epoch": 1, "iteration": 2}, run / "checkpoint.pth")
    return run


# ---- out= on a folder that is not ours ------------------------------------------------------------
def test_out_on_a_folder_of_something_else_is_refused_unless_out_ok(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)   # runs/ would appear here if a command went on
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "config.yaml").write_text("lr: 0.1\n")   # a config.yaml, but not a run's of ours
    (mine / "results.json").write_text('{"top1": 99.0}')
    (mine / "checkpoint.pth").write_bytes(b"not ours")
    before = listing(mine)
    folder = image_folder(tmp_path / "images", 2, 4)
    for argv in commands(tiny_run / "dino", folder):
        assert main([str(a) for a in argv] + [f"out={mine}"]) == 2, argv
        line = one_line_error(capsys)
        assert f"out={mine} holds files this project did not write (checkpoint.pth, config.yaml, notes.txt and 1 " \
               "more)" in line and "pass out_ok=true" in line, line
    assert listing(mine) == before and not (tmp_path / "runs").exists()
    ran = []   # asked for in so many words, the command goes on (a stand-in does its work)
    assert main(["dino", "resmlp_s12", f"out={mine}", "out_ok=true"], run=ran.append) == 0 and len(ran) == 1
    assert main(["dino", "resmlp_s12", f"out={mine}", "out_ok=maybe"]) == 2
    assert "out_ok='maybe' should be true/false" in one_line_error(capsys)


def test_only_rank_0_checks_out_also_in_a_group_joined_without_torchrun(tmp_path, monkeypatch):
    """A caller that joins the process group itself (spawned processes, a notebook) sets no
    RANK: the other ranks still leave out= alone, or their write probe would be a foreign
    file to rank 0's check (the race that failed test_embed's two-process run)."""
    import torch.distributed as tdist
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 1)
    ran = []
    assert main(["dino", "resmlp_s12", f"out={mine}"], run=ran.append) == 0 and len(ran) == 1
    monkeypatch.setattr(tdist, "get_rank", lambda group=None: 0)
    assert main(["dino", "resmlp_s12", f"out={mine}"], run=ran.append) == 2 and len(ran) == 1


def test_a_new_an_empty_or_a_folder_of_ours_is_taken(tiny_run, tmp_path, capsys):
    ours = {"new": tmp_path / "new", "empty": tmp_path / "empty"}
    ours["empty"].mkdir()
    run = ours["run dir"] = tmp_path / "run"   # what a trainer leaves: config.yaml, its log
    save_config(load_config("dino", "resmlp_s12", ["demo=false"]), run / "config.yaml")
    (run / "log.jsonl").write_text("")
    ours["checkpoint only"] = tiny_run / "dino"
    report = ours["a report"] = tmp_path / "figures"   # viz out=docs/figures: its figures beside others
    report.mkdir()
    (report / "viz.json").write_text("{}")
    (report / "photo.jpg").write_bytes(b"\xff\xd8")
    shutil.copytree(run, tmp_path / "compare" / "supervised")   # compare's folder: run dirs of ours
    ours["run dirs"] = tmp_path / "compare"
    for what, out in ours.items():
        ran = []
        assert main(["dino", "resmlp_s12", f"out={out}"], run=ran.append) == 0, (what, capsys.readouterr().err)
        assert len(ran) == 1, what


# ---- inside data.root --------------------------------------------------------------------------------
def test_outputs_inside_data_root_are_refused_before_anything_is_made(tiny_run, tmp_path, capsys, monkeypatch):
    folder = image_folder(tmp_path / "images", 2, 4)
    before = listing(folder)
    data = ["data=imagefolder", f"data.root={folder}"]
    for out in (folder / "train" / "run1", folder):
        assert main(["dino", "resmlp_s12", *data, f"out={out}"]) == 2
        assert f"out={out} is inside data.root={folder}" in one_line_error(capsys)
    assert main(["knn", str(tiny_run / "dino"), *data, f"features.cache_dir={folder / 'train' / 'cache'}",
                 f"out={tmp_path / 'knn'}"]) == 2
    assert "features.cache_dir=" in one_line_error(capsys)
    assert main(["dino", "resmlp_s12", *data, f"compile_cache_dir={folder / 'train' / 'compiled'}",
                 f"out={tmp_path / 'dino'}"]) == 2
    assert f"compile_cache_dir={folder / 'train' / 'compiled'} is inside data.root={folder}" in one_line_error(capsys)
    monkeypatch.chdir(folder)   # the default runs/<name> from a shell inside the data set
    assert main(["dino", "resmlp_s12", "data=imagefolder", "data.root=."]) == 2
    assert f"is inside data.root={folder}" in one_line_error(capsys)
    assert listing(folder) == before and not (tmp_path / "knn").exists() and not (tmp_path / "dino").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["train", "val"]


# ---- the feature cache of a checkpoint without a run dir -------------------------------------------
def test_the_feature_cache_goes_under_out_else_the_users_cache_never_the_installed_tree(tmp_path, monkeypatch):
    from resmlp.eval.features import default_cache_dir, user_cache_dir
    folder = image_folder(tmp_path / "images", 2, 4)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    knn = ["knn", RANDOM, "data=imagefolder", f"data.root={folder}", "data.img_size=32", "k=2", "num_workers=0",
           "device=cpu"]
    assert main([*knn, f"out={tmp_path / 'res'}"]) == 0
    assert len(list((tmp_path / "res" / "features").glob("*.pt"))) == 2   # train and val
    assert main(knn) == 0
    assert len(list((tmp_path / "xdg" / "resmlp" / "features").glob("*.pt"))) == 2
    # runs/eval/<model>/, no cache
    assert sorted(p.name for p in here.rglob("*") if p.is_file()) == ["evaluations.jsonl", "knn.json"]
    # XDG's rules: a relative XDG_CACHE_HOME is ignored
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "resmlp" / "features"
    assert default_cache_dir({"run_dir": "/r"}, out="/o") == Path("/r/features")


# ---- export over an earlier export ---------------------------------------------------------------------
def test_an_export_over_one_of_other_weights_is_refused_unless_out_ok(tmp_path, capsys):
    a, b = dino_checkpoint(tmp_path / "a", 0), dino_checkpoint(tmp_path / "b", 1)
    out = tmp_path / "exp"
    assert main(["export", str(a), f"out={out}"]) == 0
    weights = out / "resmlp_s12_teacher_timm.pth"
    first = weights.read_bytes()
    assert main(["export", str(a), f"out={out}"]) == 0   # the same weights again: written again
    capsys.readouterr()
    assert main(["export", str(b), f"out={out}"]) == 2
    line = one_line_error(capsys)
    assert f"{weights} holds an export of other weights ({a}, epoch 1)" in line and "out_ok=true" in line
    assert weights.read_bytes() == first
    assert main(["export", str(b), f"out={out}", "out_ok=true"]) == 0
    assert weights.read_bytes() != first
    assert json.loads(weights.with_suffix(".json").read_text())["source"]["spec"] == str(b)
    # the default place, export/ beside the checkpoint, after the run trained on
    assert main(["export", str(a)]) == 0
    shutil.copy(b / "checkpoint.pth", a / "checkpoint.pth")
    capsys.readouterr()
    assert main(["export", str(a)]) == 2
    assert "holds an export of other weights" in one_line_error(capsys)


# ---- paths the file system cannot take ----------------------------------------------------------------
def test_a_name_or_a_path_too_long_for_the_file_system_is_one_line(tiny_run, tmp_path, capsys):
    long_name = tmp_path / ("x" * 300)
    deep = tmp_path.joinpath(*["y" * 200] * 25)
    for argv in (["dino", "resmlp_s12", f"out={long_name}"], ["export", str(tiny_run / "dino"), f"out={deep}"]):
        assert main(argv) == 2
        line = one_line_error(capsys)
        assert "the file system takes; choose a shorter out=" in line and len(line) < 400, line
    assert main(["knn", str(tiny_run / "dino"), f"features.cache_dir={long_name}"]) == 2
    line = one_line_error(capsys)
    assert "features.cache_dir=" in line and "the file system takes; choose a shorter one" in line, line
    assert main(["knn", str(long_name)]) == 2   # met where the path is first used, still one line
    line = one_line_error(capsys)
    assert "File name too long" in line and "choose a shorter one" in line and len(line) < 400, line
    assert main(["knn", str(tiny_run / "dino"), f"data.root={long_name}"]) == 2
    one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


# ---- relative paths: the caller's folder, not the installed tree -----------------------------------------
@pytest.mark.slow
def test_relative_paths_through_run_sh_mean_the_callers_folder(tiny_run, tmp_path):
    shutil.copytree(tiny_run / "dino", tmp_path / "ckpts" / "dino")
    image_folder(tmp_path / "images", 2, 4)
    here = tmp_path / "work"
    here.mkdir()
    env = {**os.environ, "RESMLP_PYTHON": sys.executable}
    run = lambda *args: subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=here, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=600)
    knn = run("knn", "../ckpts/dino", "data=imagefolder", "data.root=../images", "data.img_size=32", "k=2",
              "num_workers=0", "out=results")
    assert knn.returncode == 0, knn.stderr[-2000:]
    report = json.loads((here / "results" / "knn.json").read_text())
    assert report["results"] and report["checkpoint"]["spec"] == str(tmp_path / "ckpts" / "dino")
    assert len(list((tmp_path / "ckpts" / "dino" / "features").glob("*.pt"))) == 2   # our run dir's cache
    assert not (ROOT / "results").exists()
    # a default output lands in the caller's folder too, as with any command-line tool
    preview = run("data", "data=imagefolder", "data.root=../images", "data.preview=1", "num_workers=0")
    assert preview.returncode == 0, preview.stderr[-2000:]
    assert (here / "runs" / "data_resmlp_s12_imagefolder" / "crops.png").exists()


def test_path_keys_are_kept_absolute_so_a_saved_config_means_the_same_files_anywhere(tmp_path, monkeypatch):
    """A relative path is read against the folder the command started in, and saved so:
    config.yaml then names the same files when the run is resumed or evaluated elsewhere."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "data=folder", "data.root=imgs", "out=runs/x",
                                             "eval.data=imagefolder", "eval.root=../labeled",
                                             "features.cache_dir=~/cache", "dino.init=w/teacher.pth"])
    assert cfg.data.root == str(tmp_path / "imgs") and cfg.out == str(tmp_path / "runs" / "x")
    assert cfg.eval.root == str(tmp_path.parent / "labeled")
    assert cfg.features.cache_dir == os.path.expanduser("~/cache")
    assert cfg.dino.init == str(tmp_path / "w" / "teacher.pth")
    assert load_config("knn", None, [f"checkpoint={RANDOM}"]).checkpoint == RANDOM  # a timm: spec is no path
    assert load_config("distill", "resmlp_s12", ["distill.teacher=t.pth"]).distill.teacher == str(tmp_path / "t.pth")
