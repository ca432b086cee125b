"""dino.init: continuing DINO from weights (ssl/init.py, models.load.init_weights): a timm file
gives the backbone its features, the grid adapts, this project's checkpoint gives its head,
the head warm-up leaves the backbone bitwise unchanged, a kill across the warm-up's end
resumes to the same weights, and every refusal is one line before any work."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.ssl.step import StepValues

from test_dino import ROOT, TINY as DINO_TINY, needs_fmnist

TINY = [*DINO_TINY, "model.dim=32"]   # test_dino's tiny run, as wide as the timm files below


def timm_file(path: Path, img_size: int = 32, patch_size: int = 4) -> tuple[Path, torch.nn.Module]:
    """A randomly initialised timm ResMLP, saved as a plain timm state_dict: resmlp_12_224's
    own classes and keys (timm's MlpMixer with ResBlock and Affine), 32 wide and 2 deep."""
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    torch.manual_seed(1)
    model = MlpMixer(num_classes=0, img_size=img_size, patch_size=patch_size, num_blocks=2, embed_dim=32,
                     mlp_ratio=4, block_layer=ResBlock, norm_layer=Affine).eval()
    torch.save(model.state_dict(), path)
    return path, model


def cfg_for(tmp_path, *extra):
    return load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path / 'run'}", *extra])


class NoState:
    """A run whose dir holds no checkpoint (what continuing() asks of a Run)."""

    def __init__(self, d: Path):
        self.dir, self.ckpt_path, self.prev_path = d, d / "checkpoint.pth", d / "checkpoint_prev.pth"


def start_for(tmp_path, *extra):
    from resmlp.ssl.init import continuing
    cfg = cfg_for(tmp_path, *extra)
    return cfg, continuing(cfg, NoState(tmp_path / "run"))


def dino_checkpoint(tmp_path, *extra) -> Path:
    """A run dir holding a DINO checkpoint as the trainer writes one (teacher and student,
    the loss's center, the config), of networks at their random init, the center moved."""
    from resmlp.core.checkpoint import save_checkpoint
    from resmlp.core.config import to_dict
    from resmlp.ssl.loss import build_dino_loss
    cfg = load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path / 'first'}", *extra])
    student, teacher = networks(cfg, None)
    center = torch.randn(build_dino_loss(cfg.dino).center.shape)
    save_checkpoint(tmp_path / "first" / "checkpoint.pth", {
        "command": "dino", "config": to_dict(cfg), "student": student.state_dict(), "teacher": teacher.state_dict(),
        "center": center, "epoch": 1, "iteration": 2})
    return tmp_path / "first"


def networks(cfg, start):
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.networks import build_networks
    return build_networks(cfg, crop_plan(cfg), torch.device("cpu"), start=start)


# ---- the weights ------------------------------------------------------------------------

def test_a_timm_file_gives_both_backbones_its_features(tmp_path):
    import timm
    torch.manual_seed(1)
    timm_model = timm.create_model("resmlp_12_224", pretrained=False, num_classes=0, img_size=32).eval()
    path = tmp_path / "resmlp_12_224.pth"
    torch.save(timm_model.state_dict(), path)
    cfg, start = start_for(tmp_path, f"dino.init={path}", "model.dim=null", "model.depth=null",
                           "model.patch_size=16")
    assert start.info["grid"] is None and not start.head_loaded and start.warmup_epochs == 1   # the default
    student, teacher = networks(cfg, start)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want = timm_model(x)
        for net in (student, teacher):
            net.backbone.eval()
            assert torch.allclose(net.backbone(x), want, atol=1e-5, rtol=1e-5)
    # config.yaml keeps the file it started from, and that the head was new
    assert cfg.dino.init == str(path.resolve()) and cfg.dino.init_head is False


