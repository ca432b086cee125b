"""A weights file never runs code (issue 44): every file is read by core.checkpoint's loader,
weights only. What users bring loads (timm's and bare state_dicts, timm's and DeiT's training
checkpoints, the official ResMLP and DINO checkpoints, .safetensors files); this project's
checkpoints hold only tensors and plain values, and those its code wrote before (numpy's RNG
state and learning rates pickled) still resume, exactly; a file that asks for anything else is
refused by every command that reads weights, in one line, exit 2, before any work, its code
not run, unless weights_trust=true says its source is trusted."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from resmlp.core.checkpoint import (SAFE_GLOBALS, TRUST_KEY, UnsafeFile, load_checkpoint, plain, rng_state,
                                    save_checkpoint, set_rng_state, trusting)
from resmlp.core.cli import main
from resmlp.core.config import load_config, save_config

from kit import PRODUCT
from test_dino import needs_fmnist
from test_dino_init import timm_file
from test_folder import labeled
from test_inputs import one_line_error

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "dino_c11c829"
PACKAGE = (*PRODUCT, "tools", "studies")
SYSTEM = f"{os.system.__module__}.{os.system.__name__}"   # what a pickle names os.system by (posix.system)

LAB = ["data=imagefolder", "data.img_size=16", "data.crop_ratio=1.0"]
NET = ["demo=false", "model.dim=16", "model.depth=2", "model.patch_size=4", "num_workers=0", "batch_size=4",
       "epochs=1", "eval_every=0", "log_every=1"]
DINO = [*NET, "data.local_size=8", "dino.out_dim=32", "dino.hidden_dim=16", "dino.bottleneck_dim=8",
        "dino.n_local_crops=2", "dino.final_linear=false"]
SUP = [*NET, "aug.mixup=0", "aug.cutmix=0", "aug.auto_augment=null", "aug.re_prob=0", "optim.warmup_epochs=0"]


def old_run_args() -> list[str]:
    """The overrides tests/fixtures/dino_c11c829 was made with (its make_old_dino_run.py)."""
    spec = importlib.util.spec_from_file_location("make_old_dino_run", FIXTURE.parent / "make_old_dino_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ARGS


class RunsCode:
    """What a file made to run a command as it loads holds: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@dataclass
class Provenance:
    """A class of the user's own beside the weights: not code that does harm, but nothing a
    weights-only load may build."""
    source: str


class OwnArgs(argparse.Namespace):
    """A subclass of the one class allowed: another class."""


def tree(root: Path) -> dict:
    """Every file and folder under `root`, a file with its size and modification time (a
    folder's changes when a command tries whether it can write there)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


def tiny_teacher_sd() -> dict:
    """A DINO teacher of this project's layout (backbone.*), its weights random."""
    from resmlp.models import create_model
    net = create_model("resmlp_s12", dim=16, depth=2, patch_size=4, img_size=16, num_classes=0)
    return {f"backbone.{k}": v for k, v in net.state_dict().items()}


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A clean folder to run in (its runs/ would show a default run dir), a tiny labeled image
    folder, and a file made to run `touch <marker>` when unpickled: a teacher's weights and
    one object whose unpickling calls os.system."""
    monkeypatch.chdir(tmp_path)
    lab = labeled(tmp_path / "lab")
    marker = tmp_path / "code_ran"
    evil = tmp_path / "weights" / "teacher.pth"
    evil.parent.mkdir()
    torch.save({"teacher": tiny_teacher_sd(), "note": RunsCode(f"touch {marker}")}, evil)
    return {"lab": lab, "marker": marker, "evil": evil, "tmp": tmp_path}


# ---- refused: each command that reads weights ------------------------------------------------------

COMMANDS = {
    "knn": ["knn", "{evil}", *LAB, "data.root={lab}"],
    "embed": ["embed", "{evil}", *LAB, "data.root={lab}"],
    "linear": ["linear", "{evil}", *LAB, "data.root={lab}"],
    "viz": ["viz", "{evil}", *LAB, "data.root={lab}"],
    "export": ["export", "{evil}"],
    "finetune": ["finetune", "{evil}", *LAB, "data.root={lab}", *SUP],
    "dino.init": ["dino", "resmlp_s12", *DINO, *LAB, "data.root={lab}", "dino.init={evil}"],
    "distill": ["distill", "resmlp_s12", *SUP, *LAB, "data.root={lab}", "teacher={evil}"],
    "compare": ["compare", "resmlp_s12", "demo=false", *LAB, "data.root={lab}", "compare.teacher={evil}"],
}


def assert_refused(argv: list[str], file: Path, world: dict, capsys, asks: str = SYSTEM) -> str:
    """The command exits 2 with one line naming the file, what it asks for and the key that
    trusts it; the file's code did not run and nothing was made."""
    before = tree(world["tmp"])
    out = world["tmp"] / "out"
    assert main([*argv, f"out={out}"]) == 2
    line = one_line_error(capsys)
    assert str(file) in line and f"would call {asks}" in line and f"pass {TRUST_KEY}=true" in line, line
    assert not world["marker"].exists(), "the file's code ran"
    assert not out.exists() and tree(world["tmp"]) == before   # no run dir, no runs/, no cache, no file touched
    return line


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_reads_weights_refuses_a_file_that_would_run_code(command, world, capsys):
    argv = [a.format(**world) for a in COMMANDS[command]]
    assert_refused(argv, world["evil"], world, capsys)


