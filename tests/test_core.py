"""The shared runtime: layout, config, CLI, checkpoints, schedules, parameter groups."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from resmlp.core import cli
from resmlp.core.checkpoint import load_checkpoint, save_checkpoint
from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.core.optim import param_groups
from resmlp.core.run import Run
from resmlp.core.run_folder import config_differences
from resmlp.core.schedules import cosine_schedule, linear_warmup_then_constant

ROOT = Path(__file__).resolve().parent.parent


def run_sh(*args, **env):
    """run.sh with this interpreter (no .venv build inside the tests)."""
    e = {**os.environ, "RESMLP_PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=300)


# ---- layout -----------------------------------------------------------------------------
def test_project_imports_from_root_without_shadowing_ssl():
    code = ("import resmlp.models, resmlp.ssl.train, resmlp.eval.knn, resmlp.data, resmlp.core.cli; "
            "import ssl; print(ssl.OPENSSL_VERSION)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "OpenSSL" in out.stdout
    assert not (ROOT / "ssl" / "__init__.py").exists()


def test_python_dash_m_from_root_keeps_stdlib_ssl():
    out = subprocess.run([sys.executable, "-m", "resmlp.core.cli", "help"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    check = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, ''); import ssl; "
                            "assert hasattr(ssl, 'SSLContext'), ssl.__path__"], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


# ---- config -----------------------------------------------------------------------------
def test_config_merges_method_data_and_overrides():
    cfg = load_config("dino", "resmlp_s24", ["epochs=3", "data.subset=100", "demo=false"])
    assert cfg.command == "dino" and cfg.model.name == "resmlp_s24"
    assert cfg.epochs == 3 and cfg.data.subset == 100
    assert cfg.data.name == "fashion_mnist"            # the embedded default
    assert cfg.model.img_size == cfg.data.img_size      # follows the dataset
    assert cfg.dino.student_temp == 0.1                  # method file
    assert cfg.dino.out_dim == 16384                     # recipe/dino_fashion_mnist.yaml


def test_data_selector_picks_dataset_file():
    cfg = load_config("dino", "resmlp_s12", ["data=imagenet", "data.root=/x", "demo=false"])
    assert cfg.data.name == "imagenet" and cfg.data.img_size == 224 and cfg.model.patch_size == 16
    assert cfg.epochs == 300                             # recipe/dino_imagenet.yaml


def test_misspelled_key_is_named():
    with pytest.raises(UserError, match="epohcs"):
        load_config("dino", "resmlp_s12", ["epohcs=3"])
    with pytest.raises(UserError, match="dino.teacher_tmp"):
        load_config("dino", "resmlp_s12", ["dino.teacher_tmp=0.07"])


def test_bad_value_and_bad_argument_and_unknown_data():
    with pytest.raises(UserError, match="epochs"):
        load_config("dino", "resmlp_s12", ["epochs=many"])
    with pytest.raises(UserError, match="key=value"):
        load_config("dino", "resmlp_s12", ["epochs"])
    with pytest.raises(UserError, match="unknown dataset 'mnistt'.*fashion_mnist"):
        load_config("dino", "resmlp_s12", ["data=mnistt"])


def test_the_demo_recipe_yields_to_the_command_line():
    cfg = load_config("dino", "resmlp_s12", ["demo=true", "epochs=2"])
    assert cfg.demo is True and cfg.epochs == 2 and cfg.model.dim == 64
    cfg = load_config("dino", "resmlp_s12", ["demo=false"])
    assert cfg.demo is False and cfg.model.dim is None


def test_saved_config_supplies_model_and_data():
    base = load_config("dino", "resmlp_s24", ["data=cifar10", "model.dim=64", "demo=false"])
    from omegaconf import OmegaConf
    cfg = load_config("knn", None, ["checkpoint=x"], base=OmegaConf.to_container(base))
    assert cfg.model.name == "resmlp_s24" and cfg.model.dim == 64 and cfg.data.name == "cifar10"


# ---- CLI --------------------------------------------------------------------------------
def test_cli_errors_are_one_line_with_exit_2(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ would appear here if a bad command started a run
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dino" in err[0] and "knn" in err[0]
    assert cli.main(["dino", "resmlp_s13"]) == 2
    err = capsys.readouterr().err
    assert "resmlp_s12" in err and "resmlp_s24" in err
    assert cli.main(["knn"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert cli.main(["dino", "resmlp_s12", "nonsense"]) == 2
    assert not (tmp_path / "runs").exists()


# What a new user may type: each is one line, exit 2, before anything is created.
BAD_NUMBERS = [("dino", "batch_size=0"), ("dino", "batch_size=-4"), ("supervised", "batch_size=0"),
               ("dino", "epochs=0"), ("dino", "epochs=2.5"), ("supervised", "epochs=-1"), ("dino", "optim.lr=0"),
               ("supervised", "optim.lr=-0.1"), ("dino", "num_workers=-1"), ("dino", "dino.n_local_crops=-1"),
               ("dino", "data.local_size=0"), ("dino", "data.local_size=-16"), ("knn", "k=0"), ("knn", "k=10,-1"),
               ("knn", "T=0"), ("knn", "T=-0.07"), ("dino", "eval_every=-1"), ("supervised", "ckpt_every=-1"),
               ("dino", "log_every=0"), ("dino", "slurm.nodes=0")]


@pytest.mark.parametrize("command,bad", BAD_NUMBERS)
def test_bad_numbers_are_one_line_before_anything_runs(command, bad, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = "timm:resmlp_12_224" if command == "knn" else "resmlp_s12"
    assert cli.main([command, source, bad, f"out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not allowed" in err[0] and "must be" in err[0], err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_a_moved_key_names_the_key_that_replaced_it(tmp_path, capsys):
    assert cli.main(["dino", "resmlp_s12", "dino.local_size=16", f"out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.local_size=16" in err[0], err
    assert not (tmp_path / "run").exists()


def test_the_few_label_keys_old_name_names_the_new_one(tmp_path, capsys):
    """knn.n_per_class / linear.n_per_class (and the short n_per_class=) became few_labels."""
    for argv, new in ((["dino", "resmlp_s12", "knn.n_per_class=[1,5]"], "knn.few_labels=[1,5]"),
                      (["knn", "timm:resmlp_12_224", "n_per_class=[1,5]"], "pass few_labels=[1,5]"),
                      (["linear", "timm:resmlp_12_224", "linear.n_per_class=[2]"], "linear.few_labels=[2]")):
        assert cli.main([*argv, f"out={tmp_path / 'run'}"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and new in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_limit_that_is_not_one_is_named():
    from resmlp.core.config import Limit
    assert Limit.from_spec({"above": 0, "max": 1}, "x").allows(1) and not Limit.from_spec({"above": 0}, "x").allows(0)
    for bad in ("positiv", {"max": 1}, {"min": 0, "above": 0}, {"min": 0, "upto": 1}):
        with pytest.raises(UserError, match="is not a limit"):
            Limit.from_spec(bad, "limits.x")


def test_out_naming_an_existing_file_is_refused_and_left_alone(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for command, source in (("dino", "resmlp_s12"), ("supervised", "resmlp_s12"), ("knn", "timm:resmlp_12_224")):
        assert cli.main([command, source, f"out={notes}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is an existing file" in err[0], err
    assert notes.read_text() == "mine"


@pytest.mark.parametrize("command", ["dino", "supervised"])
def test_failed_data_checks_leave_no_run_dir(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "resmlp_s12", "data=imagefolder", "demo=false"]) == 2
    assert cli.main([command, "resmlp_s12", "data=imagefolder", f"out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert all("data.root" in line for line in err if line.startswith("error:")), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_cli_unwraps_user_error_raised_in_a_worker():
    wrapped = RuntimeError("Caught UserError in DataLoader worker process 0.\nOriginal Traceback ...\n"
                           "resmlp.core.errors.UserError: /x/bad.jpg is not a readable image")
    assert "bad.jpg" in str(cli.unwrap_user_error(wrapped))
    assert cli.unwrap_user_error(ValueError("plain bug")) is None


def test_run_sh_help_and_unknown_command():
    out = run_sh("help")
    assert out.returncode == 0 and "dino <model>" in out.stdout and "resmlp_s12" in out.stdout
    bad = run_sh("nope")
    assert bad.returncode == 2 and "unknown command" in bad.stderr
    assert "Traceback" not in bad.stderr


# ---- checkpoints, resume ----------------------------------------------------------------
def test_checkpoint_roundtrip_and_errors(tmp_path):
    path = save_checkpoint(tmp_path / "c.pth", {"model": {"w": torch.ones(2)}, "epoch": 3})
    assert load_checkpoint(path)["epoch"] == 3
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(UserError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pth")
    (tmp_path / "notes.pth").write_text("not a checkpoint")
    with pytest.raises(UserError, match="is not a checkpoint: torch cannot read it"):
        load_checkpoint(tmp_path / "notes.pth")
    with pytest.raises(UserError, match="without checkpoint.pth"):
        load_checkpoint(tmp_path)


def test_resume_refuses_a_run_dir_of_another_model(tmp_path):
    cfg = load_config("dino", "resmlp_s12", [f"out={tmp_path}", "demo=false"])
    run = Run(cfg)
    run.save({"epoch": 1, "iteration": 1})
    other = load_config("dino", "resmlp_s24", [f"out={tmp_path}", "demo=false"])
    with pytest.raises(UserError, match="model.name: resmlp_s12 -> resmlp_s24"):
        Run(other)
    assert load_checkpoint(tmp_path)["epoch"] == 1   # nothing overwritten
    never = load_config("dino", "resmlp_s12", [f"out={tmp_path}", "demo=false", "resume=never"])
    with pytest.raises(UserError, match="already holds a checkpoint"):
        Run(never)


def test_config_differences_lists_nested_keys():
    diffs = config_differences({"model": {"dim": 1, "name": "a"}}, {"model": {"dim": 2, "name": "a"}})
    assert diffs == ["model.dim: 1 -> 2"]


# ---- schedules and parameter groups -----------------------------------------------------
def test_cosine_schedule_warmup_and_ends():
    s = cosine_schedule(1.0, 0.1, epochs=10, iters_per_epoch=10, warmup_epochs=2)
    assert len(s) == 100 and s[0] == 0.0 and abs(s[20] - 1.0) < 1e-12
    assert np.all(np.diff(s[:20]) > 0) and np.all(np.diff(s[20:]) <= 0)
    assert abs(s[-1] - 0.1) < 1e-3
    t = linear_warmup_then_constant(0.04, 0.07, 3, 10, 5)
    assert t[0] == 0.04 and t[15] == 0.07 and len(t) == 50


def test_param_groups_spare_affine_layerscale_and_biases():
    import timm
    model = timm.create_model("resmlp_12_224", pretrained=False, num_classes=0, img_size=32)
    decay, no_decay = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert "blocks.0.norm1.alpha" in no_decay_names            # 3-D in timm: shape rule alone fails
    assert "blocks.0.ls1" in no_decay_names and "blocks.0.mlp_channels.fc1.bias" in no_decay_names
    assert "blocks.0.linear_tokens.weight" in decay_names and "blocks.0.mlp_channels.fc1.weight" in decay_names
    assert no_decay["weight_decay"] == 0.0