def test_another_image_size_adapts_the_patch_grid_as_the_evaluators_do(tmp_path):
    from resmlp.models.load import load_backbone
    path, _ = timm_file(tmp_path / "timm64.pth", img_size=64)     # an 16x16 grid, continued at 32 px: 8x8
    cfg, start = start_for(tmp_path, f"dino.init={path}")
    assert start.info["grid"] == [[16, 16], [8, 8]]
    student, _ = networks(cfg, start)
    source, _ = load_backbone(str(path))
    source.grid_adapt = "interpolate"                               # what patch maps and viz do at another size
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        student.backbone.eval()
        assert torch.allclose(student.backbone(x), source(x), atol=1e-5, rtol=1e-5)


def test_this_projects_checkpoint_gives_its_head_and_center_unless_told(tmp_path):
    dino_checkpoint(tmp_path)
    saved = torch.load(tmp_path / "first" / "checkpoint.pth", weights_only=False)
    cfg, start = start_for(tmp_path, f"dino.init={tmp_path / 'first'}", "dino.centering=mean",
                           "dino.head_warmup_epochs=1")
    assert start.head_loaded and start.warmup_epochs == 0   # a loaded head needs no warm-up and start.info["source"] == "dino"
    assert cfg.dino.init_head is True and cfg.dino.init == str((tmp_path / "first" / "checkpoint.pth").resolve())
    student, teacher = networks(cfg, start)
    for net in (student, teacher):   # both start from the checkpoint's teacher, head included
        for name, value in net.state_dict().items():
            assert torch.equal(value, saved["teacher"][name]), name
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    step = build_dino_step(cfg, crop_plan(cfg), torch.device("cpu"), start=start)
    assert torch.equal(step.loss_fn.center, saved["center"])
    _, fresh = start_for(tmp_path, f"dino.init={tmp_path / 'first'}", "dino.init_head=false",
                         "dino.head_warmup_epochs=1")
    assert not fresh.head_loaded and fresh.head is None and fresh.warmup_epochs == 1


# ---- the head warm-up ------------------------------------------------------------------

@pytest.mark.slow
@needs_fmnist
def test_the_head_warmup_leaves_the_backbone_bitwise_unchanged_then_it_learns_at_its_scale(tmp_path):
    from resmlp.models import create_model
    from resmlp.models.load import init_weights
    from resmlp.ssl.train import train
    path, _ = timm_file(tmp_path / "timm.pth")
    cfg = cfg_for(tmp_path, f"dino.init={path}", "dino.head_warmup_epochs=1", "dino.init_lr_scale=0.25")
    _, _, _, results = train(cfg)
    ref = create_model("resmlp_s12", dim=32, depth=2, img_size=32, patch_size=4, num_classes=0)
    init_weights(str(path), ref)
    start = {f"backbone.{k}": v for k, v in ref.state_dict().items()}
    warm = torch.load(tmp_path / "run" / "checkpoint_prev.pth", weights_only=False)   # the end of epoch 1
    end = torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=False)
    assert warm["iteration"] == 2 and end["iteration"] == 4
    for key in ("student", "teacher"):
        for name, value in start.items():
            assert torch.equal(warm[key][name], value), f"{key}.{name} moved during the warm-up"
        assert any(not torch.equal(warm[key][n], end[key][n]) for n in start), f"{key}: the backbone never learned"
    # AdamW kept no state for the frozen backbone; afterwards its groups ran at 0.25 x the rate
    groups = warm["optimizer"]["param_groups"]
    backbone_ids = {i for g in groups if "lr_scale" in g for i in g["params"]}
    assert backbone_ids and not backbone_ids & set(warm["optimizer"]["state"])
    last = {g.get("lr_scale", 1.0): g["lr"] for g in end["optimizer"]["param_groups"]}
    assert last[0.25] == pytest.approx(0.25 * last[1.0])
    # results.json: where it started and the k-NN at the start, after the warm-up and at the end
    assert results["init_from"]["spec"] == str(path.resolve()) and results["init_from"]["head"] == "new"
    assert results["after_warmup_knn_top1"] == results["init_knn_top1"]   # the backbone has not moved
    assert "knn_top1" in results


