"""DINO: loss, EMA, clipping and multi-crop against plain implementations; end-to-end runs,
resume after a kill, and two processes against one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resmlp.core.config import load_config
from resmlp.core.errors import RunFailed, UserError
from resmlp.ssl.ema import update_teacher
from resmlp.ssl.clip import clip_per_parameter
from resmlp.ssl.networks import MultiCropNet

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")

TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.subset=64", "batch_size=32", "epochs=2",
        "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=1", "num_workers=0", "eval_every=0", "log_every=1",
        "dino.final_linear=false", "model.drop_path_rate=0.0"]


def tiny_cfg(tmp_path, *extra):
    return load_config("dino", "resmlp_s12", [*TINY, f"out={tmp_path}", *extra])


# ---- pieces against plain implementations -----------------------------------------------
def plain_dino_loss(teacher, student, center, t_temp, s_temp=0.1, momentum=0.9):
    """DINO's loss as main_dino.py defines it, written out with loops."""
    t_probs = [F.softmax((t - center) / t_temp, dim=-1) for t in teacher]
    total, n = 0.0, 0
    for i, q in enumerate(t_probs):
        for v, s in enumerate(student):
            if v == i:
                continue
            total = total + torch.sum(-q * F.log_softmax(s / s_temp, dim=-1), dim=-1).mean()
            n += 1
    new_center = center * momentum + torch.cat(teacher).mean(0, keepdim=True) * (1 - momentum)
    return total / n, new_center


def test_lightly_dino_loss_matches_reference_definition():
    from lightly.loss import DINOLoss
    torch.manual_seed(0)
    K, B = 50, 6
    loss_fn = DINOLoss(K, warmup_teacher_temp_epochs=0)
    loss_fn.center.normal_()
    center = loss_fn.center.clone().reshape(1, K)
    teacher = [torch.randn(B, K) for _ in range(2)]
    student = [torch.randn(B, K) for _ in range(5)]
    got = loss_fn(teacher, student, teacher_temp=0.05)
    want, want_center = plain_dino_loss(teacher, student, center, 0.05)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(loss_fn.center.reshape(1, K), want_center, atol=1e-6)


def test_ema_update_matches_per_parameter_formula():
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    before = [p.clone() for p in teacher.parameters()]
    update_teacher(teacher, student, 0.9)
    for t, t0, s in zip(teacher.parameters(), before, student.parameters()):
        assert torch.allclose(t, 0.9 * t0 + 0.1 * s, atol=1e-7)


def test_clip_per_parameter_matches_dino():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    for p, scale in zip(params, (0.1, 10.0, 100.0)):
        p.grad = torch.randn(5) * scale
    want = [p.grad * min(1.0, 3.0 / (p.grad.norm().item() + 1e-6)) for p in params]
    clip_per_parameter(params, 3.0)
    for p, w in zip(params, want):
        assert torch.allclose(p.grad, w, atol=1e-6)
    assert params[0].grad.norm() < 3.0 and abs(params[2].grad.norm().item() - 3.0) < 1e-3


def test_health_signals_see_both_collapses():
    """Entropy and KL-to-batch-mean of the teacher's targets, and the warning for each collapse."""
    import math

    from resmlp.ssl.health import collapse_warning, teacher_stats
    K, temp = 64, 0.04
    center = torch.randn(1, K)

    def targets(t):  # DINO's: the centered, sharpened softmax
        return F.softmax((t - center) / temp, dim=-1)
    uniform = teacher_stats(targets(center.repeat(8, 1)))  # output = center: uniform targets
    assert uniform["teacher_entropy"] == pytest.approx(math.log(K), abs=1e-4)
    assert uniform["teacher_kl_mean"] == pytest.approx(0.0, abs=1e-4)
    same = teacher_stats(targets(center + 10 * F.one_hot(torch.full((8,), 3), K)))  # one class for all
    assert same["teacher_entropy"] < 1e-3 and same["teacher_kl_mean"] == pytest.approx(0.0, abs=1e-3)
    own = teacher_stats(targets(center + 10 * F.one_hot(torch.arange(8), K)))  # healthy: sharp, diverse
    assert own["teacher_entropy"] < 1e-3 and own["teacher_kl_mean"] == pytest.approx(math.log(8), abs=1e-3)
    assert "near uniform" in collapse_warning(0.99 * math.log(K), K)
    assert "one-hot" in collapse_warning(0.01 * math.log(K), K)
    assert collapse_warning(0.5 * math.log(K), K) is None


