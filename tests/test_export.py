"""The backbone leaves the project as ONNX and as a timm / Hugging Face Hub folder (issue 51,
parts 2 and 3): onnxruntime gives torch's features on random and real images, with a dynamic
batch, the chosen opset and the input in the metadata; timm.create_model("local-dir:...")
builds the folder with our features, with timm alone where timm has the size, for ResMLP-S12
and for the CPU demo's dim-64, depth-4 network. Bad inputs are one line, exit 2."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from resmlp.core.checkpoint import save_checkpoint
from resmlp.core.cli import main
from resmlp.core.errors import UserError
from resmlp.eval.export import export
from resmlp.eval.export_onnx import PACKAGES
from test_checkpoints import dino_run
from test_inputs import one_line_error

DEMO = dict(img_size=32, patch_size=4, dim=64, depth=4)   # the CPU demo's network (configs/recipe/demo/)
S12 = dict(img_size=224, patch_size=16)
needs_onnx = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in PACKAGES),
                                reason=f"{', '.join(PACKAGES)} are not all installed")


def run_with_results(tmp_path, linear: bool = True, **arch):
    """dino_run's run dir (teacher != student, k-NN in results.json), with the trainer's linear
    probe and the demo's data and recipe in its config."""
    torch.manual_seed(0)
    run, teacher, student = dino_run(tmp_path, **arch)
    ckpt = torch.load(run / "checkpoint.pth", weights_only=False)
    ckpt["config"].update(command="dino", epochs=8, batch_size=64, recipe=["dino_fashion_mnist", "demo"],
                          data={**ckpt["config"]["data"], "name": "fashion_mnist", "subset": 5000})
    save_checkpoint(run / "checkpoint.pth", ckpt)
    res = json.loads((run / "results.json").read_text())
    if linear:
        res.update(linear_top1=73.94, linear_top5=98.62, linear_lr=1.0)
    (run / "results.json").write_text(json.dumps(res))
    return run, teacher


def real_images(data: dict) -> torch.Tensor:
    """Two photos (scikit-learn's sample images) through this project's eval transform, set
    as the ONNX file's metadata says: its input size, crop and normalization."""
    from omegaconf import OmegaConf
    from PIL import Image
    from sklearn.datasets import load_sample_image

    from resmlp.data.transforms import build_eval_transform
    transform = build_eval_transform(OmegaConf.create(data))
    return torch.stack([transform(Image.fromarray(load_sample_image(name))) for name in ("china.jpg", "flower.jpg")])


# ---- format=onnx ----------------------------------------------------------------------------------
@needs_onnx
@pytest.mark.parametrize("arch", [pytest.param(DEMO, id="demo"), pytest.param(S12, id="s12", marks=pytest.mark.slow)])
def test_onnx_runs_under_onnxruntime_with_torchs_features(tmp_path, arch):
    import onnx
    import onnxruntime as ort
    run, teacher = run_with_results(tmp_path, **arch)
    weights, card_path = export(run, "onnx")
    card = json.loads(card_path.read_text())
    assert weights.suffix == ".onnx" and card["onnx"]["opset"] == 18 and card["onnx"]["checked"]["max_abs_diff"] < 1e-4
    proto = onnx.load(str(weights))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [18]
    assert not list(weights.parent.glob("*.data")), "the weights are inside the one file"
    (batch, *sizes), = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input]
    side = arch["img_size"]
    assert isinstance(batch, str) and sizes == [3, side, side]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["input_size"]) == [3, side, side] and json.loads(meta["mean"]) == [0.5, 0.4, 0.3]
    assert json.loads(meta["std"]) == [0.2, 0.2, 0.2] and json.loads(meta["crop_pct"]) == 0.875
    assert meta["interpolation"] == "bicubic" and meta["weights_hash"] == card["source"]["weights_hash"]

    session = ort.InferenceSession(str(weights), providers=["CPUExecutionProvider"])
    data = {"img_size": side, "crop_ratio": float(meta["crop_pct"]), "mean": json.loads(meta["mean"]),
            "std": json.loads(meta["std"])}
    g = torch.Generator().manual_seed(1)
    for x in (torch.randn(1, 3, side, side, generator=g), torch.randn(5, 3, side, side, generator=g),
              real_images(data)):
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        with torch.no_grad():
            want = teacher(x)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-4


@needs_onnx
def test_onnx_writes_the_opset_asked_and_refuses_one_outside_its_limits(tmp_path, capsys):
    import onnx
    run, _ = run_with_results(tmp_path, **DEMO)
    out = tmp_path / "onnx"
    assert main(["export", str(run), "format=onnx", "opset=21", f"out={out}"]) == 0
    assert "wrote" in capsys.readouterr().out
    proto = onnx.load(str(out / "resmlp_s12_teacher_onnx.onnx"))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [21]
    assert main(["export", str(run), "format=onnx", "opset=17", f"out={tmp_path / 'low'}"]) == 2
    assert "export.opset=17 is not allowed" in one_line_error(capsys)
    assert not (tmp_path / "low").exists()