def test_the_step_freezes_the_backbone_only_during_the_warmup(tmp_path):
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    path, _ = timm_file(tmp_path / "timm.pth")
    cfg, start = start_for(tmp_path, f"dino.init={path}", "dino.head_warmup_epochs=1", "data.local_size=16")
    plan = crop_plan(cfg)
    step = build_dino_step(cfg, plan, torch.device("cpu"), start=start)
    crops = [torch.randn(4, 3, 32, 32)] * 2 + [torch.randn(4, 3, 16, 16)] * plan.n_local
    before = {k: v.clone() for k, v in step.raw_student.state_dict().items()}
    teacher_before = {k: v.clone() for k, v in step.teacher.state_dict().items()}
    values = StepValues(lr=1e-3, wd=0.04, momentum=0.9, teacher_temp=0.04)
    step(crops, values, epoch=0)
    after = step.raw_student.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after if k.startswith("backbone."))
    assert any(not torch.equal(before[k], after[k]) for k in after if k.startswith("head."))
    t_after = step.teacher.state_dict()
    assert all(torch.equal(teacher_before[k], t_after[k]) for k in t_after if k.startswith("backbone."))
    assert all(p.grad is None for p in step.raw_student.backbone.parameters())
    step(crops, values, epoch=1)   # the backbone joins
    assert any(not torch.equal(before[k], v) for k, v in step.raw_student.state_dict().items()
               if k.startswith("backbone."))


def _cmd(out, *extra):
    return [sys.executable, "-m", "resmlp.core.cli", "dino", "resmlp_s12", *TINY, f"out={out}", *extra]


