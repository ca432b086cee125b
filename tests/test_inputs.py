"""Inputs checked before any work, failures as one line that says what to do, nothing
clobbered (issue 23): where outputs go, a full disk, advice that works, every value checked
first, overrides a command would ignore, one-class data, wording. Finished runs and the
resumed log are in test_dino.py (test_killed_run_resumes_...)."""
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from resmlp.core import checkpoint as ckpt_mod
from resmlp.core.checkpoint import load_checkpoint, save_checkpoint, writable_problem
from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.errors import RunFailed, UserError

TINY_ARCH = {"img_size": 32, "patch_size": 4, "dim": 16, "depth": 2}
RANDOM = "timm:resmlp_12_224?random"
# Tiny DINO on a small image folder (the campaign's tiny preset sizes).
TINY_DINO = ["model.dim=16", "model.depth=2", "data.img_size=32", "model.patch_size=8", "data.local_size=16",
             "batch_size=4", "epochs=1", "dino.out_dim=32", "dino.hidden_dim=16", "dino.bottleneck_dim=8",
             "dino.n_local_crops=2", "optim.warmup_epochs=0", "num_workers=0", "eval_every=0",
             "dino.final_linear=false", "model.drop_path_rate=0.0", "dino.tensorboard_neighbours=false"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run dir of this project holding a tiny DINO checkpoint, and a supervised one beside it."""
    from resmlp.models import create_model
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    net = create_model("resmlp_s12", **TINY_ARCH, num_classes=0)
    sd = {"backbone." + k: v for k, v in net.state_dict().items()}
    config = {"model": {"name": "resmlp_s12", **TINY_ARCH}, "data": {"name": "fashion_mnist", "img_size": 32}}
    (root / "dino").mkdir()
    torch.save({"format": "resmlp-ssl", "command": "dino", "config": config, "teacher": sd, "student": sd,
                "epoch": 1, "iteration": 2}, root / "dino" / "checkpoint.pth")
    sup = create_model("resmlp_s12", **TINY_ARCH, num_classes=10)
    torch.save({"format": "resmlp-ssl", "command": "supervised", "config": config, "model": sup.state_dict()},
               root / "supervised.pth")
    return root


def image_folder(root: Path, classes: int, per_class: int) -> Path:
    from kit import make_jpeg_folder
    make_jpeg_folder(str(root), classes * per_class, 36, 48, classes=classes)
    return root


# ---- 1. where outputs go --------------------------------------------------------------------
def commands(run: Path, folder: Path):
    return [["knn", run], ["linear", run], ["viz", run], ["export", run],
            ["data", "data=imagefolder", f"data.root={folder}", "data.preview=2"],
            ["dino", "resmlp_s12"], ["supervised", "resmlp_s12"], ["compare", "resmlp_s12"]]


def test_every_command_refuses_an_output_dir_it_cannot_write_before_any_work(tiny_run, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)   # runs/ would appear here if a command went on
    folder = image_folder(tmp_path / "images", 2, 4)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    # unwritable even for root (chmod is not): a path under a regular file, and /proc
    bad = [(notes / "x", "is an existing file"), (notes, "is an existing file")]
    if Path("/proc/self").exists():
        bad.append((Path("/proc/resmlp-x"), "No such file"))
    for argv in commands(tiny_run / "dino", folder):
        for out, why in bad:
            assert main([str(a) for a in argv] + [f"out={out}"]) == 2, (argv, out)
            line = one_line_error(capsys)
            assert f"cannot write the outputs of `{argv[0]}` to {out}" in line and why in line, line
            assert "choose another out=" in line
    assert notes.read_text() == "mine" and not (tmp_path / "runs").exists()
    assert sorted(p.name for p in tiny_run.iterdir()) == ["dino", "supervised.pth"]


def test_an_unwritable_feature_cache_fails_before_extraction(tmp_path, capsys, monkeypatch):
    from resmlp.eval import features
    monkeypatch.setattr(features, "extract_features", lambda *a, **k: pytest.fail("extracted"))
    (tmp_path / "f.txt").write_text("")
    assert main(["knn", RANDOM, f"features.cache_dir={tmp_path / 'f.txt' / 'x'}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot write the feature cache" in err[-1] and "features.cache=false" in err[-1], err
    assert not list((tmp_path / "out").glob("*"))


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    assert writable_problem(tmp_path / "a" / "b" / "c") is None
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    assert "existing file" in writable_problem(tmp_path / "f" / "x")


# ---- 2. a full disk ---------------------------------------------------------------------------
class FullDisk:
    """A file on a disk that takes `room` bytes more, then refuses with ENOSPC."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.__exit__(*exc)


def fill_disk(monkeypatch, room: int = 100) -> None:
    real = os.fdopen
    monkeypatch.setattr(ckpt_mod.os, "fdopen", lambda fd, mode: FullDisk(real(fd, mode), room))


def test_a_full_disk_keeps_the_checkpoint_and_leaves_no_partial_file(tmp_path, monkeypatch):
    path, prev = tmp_path / "checkpoint.pth", tmp_path / "checkpoint_prev.pth"
    save_checkpoint(path, {"w": torch.ones(3), "iteration": 1})
    save_checkpoint(path, {"w": torch.full((3,), 2.0), "iteration": 2}, previous=prev)
    fill_disk(monkeypatch)
    with pytest.raises(RunFailed) as e:
        save_checkpoint(path, {"w": torch.zeros(100_000), "iteration": 3}, previous=prev)
    msg = str(e.value)
    assert "\n" not in msg and f"cannot write the checkpoint {path}" in msg and "No space left" in msg
    assert "the one before is intact" in msg and "resume=auto" in msg
    monkeypatch.undo()
    assert load_checkpoint(path)["iteration"] == 2 and load_checkpoint(prev)["iteration"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pth", "checkpoint_prev.pth"]


def test_a_full_disk_while_writing_results_is_one_line_exit_1(tiny_run, tmp_path, capsys, monkeypatch):
    fill_disk(monkeypatch, room=10)
    out = tmp_path / "viz"
    assert main(["viz", str(tiny_run / "dino"), "viz.figures=[sparsity]", f"out={out}"]) == 1
    line = one_line_error(capsys)   # its first write: the figure, written atomically as the results are
    assert f"cannot write the figure {out / 'sparsity.png'}: No space left on device" in line
    assert "free some space" in line
    assert not list(out.glob("*.png")) and not (out / "viz.json").exists() and not list(out.glob("*.tmp"))


def test_a_real_full_file_system_is_named_too(tmp_path):
    """torch.save on a full disk raises a RuntimeError about stream positions: the message
    must still name the cause. Needs a size-limited tmpfs (root with mount rights)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with pytest.raises(RunFailed, match="No space left on device"):
            save_checkpoint(mnt / "checkpoint.pth", {"w": torch.zeros(200_000)})
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_running_out_of_memory_is_one_line_that_says_what_to_lower(tmp_path, capsys, monkeypatch):
    """The CPU allocator's failure (a real one: more bytes than any machine has) and CUDA's
    OutOfMemoryError end in one line, exit 1, not torch's traceback; any other error is
    still raised as it is."""
    monkeypatch.chdir(tmp_path)

    def too_big(cfg):
        torch.empty(2**50, dtype=torch.uint8)

    def cuda_full(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nmore lines")

    for run, said in ((too_big, "can't allocate memory"), (cuda_full, "CUDA out of memory. Tried to allocate")):
        assert main(["dino", "resmlp_s12", f"out={tmp_path / 'run'}"], run=run) == 1
        line = one_line_error(capsys)
        assert line.startswith("error: out of memory (") and said in line and "lower batch_size" in line, line

    def bug(cfg):
        raise RuntimeError("shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        main(["dino", "resmlp_s12", f"out={tmp_path / 'run'}"], run=bug)


# ---- 3. advice that can be followed -----------------------------------------------------------
def test_null_is_taken_where_the_limit_allows_it_and_messages_say_where_a_value_came_from():
    cfg = load_config("dino", "resmlp_s12", ["demo=true", "data.subset=null"])
    assert cfg.data.subset is None and cfg.epochs == 8                         # the demo's other overrides stay
    with pytest.raises(UserError, match=r"\(the recipe demo sets data.subset=5000 in "
                                        r"configs/recipe/demo/method/dino.yaml\)"):
        load_config("dino", "resmlp_s12", ["demo=true", "data.subset=many"])
    with pytest.raises(UserError, match=r"\(batch_size=32 came earlier on the command line\)"):
        load_config("knn", None, ["batch_size=32", "batch_size=abc"])
    with pytest.raises(UserError, match=r"\(the default is 256\)"):
        load_config("knn", None, ["batch_size=abc"])


def test_a_small_folder_runs_the_demo_with_what_it_has_and_the_knn_advice_works(tmp_path, capsys):
    """The CPU demo on 12 images: all 12 are taken (its banner says so); its k-NN's k=20 is
    refused before any work with a value that then works; one class is a loud warning."""
    folder = image_folder(tmp_path / "one", 1, 12)
    argv = ["dino", "resmlp_s12", "demo=true", "data=imagefolder", f"data.root={folder}", *TINY_DINO,
            f"out={tmp_path / 'run'}"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "knn.k=20 is larger than the train set (12 images); use knn.k=12 or less" in line
    assert not (tmp_path / "run").exists()
    assert main([*argv, "knn.k=12"]) == 0
    out = capsys.readouterr().out
    assert "on 12 imagefolder images" in out and "takes all 12 images" in out
    assert out.count("has one class (c00)") == 2
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert "one class" in results["warning"] and results["knn_k"] == 12
    assert list(load_config("dino", None, [], base=None).knn.k) == [20]


# ---- 4. every value before the first work --------------------------------------------------------
@pytest.mark.parametrize("argv,why", [
    (["dino", "resmlp_s12", "resume=maybe"], "resume must be one of auto, never"),
    (["distill", "resmlp_s12", "teacher=timm:resnet18", "distill.type=medium"], "must be one of hard, soft"),
    (["linear", RANDOM, "linear.mode=fast"], "must be one of cached, augmented"),
    (["export", RANDOM, "format=tflite"], "must be one of timm, official, safetensors, onnx, hub"),
    (["dino", "resmlp_s12", "precision=fp8"], "must be one of auto, bf16, fp16, fp32"),
])
def test_words_outside_their_list_are_refused_before_anything_is_made(argv, why, tmp_path, capsys):
    assert main([*argv, f"out={tmp_path / 'run'}"]) == 2
    assert why in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_compare_checks_every_paths_config_before_training_the_first(tmp_path, capsys, monkeypatch):
    from resmlp.supervised import compare
    monkeypatch.setattr(compare, "run_step", lambda *a: pytest.fail("trained a path"))
    out = tmp_path / "cmp"
    assert main(["compare", "resmlp_s12", "demo=false", f"out={out}", "compare.extra.finetune=[bogus.key=1]"]) == 2
    line = one_line_error(capsys)
    assert "the finetune path" in line and "unknown config key 'bogus.key'" in line
    assert main(["compare", "resmlp_s12", "demo=false", f"out={out}", "compare.extra.linear=[linear.mode=x]"]) == 2
    assert "the linear path" in one_line_error(capsys)
    assert not out.exists()


# ---- 5. overrides a command would ignore --------------------------------------------------------
@pytest.mark.parametrize("argv,key", [
    (["knn", "{run}", "model.dim=128"], "model.dim"), (["linear", "{run}", "model=resmlp_s24"], "model"),
    (["viz", "{run}", "knn.k=5"], "knn.k"), (["supervised", "resmlp_s12", "knn.k=5"], "knn.k"),
    (["dino", "resmlp_s12", "features.key=student"], "features.key"),
])
def test_an_override_the_command_does_not_read_is_refused(argv, key, tiny_run, tmp_path, capsys):
    argv = [a.format(run=tiny_run / "dino") for a in argv]
    assert main([*argv, f"out={tmp_path / 'run'}"]) == 2
    assert f"does not read {key} (" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_the_student_of_a_one_network_checkpoint_is_refused(tiny_run):
    from resmlp.models.load import load_backbone
    for spec in (tiny_run / "supervised.pth", RANDOM):
        with pytest.raises(UserError, match="only a DINO checkpoint has a student"):
            load_backbone(spec, key="student")
    assert load_backbone(tiny_run / "dino", key="student")[1]["key"] == "student"


# ---- 6. one class -------------------------------------------------------------------------------
def test_one_class_is_refused_where_it_makes_the_accuracy_meaningless(tiny_run, tmp_path, capsys):
    folder = image_folder(tmp_path / "one", 1, 6)
    data = ["data=imagefolder", f"data.root={folder}"]
    for argv in (["knn", str(tiny_run / "dino")], ["linear", str(tiny_run / "dino")], ["supervised", "resmlp_s12"]):
        assert main([*argv, *data, f"out={tmp_path / 'run'}"]) == 2
        line = one_line_error(capsys)
        assert "has one class (c00)" in line and "100%" in line
    assert not (tmp_path / "run").exists()


# ---- 8. wording ---------------------------------------------------------------------------------
def test_a_file_that_is_not_a_checkpoint_says_so(tmp_path, capsys):
    (tmp_path / "random.pth").write_bytes(os.urandom(3000))
    (tmp_path / "notes.pth").write_text("hello\n")
    for name in ("random.pth", "notes.pth"):
        assert main(["knn", str(tmp_path / name)]) == 2
        line = one_line_error(capsys)
        assert "is not a checkpoint: torch cannot read it" in line and "torch.save" in line
        assert "mmap" not in line and "_use_new_zipfile_serialization" not in line
