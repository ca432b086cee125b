"""Checkpoints out of this project (export for timm, the official code, safetensors) and the
package itself out of the source tree (a wheel install with its configs)."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from resmlp.core.checkpoint import save_checkpoint
from resmlp.core.cli import main
from resmlp.core.errors import UserError
from resmlp.models import create_model, detect_format, load_pretrained
from resmlp.eval.export import export

ROOT = Path(__file__).resolve().parent.parent


def randomized(model, seed):
    """Weights far from their init (LayerScale, Affine and biases too), so that a key mapped
    to the wrong place changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def dino_run(tmp_path, name="resmlp_s12", img_size=224, patch_size=16, **arch):
    """A run dir holding a DINO checkpoint (teacher != student) and its results.json."""
    teacher = randomized(create_model(name, num_classes=0, img_size=img_size, patch_size=patch_size, **arch), 0)
    student = randomized(create_model(name, num_classes=0, img_size=img_size, patch_size=patch_size, **arch), 1)
    run = tmp_path / "run"
    config = {"model": {"name": name, "img_size": img_size, "patch_size": patch_size, **arch},
              "data": {"name": "imagefolder", "img_size": img_size, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2],
                       "crop_ratio": 0.875}}
    save_checkpoint(run / "checkpoint.pth", {
        "command": "dino", "config": config, "epoch": 2, "iteration": 10,
        "teacher": {f"backbone.{k}": v for k, v in teacher.state_dict().items()},
        "student": {f"backbone.{k}": v for k, v in student.state_dict().items()}})
    (run / "results.json").write_text(json.dumps({"knn_top1": 61.5, "knn_top5": 88.0, "knn_k": 20, "knn_T": 0.07}))
    return run, teacher, student


def test_timm_export_loads_in_timm_with_the_same_outputs(tmp_path):
    import timm
    run, teacher, _ = dino_run(tmp_path)
    weights, card_path = export(run, "timm")
    card = json.loads(card_path.read_text())
    assert card["timm"]["model"] == "resmlp_12_224" and card["architecture"]["model"] == "resmlp_s12"
    assert card["data"]["mean"] == [0.5, 0.4, 0.3] and card["data"]["img_size"] == 224
    assert card["knn"]["knn_top1"] == 61.5 and card["source"]["key"] == "teacher"
    theirs = timm.create_model("resmlp_12_224", pretrained=True, num_classes=0,
                               pretrained_cfg_overlay=dict(file=str(weights))).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), teacher(x), rtol=1e-4, atol=1e-5)


def test_official_and_safetensors_exports_load_back(tmp_path):
    from safetensors.torch import load_file
    run, teacher, student = dino_run(tmp_path, img_size=32, patch_size=4, dim=32, depth=2)
    x = torch.randn(2, 3, 32, 32)
    weights, card = export(run, "official", key="student", out=str(tmp_path / "out"))
    sd = torch.load(weights)
    assert detect_format(sd) == "official" and "blocks.0.attn.weight" in sd and "blocks.0.gamma_1" in sd
    ours = create_model("resmlp_s12", num_classes=0, img_size=32, patch_size=4, dim=32, depth=2).eval()
    load_pretrained(ours, sd)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), student(x))
    timm_card = json.loads(card.read_text())["timm"]  # dim 32: no timm entry point of that size, its class
    assert timm_card["model"] is None and "checkpoint_filter_fn(torch.load(" in timm_card["load"]
    weights, card = export(run, "safetensors")
    assert weights.suffix == ".safetensors" and weights.parent == run / "export"
    ours = create_model("resmlp_s12", num_classes=0, img_size=32, patch_size=4, dim=32, depth=2).eval()
    load_pretrained(ours, load_file(str(weights)))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), teacher(x))