def test_resuming_a_run_dir_whose_checkpoint_would_run_code_is_refused(world, capsys):
    """The run's own checkpoint.pth replaced by such a file: refused before the run dir is
    touched (no log, no lock, no TensorBoard file), not taken for a damaged one whose previous
    checkpoint would do."""
    run = world["tmp"] / "out"
    argv = ["dino", "resmlp_s12", *DINO, *LAB, f"data.root={world['lab']}"]
    save_config(load_config("dino", "resmlp_s12", [*argv[2:], f"out={run}"]), run / "config.yaml")
    shutil.copy(world["evil"], run / "checkpoint.pth")
    save_checkpoint(run / "checkpoint_prev.pth", {"iteration": 1, "epoch": 0, "rng": rng_state()})
    before = tree(world["tmp"])
    assert main([*argv, f"out={run}"]) == 2
    line = one_line_error(capsys)
    assert f"{run / 'checkpoint.pth'} is not a file of weights only" in line and f"would call {SYSTEM}" in line
    assert not world["marker"].exists() and tree(world["tmp"]) == before


def test_what_is_refused_is_named_in_either_of_torchs_formats(tmp_path):
    """torch's older (non-zip) format too; a file asking for several things names each."""
    legacy = tmp_path / "legacy.pth"
    torch.save({"model": {}, "x": RunsCode("true")}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeFile, match=f"would call {SYSTEM} "):
        load_checkpoint(legacy)
    both = tmp_path / "both.pth"
    torch.save({"model": {}, "x": RunsCode("true"), "y": Provenance("lab")}, both)
    with pytest.raises(UnsafeFile, match=f"would call {SYSTEM}, {__name__}.Provenance "):
        load_checkpoint(both)


def test_weights_trust_loads_a_trusted_file(world, capsys):
    """A file holding a class of the user's own is refused, naming the class; with
    weights_trust=true it loads (the checkpoint read before the config is built, and the
    command's own read), and export writes its weights."""
    path, timm_model = timm_file(world["tmp"] / "weights" / "resmlp.pth", img_size=16)
    sd = timm_model.state_dict()
    torch.save({"model": sd, "provenance": Provenance("our lab")}, path)
    assert_refused(["export", str(path)], path, world, capsys, asks=f"{__name__}.Provenance")
    out = world["tmp"] / "out"
    assert main(["export", str(path), f"{TRUST_KEY}=true", f"out={out}"]) == 0
    exported = torch.load(next(out.glob("*.pth")), weights_only=True)
    assert exported.keys() == sd.keys() and all(torch.equal(exported[k], sd[k]) for k in sd)
    with trusting():
        assert load_checkpoint(path)["provenance"] == Provenance("our lab")