def test_multicrop_groups_resolutions_like_separate_forwards():
    from resmlp.models import create_model
    torch.manual_seed(0)
    backbone = create_model("resmlp_s12", dim=16, depth=2, img_size=32, patch_size=4, num_classes=0,
                            grid_adapt="subgrid")
    net = MultiCropNet(backbone, torch.nn.Identity()).eval()
    crops = [torch.randn(3, 3, 32, 32), torch.randn(3, 3, 32, 32), torch.randn(3, 3, 16, 16)]
    together = net(crops)
    apart = torch.cat([backbone(c) for c in crops])
    assert together.shape == (9, 16) and torch.allclose(together, apart, atol=1e-5)


def test_teacher_starts_as_student_copy_without_gradients(tmp_path):
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.networks import build_networks
    cfg = tiny_cfg(tmp_path)
    student, teacher = build_networks(cfg, crop_plan(cfg), torch.device("cpu"))
    for (n, s), t in zip(student.state_dict().items(), teacher.state_dict().values()):
        assert torch.equal(s, t), n
    assert not any(p.requires_grad for p in teacher.parameters())
    assert student.backbone.grid_adapt == "interpolate"   # the default strategy


def test_bad_strategy_is_a_user_error(tmp_path):
    from resmlp.data.crop_plan import crop_plan
    with pytest.raises(UserError, match="dino.local_crops"):
        crop_plan(tiny_cfg(tmp_path, "dino.local_crops=stretch"))
    with pytest.raises(UserError, match="multiple of model.patch_size"):
        crop_plan(tiny_cfg(tmp_path, "data.local_size=10"))


def test_imagenet_recipe_follows_dinos_300_epoch_run():
    """The ResMLP paper gives DINO and 300 epochs; the rest is DINO's published 300-epoch
    command (teacher temperature 0.04 -> 0.07 over 30 epochs, no last-layer norm) over
    main_dino.py's defaults."""
    from resmlp.core.schedules import linear_warmup_then_constant
    cfg = load_config("dino", "resmlp_s12", ["data=imagenet", "data.root=/nowhere"])
    d, o = cfg.dino, cfg.optim
    assert (cfg.epochs, cfg.batch_size, d.norm_last_layer) == (300, 1024, False)
    assert (d.warmup_teacher_temp, d.teacher_temp, d.warmup_teacher_temp_epochs) == (0.04, 0.07, 30)
    assert (d.momentum_teacher, d.out_dim, d.n_local_crops, cfg.data.local_size, d.freeze_last_layer) == (0.996, 65536, 8, 96, 1)
    assert (tuple(d.global_crops_scale), tuple(d.local_crops_scale)) == ((0.4, 1.0), (0.05, 0.4))
    assert (o.lr, o.min_lr, o.warmup_epochs, o.weight_decay, o.weight_decay_end, o.clip_grad) == \
        (0.0005, 1e-6, 10, 0.04, 0.4, 3.0)
    assert cfg.model.drop_path_rate == 0.1 and d.augment == "device"
    temps = linear_warmup_then_constant(d.warmup_teacher_temp, d.teacher_temp, d.warmup_teacher_temp_epochs,
                                        cfg.epochs, 10)
    assert temps[0] == 0.04 and temps[150] == pytest.approx(0.055) and (temps[300:] == 0.07).all()
    lines = (ROOT / "configs" / "recipe" / "dino_imagenet.yaml").read_text().splitlines()
    for key in ("epochs:", "teacher_temp: 0.07", "warmup_teacher_temp_epochs: 30", "norm_last_layer: false"):
        i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(key))
        assert "DINO" in lines[i] or "DINO" in lines[i - 1], key  # each value says where it comes from


# ---- end to end -------------------------------------------------------------------------
@needs_fmnist
@pytest.mark.parametrize("strategy,augment", [("resize", "device"), ("interpolate", "device"),
                                              ("subgrid", "device"), ("none", "device"),
                                              ("subgrid", "workers")])