@pytest.mark.slow
@needs_fmnist
def test_a_kill_inside_the_warmup_resumes_across_its_end_to_the_same_weights(tmp_path):
    path, _ = timm_file(tmp_path / "timm.pth")
    extra = (f"dino.init={path}", "data.subset=128", "ckpt_every=2", "dino.head_warmup_epochs=1")  # 4 per epoch
    full = subprocess.run(_cmd(tmp_path / "full", *extra), cwd=ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr[-2000:]
    env = {**os.environ, "RESMLP_KILL_AT_ITERATION": "3"}     # in the warm-up, one past the checkpoint at 2
    killed = subprocess.run(_cmd(tmp_path / "cut", *extra), cwd=ROOT, env=env, capture_output=True, text=True)
    assert killed.returncode != 0
    assert torch.load(tmp_path / "cut" / "checkpoint.pth", weights_only=False)["iteration"] == 2
    # the same command again (a requeue) continues its own run: dino.init is not loaded anew
    resumed = subprocess.run(_cmd(tmp_path / "cut", *extra), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout and "continuing from" not in resumed.stdout
    a, b = (torch.load(tmp_path / r / "checkpoint.pth", weights_only=False) for r in ("full", "cut"))
    assert a["iteration"] == b["iteration"] == 8
    assert all(torch.equal(v, b[key][n]) for key in ("teacher", "student") for n, v in a[key].items())
    ra, rb = (json.loads((tmp_path / r / "results.json").read_text()) for r in ("full", "cut"))
    assert ra["init_from"] == rb["init_from"] and ra["after_warmup_knn_top1"] == rb["after_warmup_knn_top1"]
    assert ra["knn_top1"] == rb["knn_top1"]


# ---- refusals: one line, before any work ---------------------------------------------

def test_weights_that_do_not_fit_are_named(tmp_path):
    path, _ = timm_file(tmp_path / "timm.pth")
    with pytest.raises(UserError, match=r"width 32 vs the model's 64 \(model.dim\); depth 2 vs the model's 3"):
        start_for(tmp_path, f"dino.init={path}", "model.dim=64", "model.depth=3")
    with pytest.raises(UserError, match=r"patch size 4 vs the model's 8 \(model.patch_size\)"):
        start_for(tmp_path, f"dino.init={path}", "model.patch_size=8")
    with pytest.raises(UserError, match="ResNet without a ResMLP's patch embedding"):
        start_for(tmp_path, "dino.init=timm:resnet10t?random")
    with pytest.raises(UserError, match="does not exist"):
        start_for(tmp_path, f"dino.init={tmp_path / 'nothing.pth'}")
    with pytest.raises(UserError, match="dino.init_head=true: .* has no DINO head"):
        start_for(tmp_path, f"dino.init={path}", "dino.init_head=true")
    with pytest.raises(UserError, match="leaves the backbone no epoch"):
        start_for(tmp_path, f"dino.init={path}", "dino.head_warmup_epochs=2")
    with pytest.raises(UserError, match="dino.init_lr_scale=0"):
        start_for(tmp_path, f"dino.init={path}", "dino.init_lr_scale=0")


def test_a_head_of_other_sizes_is_named_with_the_keys_that_fit_it(tmp_path):
    dino_checkpoint(tmp_path)
    with pytest.raises(UserError, match=r"head does not fit this run's \(dino.out_dim 64 vs 128\); set "
                                        r"dino.out_dim=64 to continue its head, or dino.init_head=false"):
        start_for(tmp_path, f"dino.init={tmp_path / 'first'}", "dino.out_dim=128")


def test_timm_weights_that_cannot_be_had_offline_name_the_file_to_pass(tmp_path, monkeypatch):
    from resmlp.models import load
    monkeypatch.setattr(load, "_online", lambda *a, **k: False)
    try:
        start_for(tmp_path, "dino.init=timm:resmlp_12_224.fb_dino")
    except UserError as e:
        text = str(e)
    else:
        pytest.skip("timm's weights are in this machine's cache")
    assert "dino.init=<file>" in text and "torch.save(timm.create_model('resmlp_12_224.fb_dino', pretrained=True)" \
        in text and "export format=timm" in text and "\n" not in text


def test_init_on_a_run_dir_with_its_own_state_says_which_to_drop(tmp_path):
    from omegaconf import OmegaConf
    from resmlp.core.config import to_dict
    path, _ = timm_file(tmp_path / "timm.pth")
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(OmegaConf.create(to_dict(cfg_for(tmp_path))), run / "config.yaml")   # a run without dino.init
    torch.save({"iteration": 1}, run / "checkpoint.pth")
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    proc = subprocess.run(_cmd(run, f"dino.init={path}"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "started without dino.init" in line
    assert f"drop dino.init to continue that run, or pass out={run}_2 to start this one beside it" in line
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files     # nothing written, nothing taken
    # finished, and asked to start from its own weights (dino.init=runs/fm1 out=runs/fm1): refused, not
    # "nothing to do"
    (run / "results.json").write_text(json.dumps({"epochs": 2}))
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    proc = subprocess.run(_cmd(run, f"dino.init={run}"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "nothing to do" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and f"and dino.init={run} asks for another start" in proc.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files


@pytest.mark.slow
@needs_fmnist
def test_two_processes_keep_the_warmup_and_stay_in_step(tmp_path):
    path, _ = timm_file(tmp_path / "timm.pth")
    # device=cpu (gloo); DDP is wrapped anew when the backbone joins
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "resmlp.core.cli", "dino", "resmlp_s12", *TINY,
                           f"out={tmp_path / 'two'}", f"dino.init={path}", "dino.head_warmup_epochs=1", "data.subset=128",
                           "device=cpu",
                           "save_rank_weights=true"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / "two" / f"weights_rank{r}.pth") for r in (0, 1)]
    for key in ("student", "teacher"):
        for name, value in ranks[0][key].items():
            assert torch.equal(value, ranks[1][key][name]), f"ranks differ: {key}.{name}"
    warm = torch.load(tmp_path / "two" / "checkpoint_prev.pth", weights_only=False)   # the end of epoch 1
    given = torch.load(path)
    assert torch.equal(warm["student"]["backbone.blocks.0.cross_patch.weight"], given["blocks.0.linear_tokens.weight"])
    assert not torch.equal(ranks[0]["student"]["backbone.blocks.0.cross_patch.weight"],
                           given["blocks.0.linear_tokens.weight"])


@pytest.mark.slow
def test_the_whole_loop_from_released_weights_on_a_folder(tmp_path):
    """Issue 30's loop at tiny size: DINO on a folder of unlabeled images from a timm-format
    file (of another image size), the k-NN with few labels on a labeled folder, fine-tuning,
    export; the exported file is what timm loads."""
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    from test_folder import TINY as FOLDER_TINY, labeled, photos
    from resmlp.core.cli import main
    from resmlp.models.load import load_backbone
    torch.manual_seed(2)
    released = MlpMixer(num_classes=0, img_size=32, patch_size=4, num_blocks=2, embed_dim=16, mlp_ratio=4,
                        block_layer=ResBlock, norm_layer=Affine).eval()
    torch.save(released.state_dict(), tmp_path / "released.pth")
    root, lab, run = photos(tmp_path / "imgs", 24), labeled(tmp_path / "lab"), tmp_path / "run"
    assert main(["dino", "resmlp_s12", *FOLDER_TINY, "data=folder", f"data.root={root}", "eval.data=imagefolder",
                 f"eval.root={lab}", "epochs=2", f"dino.init={tmp_path / 'released.pth'}", f"out={run}"]) == 0
    res = json.loads((run / "results.json").read_text())
    assert res["init_from"]["grid"] == [[8, 8], [4, 4]] and res["init_from"]["head"] == "new"
    assert "init_knn_top1" in res and "knn_top1" in res
    assert main(["knn", str(run), "data=imagefolder", f"data.root={lab}", "k=3", "knn.few_labels=[1,2]",
                 "knn.tries=2", f"out={tmp_path / 'knn'}"]) == 0
    few = json.loads((tmp_path / "knn" / "knn.json").read_text())
    assert set(few["few_labels"]["results"]) == {"1", "2"}
    assert main(["finetune", str(run), "data=imagefolder", f"data.root={lab}", "demo=false", "epochs=1",
                 "batch_size=4", "num_workers=0", "eval_every=0", "finetune.min_steps=0",
                 f"out={tmp_path / 'ft'}"]) == 0
    assert "top1" in json.loads((tmp_path / "ft" / "results.json").read_text())
    assert main(["export", str(run), "format=timm", f"out={tmp_path / 'export'}"]) == 0
    exported = next((tmp_path / "export").glob("*_timm.pth"))
    card = json.loads(exported.with_suffix(".json").read_text())
    assert card["knn"]["data"]["name"] == "imagefolder" and card["knn"]["data"]["root"] == str(lab)
    assert card["knn"]["knn_top1"] == res["knn_top1"] and card["data"]["name"] == "folder"
    twin = MlpMixer(**card["timm"]["kwargs"], block_layer=ResBlock, norm_layer=Affine).eval()  # README's snippet
    twin.load_state_dict(torch.load(exported))
    ours, _ = load_backbone(str(run))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(twin(x), ours(x), atol=1e-5)


@needs_fmnist
def test_the_study_script_writes_its_folders_and_reads_its_runs(tmp_path):
    """studies/dino_continue.py at a tiny size (studies/README.md: kept working)."""
    script = ROOT / "studies" / "dino_continue.py"
    proc = subprocess.run([sys.executable, str(script), "prepare", str(tmp_path / "data"), "10"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "data" / "fm04" / "train").iterdir()) == ["0", "1", "2", "3", "4"]
    assert len(list((tmp_path / "data" / "fm04" / "val" / "4").glob("*.png"))) == 10
    assert len(list((tmp_path / "data" / "fm10").glob("*.png"))) == 10
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "init_knn_top1": 50.0, "after_warmup_knn_top1": 50.0, "knn_top1": 55.0, "knn_k": 20, "wall_time_s": 9.0,
        "knn_few_labels": {"results": {"1": {"k": {"20": {"top1": 20.0, "top1_std": 1.5}}}}}}))
    (run / "log.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"epoch": 0, "knn_top1": 50.0}, {"epoch": 1, "iteration": 3, "loss": 1.0}, {"epoch": 1, "knn_top1": 47.5},
        {"epoch": 2, "knn_top1": 55.0})) + "\n")
    proc = subprocess.run([sys.executable, str(script), "table", str(run)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| run | 50.00 | 50.00 | 55.00 | 47.50 | 1 | 20.00 ± 1.50 | 9.00 |" in proc.stdout