def test_weights_trust_changes_no_result():
    """A finished run asked for again with weights_trust=true is the run asked for."""
    from resmlp.core.config import to_dict
    from resmlp.core.run_folder import settings_differences
    asked = [to_dict(load_config("dino", "resmlp_s12", ["demo=false", *trust])) for trust in ([], [f"{TRUST_KEY}=true"])]
    assert asked[1][TRUST_KEY] is True and settings_differences(*asked) == []


def test_a_command_that_reads_no_weights_does_not_take_weights_trust(tmp_path, capsys):
    assert main(["data", f"{TRUST_KEY}=true", f"out={tmp_path / 'out'}"]) == 2
    assert f"does not read {TRUST_KEY}" in one_line_error(capsys)


# ---- what users bring loads ----------------------------------------------------------------------

def layouts(folder: Path) -> tuple[dict, torch.nn.Module]:
    """The same weights (a random timm ResMLP, timm's MlpMixer with ResBlock and Affine) in
    every layout users bring, built here: {name: file}, and timm's model."""
    from safetensors.torch import save_file

    from resmlp.models import convert_state_dict, export_state_dict
    bare, model = timm_file(folder / "timm.pth")
    sd = model.state_dict()
    official = export_state_dict(convert_state_dict(sd), "official")
    args = argparse.Namespace(model="resmlp_12_224", lr=5e-3, epochs=400, output_dir="/checkpoints")
    adam = {"state": {}, "param_groups": [{"lr": 5e-3, "betas": (0.9, 0.999), "params": [0, 1]}]}
    files = {
        "timm state_dict": bare,
        # timm's train.py: the weights under state_dict, its argparse arguments beside them
        "timm training checkpoint": ({"epoch": 3, "arch": "resmlp_12_224", "state_dict": sd, "optimizer": adam,
                                      "version": 2, "args": args, "metric": 71.5}, "timm_train.pth.tar"),
        # facebookresearch/deit main.py: the official keys under model, the run's state beside them
        "DeiT checkpoint": ({"model": official, "optimizer": adam, "epoch": 399, "args": args,
                             "lr_scheduler": {"base_values": [5e-3], "t_initial": 400, "noise_range_t": None},
                             "scaler": {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 0}}, "deit.pth"),
        "official ResMLP release": ({"model": official}, "resmlp_official.pth"),
        # facebookresearch/dino main_dino.py: student and teacher (DDP's module.), the loss's center
        "official DINO checkpoint": ({"student": {f"module.backbone.{k}": v for k, v in sd.items()},
                                      "teacher": {f"backbone.{k}": v for k, v in sd.items()}, "optimizer": adam,
                                      "epoch": 100, "args": argparse.Namespace(arch="resmlp", out_dim=65536),
                                      "dino_loss": {"center": torch.zeros(1, 8)}, "fp16_scaler": None},
                                     "dino_official.pth"),
    }
    for name, value in list(files.items()):
        if isinstance(value, tuple):
            torch.save(value[0], folder / value[1])
            files[name] = folder / value[1]
    files["timm .safetensors"] = folder / "timm.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, files["timm .safetensors"])
    return files, model


def test_every_layout_users_bring_loads_the_same_weights(tmp_path):
    from resmlp.eval.export import export
    from resmlp.models.load import load_backbone
    files, timm_model = layouts(tmp_path)
    files["this project's .safetensors export"] = export(files["timm state_dict"], "safetensors",
                                                         out=str(tmp_path / "export"))[0]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = timm_model(x)
    hashes = {}
    for name, path in files.items():
        model, info = load_backbone(path)
        hashes[name] = info["weights_hash"]
        with torch.no_grad():
            assert torch.allclose(model(x), want, atol=1e-5, rtol=1e-5), name
    assert len(set(hashes.values())) == 1, hashes