def test_every_local_crop_strategy_trains(tmp_path, strategy, augment, short_knn):
    from resmlp.ssl import train as dino_train
    # judged on a small labeled folder: the trainer's own k-NN, short
    run, student, teacher, results = dino_train.train(tiny_cfg(tmp_path, f"dino.local_crops={strategy}",
                                                                 f"dino.augment={augment}", "epochs=1", *short_knn))
    assert results["local_crops"] == strategy
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    if strategy in ("interpolate", "subgrid"):
        assert student.backbone.grid_adapt == strategy


@needs_fmnist
def test_run_writes_outputs_and_prints_knn(tmp_path):
    out = subprocess.run([sys.executable, "-m", "resmlp.core.cli", "dino", "resmlp_s12", *TINY,
                          f"out={tmp_path}", "eval_every=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "knn top1=" in out.stdout and "(k=20, T=0.07)" in out.stdout
    for name in ("config.yaml", "checkpoint.pth", "log.jsonl", "results.json"):
        assert (tmp_path / name).exists(), name
    assert list((tmp_path / "tb").glob("events.*"))
    # the neighbours grid of every k-NN of eval_every (and of the one at init) in TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    tb.Reload()
    grids = tb.Images("knn_neighbours")
    assert [g.step for g in grids] == [0, 2, 4] and all(g.width > 200 and g.height > 200 for g in grids)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "loss" in r]
    for key in ("lr", "wd", "momentum", "teacher_temp", "teacher_entropy", "teacher_kl_mean",
                "images_per_s", "peak_mem_mb"):
        assert key in train_lines[-1], key
    assert any("knn_top1" in r for r in records)
    results = json.loads((tmp_path / "results.json").read_text())
    assert "init_knn_top1" in results and "knn_top1" in results
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=False)
    assert set(ckpt) >= {"student", "teacher", "optimizer", "center", "scaler", "epoch", "iteration",
                         "rng", "config"}
    assert any(k.startswith("backbone.") for k in ckpt["teacher"])