@pytest.mark.parametrize("fmt", ["timm", "official"])
def test_an_export_of_another_size_loads_back_through_its_cards_timm_entry(tmp_path, monkeypatch, fmt):
    """A 64-dim, 4-deep model at 32 px (no timm entry point of that size) from a run that
    trained on unlabeled images and was judged on a labeled set: the card's own timm line
    builds timm's MlpMixer and loads every key strictly, with our outputs; its k-NN names
    the labeled set it ran on."""
    run, teacher, _ = dino_run(tmp_path, img_size=32, patch_size=4, dim=64, depth=4)
    ckpt = torch.load(run / "checkpoint.pth", weights_only=False)
    ckpt["config"].update(data={**ckpt["config"]["data"], "name": "folder", "root": "/photos"},
                          eval={"data": "imagefolder", "root": "/labeled", "subset": None})
    save_checkpoint(run / "checkpoint.pth", ckpt)
    (run / "results.json").write_text(json.dumps({"knn_top1": 40.2, "knn_top5": 80.0, "knn_k": 20, "knn_T": 0.07,
                                                  "data": "folder", "eval_data": "imagefolder"}))
    weights, card_path = export(run, fmt)
    card = json.loads(card_path.read_text())
    entry = card["timm"]
    assert entry["model"] is None and entry["class"] == "timm.models.mlp_mixer.MlpMixer"
    assert entry["kwargs"] == {"num_classes": 0, "img_size": 32, "patch_size": 4, "embed_dim": 64, "num_blocks": 4,
                               "mlp_ratio": 4.0, "in_chans": 3}
    assert card["knn"]["data"]["name"] == "imagefolder" and card["knn"]["data"]["root"] == "/labeled"
    assert card["data"]["name"] == "folder"  # the normalization's: the training data's
    monkeypatch.chdir(weights.parent)  # the line names the file as the card does, beside it
    scope = {}
    exec(entry["load"], scope)  # its load_state_dict is strict: a key left out or over raises
    assert "strict=False" not in entry["load"]
    theirs = scope["model"].eval()
    # the README's snippet: the class with the card's kwargs
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    readme = MlpMixer(**entry["kwargs"], block_layer=ResBlock, norm_layer=Affine).eval()
    if fmt == "timm":
        readme.load_state_dict(torch.load(weights.name))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), teacher(x), rtol=1e-4, atol=1e-5)
        if fmt == "timm":
            torch.testing.assert_close(readme(x), teacher(x), rtol=1e-4, atol=1e-5)


def test_export_refuses_what_has_no_counterpart(tmp_path, capsys):
    run, _, _ = dino_run(tmp_path, img_size=32, patch_size=4, dim=32, depth=2, cross_patch="mlp")
    with pytest.raises(UserError, match="format=safetensors"):
        export(run, "timm")
    assert main(["export", str(run), "format=tflite"]) == 2
    assert "export.format=tflite is not allowed" in capsys.readouterr().err
    assert main(["export", str(run), "format=safetensors", f"out={tmp_path / 'x'}"]) == 0
    assert (tmp_path / "x" / "resmlp_s12_teacher_safetensors.json").exists()


def test_a_built_wheel_carries_its_configs(tmp_path):
    """pip wheel + install into a plain folder: `resmlp help` and a config load work from
    another directory, with no source tree and no editable install in sight."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info",
                                                             "__pycache__", ".whl", ".fmnist", ".gpu",
                                                             ".resmlp_path", ".pytest_cache"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("resmlp_ssl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"resmlp/configs/defaults.yaml", "resmlp/configs/method/dino.yaml",
            "resmlp/configs/data/fashion_mnist.yaml", "resmlp/core/config.py"} <= set(names)
    target = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert (target / "bin" / "resmlp").exists()
    # -S: no site processing, so no .pth file can bring in this checkout's editable install;
    # the dependencies come from site-packages added by hand, the package from the target.
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
            "from resmlp.core.cli import main\n"
            "from resmlp.core.config import CONFIG_DIR, load_config\n"
            f"assert str(CONFIG_DIR).startswith({str(target)!r}), CONFIG_DIR\n"
            "cfg = load_config('dino', 'resmlp_s12', ['data=imagenet', 'data.root=/x', 'demo=false'])\n"
            "assert cfg.epochs == 300 and cfg.data.local_size == 96\n"
            "sys.exit(main(['help']))\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=elsewhere, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: bash run.sh" in out.stdout and "export" in out.stdout