def test_a_safetensors_file_is_taken_as_dino_init_and_as_a_teacher(tmp_path):
    import timm
    from safetensors.torch import save_file

    from resmlp.models.load import load_classifier
    from test_dino_init import start_for
    files, _ = layouts(tmp_path)
    _, from_pth = start_for(tmp_path / "a", f"dino.init={files['timm state_dict']}")
    _, from_st = start_for(tmp_path / "b", f"dino.init={files['timm .safetensors']}")
    assert from_st.info["source"] == "state_dict" and from_st.backbone.keys() == from_pth.backbone.keys()
    assert all(torch.equal(from_st.backbone[k], v) for k, v in from_pth.backbone.items())

    torch.manual_seed(0)
    classifier = timm.create_model("test_vit", num_classes=3).eval()
    save_file(classifier.state_dict(), tmp_path / "teacher.safetensors")
    teacher, name = load_classifier(tmp_path / "teacher.safetensors", "test_vit")
    x = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        assert name == "test_vit" and torch.equal(teacher(x), classifier(x))


def test_a_safetensors_file_that_cannot_be_read_is_one_line(world, capsys):
    """A .safetensors file cut short, or whose header is not JSON: not a checkpoint, named,
    exit 2, nothing made."""
    from safetensors.torch import save_file
    whole = world["tmp"] / "whole.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(whole))
    data = whole.read_bytes()
    header = int.from_bytes(data[:8], "little")
    for name, broken in (("short", data[:8 + header + 100]), ("header", data[:9] + b"x" * (header - 1) + data[8 + header:])):
        path = world["tmp"] / f"{name}.safetensors"
        path.write_bytes(broken)
        before = tree(world["tmp"])
        out = world["tmp"] / "out"
        assert main(["export", str(path), f"out={out}"]) == 2
        line = one_line_error(capsys)
        assert f"{path} is not a checkpoint: safetensors cannot read it" in line, line
        assert not out.exists() and tree(world["tmp"]) == before


def test_the_loaders_allow_one_class_beyond_numpys(tmp_path):
    """argparse.Namespace (DINO's and DeiT's args) is the one class besides the stand-ins
    registered under the numpy names of this project's older checkpoints (core.checkpoint's
    own: numpy's ndarray and dtype are never called, issue 50); a subclass of it, or any
    other class, is refused."""
    assert [g for g in SAFE_GLOBALS if not isinstance(g, tuple)] == [argparse.Namespace]
    stand_ins = [g for g in SAFE_GLOBALS if isinstance(g, tuple)]
    assert {name for _, name in stand_ins} == {"numpy.dtype", "numpy.ndarray",
                                               *(f"numpy.{c}.multiarray.{f}" for c in ("_core", "core")
                                                 for f in ("_reconstruct", "scalar"))}
    assert all(f.__module__ == "resmlp.core.checkpoint" for f, _ in stand_ins)

    torch.save({"args": OwnArgs(lr=1.0)}, tmp_path / "sub.pth")
    with pytest.raises(UnsafeFile, match=f"would call {__name__}.OwnArgs "):
        load_checkpoint(tmp_path / "sub.pth")


# ---- this project's checkpoints: tensors and plain values --------------------------------------------

def weights_only(path: Path) -> dict:
    """torch's own weights-only load, without this project's allowances (SAFE_GLOBALS)."""
    return torch.load(path, weights_only=True)