def test_onnx_without_its_packages_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    run, _ = run_with_results(tmp_path, **DEMO)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript"
                        else find_spec(name, *a))
    assert main(["export", str(run), "format=onnx"]) == 2
    line = one_line_error(capsys)
    assert "format=onnx needs onnxscript" in line and "pip install onnxscript" in line
    assert not (run / "export").exists()


# ---- format=hub -----------------------------------------------------------------------------------
def timm_alone(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a Python that has timm and torch but not this project: no site processing
    (so no editable install's .pth file), site-packages added by hand, no PYTHONPATH."""
    head = (f"import sys; sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
            "import importlib.util; assert importlib.util.find_spec('resmlp') is None, 'the project is in sight'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-S", "-c", head + code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def readme_python(folder: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)


@pytest.mark.slow
def test_a_hub_folder_of_s12_loads_in_timm_alone_by_name(tmp_path):
    """S12 has timm's entry point resmlp_12_224: config.json names it, and a Python without this
    project builds the folder through timm.create_model("local-dir:...") with our features."""
    run, teacher = run_with_results(tmp_path, **S12)
    folder, card_path = export(run, "hub")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resmlp_12_224" and config["num_classes"] == 0
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 224, 224] and cfg["mean"] == [0.5, 0.4, 0.3] and cfg["crop_pct"] == 0.875
    assert cfg["interpolation"] == "bicubic"
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    done = timm_alone(f"import timm, torch\n"
                      f"model = timm.create_model('local-dir:{folder}', pretrained=True).eval()\n"
                      "assert type(model).__name__ == 'MlpMixer', type(model)\n"
                      "cfg = timm.data.resolve_model_data_config(model)\n"
                      "assert list(cfg['mean']) == [0.5, 0.4, 0.3] and cfg['input_size'] == (3, 224, 224), cfg\n"
                      "with torch.no_grad(): torch.save(model(torch.load('x.pt')), 'timm.pt')\n", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        assert (torch.load(tmp_path / "timm.pt") - teacher(x)).abs().max() <= 1e-5
    card = json.loads(card_path.read_text())
    assert card["load"] == f"import timm; timm.create_model('local-dir:{folder}', pretrained=True)"
    assert card["hub"]["timm_alone"] and "hf upload <user>/<repo>" in card["hub"]["upload"]


def test_the_hub_config_is_laid_out_as_timms_own_export(tmp_path):
    """timm's save_config_for_hf (what push_to_hf_hub writes) of the same model and data
    config: the same top-level fields and model_args, and our pretrained_cfg's values are its."""
    import timm
    from timm.models._hub import save_config_for_hf
    run, _ = run_with_results(tmp_path, **S12)
    folder, _ = export(run, "hub")
    ours = json.loads((folder / "config.json").read_text())
    model = timm.create_model("resmlp_12_224", num_classes=0, img_size=224)
    save_config_for_hf(model, tmp_path / "timm.json", data_config={
        "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.2, 0.2), "crop_pct": 0.875, "interpolation": "bicubic"})
    theirs = json.loads((tmp_path / "timm.json").read_text())
    assert ours.keys() == theirs.keys() and ours["model_args"] == theirs["model_args"]
    assert {k: v for k, v in theirs["pretrained_cfg"].items() if k in ours["pretrained_cfg"]} == ours["pretrained_cfg"]
    assert set(theirs["pretrained_cfg"]) - set(ours["pretrained_cfg"]) == {"tag", "license"}  # timm's release's


def test_a_hub_folder_of_the_demos_size_loads_in_timm_and_by_timm_alone(tmp_path):
    """dim 64, depth 4, 4 px patches at 32 px: timm's resmlp_* entry points cannot take those
    sizes, so config.json names our builder; timm.create_model("local-dir:...") builds it once
    resmlp.models is imported, and the card's MlpMixer lines build it with timm alone."""
    import timm
    run, teacher = run_with_results(tmp_path, **DEMO)
    folder, card_path = export(run, "hub")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == "resmlp_s12"
    assert config["model_args"] == {"num_classes": 0, "img_size": [32, 32], "in_chans": 3, "dim": 64, "depth": 4,
                                    "patch_size": 4, "mlp_ratio": 4.0}
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(x)
        model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        assert (model(x) - want).abs().max() <= 1e-5
        data = timm.data.resolve_model_data_config(model)
        assert data["mean"] == [0.5, 0.4, 0.3] and data["input_size"] == (3, 32, 32)
        tuned = timm.create_model(f"local-dir:{folder}", pretrained=True, num_classes=10).eval()  # a new head
        assert tuned(x).shape == (3, 10)
        assert (tuned.forward_head(tuned.forward_features(x), pre_logits=True) - want).abs().max() <= 1e-5
    torch.save(x, tmp_path / "x.pt")
    _, alone = readme_python(folder)
    done = timm_alone(f"import timm, torch\ntry:\n    timm.create_model('local-dir:{folder}')\n"
                      "except RuntimeError as e:\n    assert 'Unknown model' in str(e)\n"
                      "else:\n    raise AssertionError('timm alone built it')\n"
                      f"import os; os.chdir({str(folder)!r})\n{alone}"
                      f"with torch.no_grad(): torch.save(model.eval()(torch.load({str(tmp_path / 'x.pt')!r})), "
                      f"{str(tmp_path / 'timm.pt')!r})\n", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (torch.load(tmp_path / "timm.pt") - want).abs().max() <= 1e-5
    assert json.loads(card_path.read_text())["load"].startswith("import resmlp.models, timm; timm.create_model(")


def test_the_model_card_says_data_recipe_epochs_results_and_how_to_load(tmp_path):
    run, _ = run_with_results(tmp_path, **DEMO)
    folder, _ = export(run, "hub")
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\n")
    for words in ("| data | fashion_mnist, 5000 images, 32 px |", "| recipe | dino_fashion_mnist, demo |",
                  "| epochs | 2 of 8 |", "| batch | 64 images (global) |",
                  "k-NN top-1 **61.50**, top-5 88.00 (DINO's weighted k-NN: cosine similarity, k=20, T=0.07",
                  "linear probe top-1 **73.94**, top-5 98.62",
                  "SGD over a learning-rate grid, the best on the test split",
                  "to 37 px on the shorter side (crop_pct 0.875) and center-cropped to 32x32",
                  "timm.create_model('hf-hub:<user>/<repo>', pretrained=True)",
                  "hf upload <user>/<repo> <this folder>", "mean [0.5, 0.4, 0.3]"):
        assert words in card, words
    run2, _ = run_with_results(tmp_path / "b", linear=False, **DEMO)
    (run2 / "results.json").write_text("{}")
    assert "No k-NN or linear probe of these weights was found" in (export(run2, "hub")[0] / "README.md").read_text()


def test_a_hub_folder_is_not_written_over_other_content(tmp_path, capsys):
    """A folder of the hub folder's name that no export card describes is refused, also in a
    folder of earlier exports (which out= takes); out_ok=true writes the three files and keeps
    the others; the same weights are written again."""
    run, _ = run_with_results(tmp_path, **DEMO)
    out = tmp_path / "out"
    folder = out / "resmlp_s12_teacher_hub"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    assert main(["export", str(run), "format=hub", f"out={out}"]) == 2
    assert "out_ok=true" in one_line_error(capsys)   # out= itself holds files of another
    assert main(["export", str(run), "format=safetensors", f"out={out}", "out_ok=true"]) == 0
    capsys.readouterr()
    assert main(["export", str(run), "format=hub", f"out={out}"]) == 2   # out= has our card now: the folder's own check
    line = one_line_error(capsys)
    assert f"{folder} holds a file no export card describes" in line and "out_ok=true" in line
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert main(["export", str(run), "format=hub", f"out={out}", "out_ok=true"]) == 0
    assert "hf upload <user>/<repo>" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors", "notes.txt"]
    assert main(["export", str(run), "format=hub", f"out={out}"]) == 0   # the same weights again
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary folder left"


def test_hub_needs_the_papers_resmlp(tmp_path, capsys):
    run, _, _ = dino_run(tmp_path, img_size=32, patch_size=4, dim=32, depth=2, cross_patch="mlp")
    assert main(["export", str(run), "format=hub"]) == 2
    assert "format=safetensors" in one_line_error(capsys)
    assert not (run / "export").exists()


def test_our_builder_reads_a_folder_from_the_hub_where_timm_says(tmp_path, monkeypatch):
    """hf-hub:<user>/<repo>@<revision>: timm hands our builder the config's source; the weights
    come from huggingface_hub's download of model.safetensors at that revision."""
    import huggingface_hub

    from resmlp.models import create_model
    from resmlp.models.registry import load_hub_weights
    run, teacher = run_with_results(tmp_path, **DEMO)
    folder, _ = export(run, "hub")
    asked = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, revision=None: asked.append((repo, name, revision)) or str(folder / name))
    model = create_model("resmlp_s12", num_classes=0, **DEMO).eval()
    load_hub_weights(model, {"source": "hf-hub", "hf_hub_id": "me/demo@v1"}, "resmlp_s12")
    assert asked == [("me/demo", "model.safetensors", "v1")]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (model(x) - teacher(x)).abs().max() <= 1e-5
    with pytest.raises(UserError, match="no downloadable weights"):
        load_hub_weights(model, None, "resmlp_s12")


@needs_onnx
def test_onnx_takes_the_ablations_the_timm_formats_refuse(tmp_path):
    """Conv cross-patch, LayerNorm and class-MLP pooling together: no timm counterpart, but
    folded and exported as ONNX with torch's features."""
    import onnxruntime as ort
    torch.manual_seed(0)
    run, teacher, _ = dino_run(tmp_path, img_size=32, patch_size=4, dim=32, depth=2, cross_patch="conv3x3",
                               norm="layernorm", pooling="class_mlp")
    weights, _ = export(run, "onnx")
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    got = ort.InferenceSession(str(weights), providers=["CPUExecutionProvider"]).run(None, {"images": x.numpy()})[0]
    with torch.no_grad():
        assert (torch.from_numpy(got) - teacher(x)).abs().max() <= 1e-4