def test_the_trainer_reads_as_one_loop_that_never_asks_for_its_judge():
    """ssl/train.py's train() stays a loop read top to bottom (at most 80 lines) and calls its
    judge (eval/judge.py) without testing whether there is one: a run without labels gets
    the HealthOnly judge, whose calls do nothing but say so."""
    import ast
    tree = ast.parse((ROOT / "ssl" / "train.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 80
    tests = [n.test for n in ast.walk(train) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [v for n in ast.walk(train) if isinstance(n, ast.BoolOp) for v in n.values]
    assert not [ast.unparse(t) for t in tests if "judge" in ast.unparse(t)]


def test_knn_report_draws_the_neighbours_grid_only_when_asked(tmp_path, monkeypatch, fake_forward):
    from test_folder import labeled

    from resmlp.eval import knn
    from resmlp.eval.judge import knn_report

    asked = []
    real = knn.online_knn

    def online_knn(*args, keep_features=False, **kwargs):
        asked.append(keep_features)   # the grid reuses the k-NN's own features, extracted once
        return real(*args, keep_features=keep_features, **kwargs)

    class FakeRun:
        is_main, device, world_size, amp_dtype = True, torch.device("cpu"), 1, None
        images = []

        def print(self, *args):
            pass

        def log_image(self, tag, image, step):
            self.images.append((tag, image.shape, image.dtype, step))

    monkeypatch.setattr(knn, "online_knn", online_knn)
    run = FakeRun()
    cfg = tiny_cfg(tmp_path, "data=imagefolder", f"data.root={labeled(tmp_path / 'lab', per_class=6)}",
                   "data.img_size=32", "data.subset=null", "knn.k=5")
    knn_report(run, None, cfg, "epoch 1", picture_step=7)
    assert asked == [True] and len(run.images) == 1
    tag, shape, dtype, step = run.images[0]
    assert tag == "knn_neighbours" and step == 7 and shape[2] == 3 and shape[0] > 100 and dtype == np.uint8
    knn_report(run, None, cfg, "end")                   # the final k-NN: no picture step
    cfg.dino.tensorboard_neighbours = False
    knn_report(run, None, cfg, "epoch 2", picture_step=9)
    assert asked == [True, False, False] and len(run.images) == 1


@needs_fmnist
def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    from resmlp.ssl import train as dino_train
    from resmlp.ssl.loss import DinoLoss
    calls = {"n": 0}
    real = DinoLoss.forward

    def poisoned(self, *a, **k):
        calls["n"] += 1
        loss = real(self, *a, **k)
        return loss * float("nan") if calls["n"] == 3 else loss

    monkeypatch.setattr(DinoLoss, "forward", poisoned)
    cfg = tiny_cfg(tmp_path, "ckpt_every=1", "epochs=3")
    with pytest.raises(RunFailed, match="nan.*intact"):
        dino_train.train(cfg)
    ckpt = torch.load(tmp_path / "checkpoint.pth", weights_only=False)
    assert ckpt["iteration"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["teacher"].values())


def _train_cmd(out, *extra):
    return [sys.executable, "-m", "resmlp.core.cli", "dino", "resmlp_s12", *TINY, f"out={out}", *extra]


@needs_fmnist
def test_killed_run_resumes_to_the_same_weights_and_log_and_a_finished_run_stays(tmp_path):
    extra = ("epochs=2", "data.subset=128", "ckpt_every=3")     # 4 iterations per epoch: saved at 3, 4, 6, 8
    full = subprocess.run(_train_cmd(tmp_path / "full", *extra), cwd=ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr[-2000:]
    env = {**os.environ, "RESMLP_KILL_AT_ITERATION": "7"}        # mid-epoch 2, one iteration past a checkpoint
    killed = subprocess.run(_train_cmd(tmp_path / "cut", *extra), cwd=ROOT, env=env, capture_output=True,
                            text=True)
    assert killed.returncode != 0
    assert torch.load(tmp_path / "cut" / "checkpoint.pth", weights_only=False)["iteration"] == 6
    assert '"iteration": 7' in (tmp_path / "cut" / "log.jsonl").read_text()   # logged, then lost with the kill
    resumed = subprocess.run(_train_cmd(tmp_path / "cut", *extra), cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from" in resumed.stdout
    a = torch.load(tmp_path / "full" / "checkpoint.pth", weights_only=False)
    b = torch.load(tmp_path / "cut" / "checkpoint.pth", weights_only=False)
    assert a["iteration"] == b["iteration"] == 8
    for key in ("teacher", "student"):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{key}.{name}"
    # the resumed log holds each iteration (and the final k-NN) once, as the uninterrupted one
    rows = {run: [(r.get("iteration"), r.get("epoch"), "knn_top1" in r)
                  for r in map(json.loads, (tmp_path / run / "log.jsonl").read_text().splitlines())]
            for run in ("full", "cut")}
    assert rows["cut"] == rows["full"] and [r[0] for r in rows["cut"] if r[0]] == list(range(1, 9))

    # the same command on the finished run: says so, exit 0, every file as it was
    files = {f: (tmp_path / "cut" / f).read_bytes() for f in ("results.json", "log.jsonl", "checkpoint.pth")}
    again = subprocess.run(_train_cmd(tmp_path / "cut", *extra), cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "holds a finished run" in again.stdout, again.stderr[-2000:]
    assert len(again.stdout.strip().splitlines()) == 1 and not again.stderr.strip()
    assert all((tmp_path / "cut" / f).read_bytes() == b for f, b in files.items())


@needs_fmnist
def test_two_processes_equal_one_on_the_same_global_batch(tmp_path):
    # device=cpu (gloo): runs on any machine, a one-GPU box too (two processes need two GPUs)
    extra = ("epochs=1", "data.subset=128", "dino.freeze_last_layer=0", "device=cpu")
    one = subprocess.run(_train_cmd(tmp_path / "one", *extra), cwd=ROOT, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-2000:]
    # --standalone: torchrun's store takes a free port itself (a port picked here and closed
    # could be taken by another process before torchrun binds it)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "resmlp.core.cli", "dino", "resmlp_s12",
                          *TINY, f"out={tmp_path / 'two'}", *extra, "save_rank_weights=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    a = torch.load(tmp_path / "one" / "checkpoint.pth", weights_only=False)
    ranks = [torch.load(tmp_path / "two" / f"weights_rank{r}.pth") for r in (0, 1)]
    for key in ("student", "teacher"):
        for name, value in a[key].items():
            assert torch.equal(ranks[0][key][name], ranks[1][key][name]), f"ranks differ: {key}.{name}"
            assert torch.allclose(value, ranks[0][key][name], atol=1e-5), f"1 vs 2 processes: {key}.{name}"