def test_plain_turns_numpy_into_python_and_leaves_the_rest_as_it_is():
    sd = torch.nn.Linear(2, 2).state_dict()
    state = {"model": sd, "optimizer": {"param_groups": [{"lr": np.float64(0.25), "betas": (0.9, np.float32(0.5))}]},
             "table": np.arange(3, dtype=np.uint32), "n": 4}
    out = plain(state)
    assert out["model"] is sd and out["model"]._metadata == sd._metadata          # untouched, metadata kept
    group = out["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == 0.25 and group["betas"] == (0.9, 0.5)
    assert type(group["betas"][1]) is float and out["table"] == [0, 1, 2] and out["n"] == 4
    assert type(state["optimizer"]["param_groups"][0]["lr"]) is np.float64         # the caller's is not changed
    assert plain(out) is out


def draws() -> tuple:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_rng_state_is_plain_and_restores_every_generator_exactly(tmp_path):
    """The state saved and read back weights-only (torch's own allowlist) continues each
    generator where it was; the states older checkpoints hold (numpy's own tuple, its key
    an ndarray) do too."""
    saved = rng_state()
    want = draws()
    save_checkpoint(tmp_path / "rng.pth", {"rng": saved})
    set_rng_state(weights_only(tmp_path / "rng.pth")["rng"])
    assert draws() == want
    older = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    want = draws()
    set_rng_state(older)
    assert draws() == want


@pytest.mark.slow
@needs_fmnist
def test_the_checkpoints_of_each_trainer_load_weights_only(tmp_path):
    """DINO's, supervised training's (with EMA), distillation's and fine-tuning's checkpoints
    hold nothing torch's weights-only load refuses (no numpy: the schedules' learning rates
    are numpy floats until saved)."""
    fm = ["data.subset=32", "data.img_size=16", "model.patch_size=4", "eval_limit=32", "eval_batch_size=32"]
    dino = ["dino", "resmlp_s12", *DINO, "data.subset=32", "data.img_size=16", "optim.warmup_epochs=0"]
    runs = {"dino": dino,
            "supervised": ["supervised", "resmlp_s12", *SUP, *fm, "ema.enabled=true"],
            "distill": ["distill", "resmlp_s12", *SUP, *fm, f"teacher={tmp_path / 'supervised'}"],
            "finetune": ["finetune", str(tmp_path / "dino"), *SUP, "finetune.min_steps=0", "eval_limit=32",
                         "eval_batch_size=32"]}
    for name, argv in runs.items():
        assert main([*argv, f"out={tmp_path / name}"]) == 0, name
        ckpt = weights_only(tmp_path / name / "checkpoint.pth")
        assert {"optimizer", "rng", "config", "iteration"} <= ckpt.keys(), name
        assert isinstance(ckpt["rng"]["numpy"]["state"]["key"], torch.Tensor)


# ---- the checkpoints this project's code wrote before ---------------------------------------------------

def test_the_fixture_is_what_the_older_code_wrote():
    """The fixture needs the numpy names SAFE_GLOBALS allows, and only those (so it tests
    them); it loads without weights_trust."""
    for name in ("checkpoint.pth", "checkpoint_prev.pth"):
        with pytest.raises(Exception, match="numpy"):
            weights_only(FIXTURE / name)
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            assert not torch.serialization.get_unsafe_globals_in_checkpoint(FIXTURE / name)
    old = load_checkpoint(FIXTURE / "checkpoint.pth")
    assert old["iteration"] == 6 and isinstance(old["rng"]["numpy"], tuple)


def old_run(dest: Path, args: list[str], files=("checkpoint.pth", "checkpoint_prev.pth", "log.jsonl")) -> Path:
    """The fixture's run dir, copied, with the config.yaml today's code makes of its overrides
    (the checkpoint's own is compared by config.yaml's keys: a key added to model: or data:
    since would make it another config)."""
    dest.mkdir(parents=True)
    for name in files:
        shutil.copy(FIXTURE / name, dest / name)
    save_config(load_config("dino", "resmlp_s12", [*args, f"out={dest}"]), dest / "config.yaml")
    return dest


@pytest.mark.slow
@needs_fmnist
def test_a_checkpoint_of_the_older_code_resumes_exactly(tmp_path, capsys):
    """The fixture's mid-epoch checkpoint (numpy's RNG state an ndarray, learning rates numpy
    floats) resumes to the end; the same checkpoint in today's format (its RNG states as
    set_rng_state reads them and rng_state writes them) resumes to the same weights bit for
    bit, and the run's checkpoints are in today's format from its first save on."""
    args = old_run_args()
    old = load_checkpoint(FIXTURE / "checkpoint.pth")
    set_rng_state(old["rng"])   # the older tuple restores numpy exactly
    assert np.array_equal(np.random.get_state()[1], old["rng"]["numpy"][1])
    assert random.getstate() == old["rng"]["python"] and torch.equal(torch.get_rng_state(), old["rng"]["torch"])

    as_old = old_run(tmp_path / "old", args)
    as_new = old_run(tmp_path / "new", args, files=("log.jsonl",))
    save_checkpoint(as_new / "checkpoint.pth", {**{k: v for k, v in old.items() if k != "format"}, "rng": rng_state()})
    assert weights_only(as_new / "checkpoint.pth")["iteration"] == 6   # no numpy left
    for run in (as_old, as_new):
        capsys.readouterr()
        assert main(["dino", "resmlp_s12", *args, f"out={run}"]) == 0
        assert f"resuming from {run / 'checkpoint.pth'} (epoch 1, iteration 6)" in capsys.readouterr().out
    a, b = (weights_only(run / "checkpoint.pth") for run in (as_old, as_new))
    assert a["iteration"] == b["iteration"] == 8
    for key in ("teacher", "student", "center"):
        want = b[key] if isinstance(b[key], dict) else {"": b[key]}
        got = a[key] if isinstance(a[key], dict) else {"": a[key]}
        assert all(torch.equal(got[k], v) for k, v in want.items()), key


@pytest.mark.slow
@needs_fmnist
def test_the_older_codes_previous_checkpoint_resumes_when_the_latest_is_gone(tmp_path, capsys):
    args = old_run_args()
    run = old_run(tmp_path / "run", args, files=("checkpoint_prev.pth", "log.jsonl"))
    assert main(["dino", "resmlp_s12", *args, f"out={run}"]) == 0
    printed = capsys.readouterr().out
    assert "checkpoint.pth is missing; resuming from the previous checkpoint" in printed
    assert "(epoch 1, iteration 4)" in printed and weights_only(run / "checkpoint.pth")["iteration"] == 8


# ---- one loader: no other torch.load ---------------------------------------------------------------------

def loads_without_weights_only(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each torch.load call in `source` that does not pass
    weights_only=True: torch.load, torch.serialization.load, under any name they are imported as."""
    tree = ast.parse(source)
    names = {"torch.load", "torch.serialization.load"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("torch", "torch.serialization") and a.asname:
                    names |= {f"{a.asname}.load"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization"):
            for a in node.names:
                if a.name == "load":
                    names.add(a.asname or a.name)
                elif a.name == "serialization":
                    names.add(f"{a.asname or a.name}.load")

    def dotted(f) -> str:
        return f"{dotted(f.value)}.{f.attr}" if isinstance(f, ast.Attribute) else getattr(f, "id", "?")

    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and dotted(child.func) in names:
                flag = next((k.value for k in child.keywords if k.arg == "weights_only"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    found.append((child.lineno, function))
            visit(child, inner)
    visit(tree, "")
    return found


def test_the_finder_sees_each_way_of_loading_without_weights_only():
    src = ("import torch\nimport torch as T\nfrom torch import load as L\nfrom torch import serialization\n"
           "torch.load(p)\n"
           "def f(p):\n    return torch.load(p, weights_only=False)\n"
           "T.load(p, weights_only=flag)\n"
           "L(p)\n"
           "serialization.load(p, map_location='cpu')\n"
           "torch.serialization.load(p)\n"
           "torch.load(p, weights_only=True)\n")
    assert loads_without_weights_only(src) == [(5, ""), (7, "f"), (8, ""), (9, ""), (10, ""), (11, "")]


def test_no_module_loads_a_file_but_the_one_loader():
    """Every torch.load in the package passes weights_only=True, but the trusted branch of
    core/checkpoint.py's read_file (weights_trust=true)."""
    found = [(str(path.relative_to(ROOT)), function) for folder in PACKAGE
             for path in sorted((ROOT / folder).rglob("*.py"))
             for _, function in loads_without_weights_only(path.read_text())]
    assert found == [("core/checkpoint.py", "read_file")], found


# ---- one loader: every way of reading a pickle, and the compile cache ----------------------------------

# Where each way of turning a file's bytes into objects may be called (issue 50): torch.load by
# the one loader, torch's compile-cache artifacts by the compile cache; a pickle, np.load with
# allow_pickle or a YAML loader that builds objects nowhere.
LOAD_HOMES = {"torch.load": {"core/checkpoint.py"}, "load_cache_artifacts": {"core/compile_cache.py"},
              "pickle": set(), "np.load(allow_pickle)": set(), "yaml.load": set()}
_PICKLES = {f"{m}.{f}" for m in ("pickle", "_pickle", "cPickle", "dill") for f in ("load", "loads", "Unpickler")}
_UNSAFE_YAML = {f"yaml.{f}" for f in ("unsafe_load", "full_load", "unsafe_load_all", "full_load_all")}


def loads_of_files(source: str) -> list[tuple[int, str]]:
    """(line, kind) of each call in `source` that turns bytes into objects (LOAD_HOMES'
    kinds), under any name its module is imported as."""
    tree = ast.parse(source)
    alias, safe_names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in tree.body:   # a module's own name for a safe YAML loader (core/config.py's _YAML_LOADER)
        if isinstance(node, ast.Assign) and "SafeLoader" in ast.unparse(node.value):
            safe_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def canonical(f) -> str:
        text = ast.unparse(f)
        head, _, rest = text.partition(".")
        return f"{alias.get(head, head)}{'.' + rest if rest else ''}"

    def kind(call: ast.Call) -> str | None:
        name = canonical(call.func)
        arg = lambda k, i: next((kw.value for kw in call.keywords if kw.arg == k),  # noqa: E731
                                call.args[i] if len(call.args) > i else None)
        if name in ("torch.load", "torch.serialization.load"):
            return "torch.load"
        if name == "torch.compiler.load_cache_artifacts":
            return "load_cache_artifacts"
        if name in _PICKLES or name == "joblib.load":
            return "pickle"
        if name == "numpy.load":
            flag = arg("allow_pickle", 2)
            return None if flag is None or (isinstance(flag, ast.Constant) and flag.value is False) else \
                "np.load(allow_pickle)"
        if name in _UNSAFE_YAML:
            return "yaml.load"
        if name in ("yaml.load", "yaml.load_all"):
            loader = arg("Loader", 1)
            safe = loader is not None and ("SafeLoader" in ast.unparse(loader) or ast.unparse(loader) in safe_names)
            return None if safe else "yaml.load"
        return None

    return sorted((node.lineno, k) for node in ast.walk(tree) if isinstance(node, ast.Call) and (k := kind(node)))


def test_the_finder_sees_each_way_of_loading_a_file():
    src = ("import pickle as pk\nimport numpy as np\nimport yaml\nimport torch\n"
           "from torch.compiler import load_cache_artifacts as put\nfrom pickle import loads\nfrom torch import load\n"
           "pk.load(f)\n"                                        # 8
           "loads(b)\n"                                          # 9
           "pk.Unpickler(f).load()\n"                            # 10
           "np.load(p, allow_pickle=True)\n"                     # 11
           "np.load(p)\n"                                        # safe: no pickle
           "np.load(p, allow_pickle=False)\n"                    # safe
           "yaml.load(f, Loader=yaml.Loader)\n"                  # 14
           "yaml.unsafe_load(f)\n"                               # 15
           "yaml.load(f, Loader=yaml.CSafeLoader)\n"             # safe
           "yaml.safe_load(f)\n"                                 # safe
           "torch.compiler.load_cache_artifacts(b)\n"            # 18
           "put(b)\n"                                            # 19
           "load(p, weights_only=True)\n"                        # 20
           "torch.serialization.load(p)\n")                      # 21
    assert loads_of_files(src) == [(8, "pickle"), (9, "pickle"), (10, "pickle"), (11, "np.load(allow_pickle)"),
                                   (14, "yaml.load"), (15, "yaml.load"), (18, "load_cache_artifacts"),
                                   (19, "load_cache_artifacts"), (20, "torch.load"), (21, "torch.load")]


def test_every_file_is_loaded_by_the_one_loader_or_the_compile_cache():
    """No module of the package, tools/ or studies/ unpickles, loads numpy's pickles, builds
    objects from YAML, or puts back compiled artifacts, but core/checkpoint.py (torch.load)
    and core/compile_cache.py (load_cache_artifacts)."""
    found = {(str(path.relative_to(ROOT)), kind) for folder in PACKAGE for path in sorted((ROOT / folder).rglob("*.py"))
             for _, kind in loads_of_files(path.read_text())}
    assert {(f, k) for f, k in found if f not in LOAD_HOMES[k]} == set()
    assert ("core/checkpoint.py", "torch.load") in found
