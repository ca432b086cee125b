"""Supervised training, distillation, fine-tuning and the compare command (resmlp.supervised).

Tiny ResMLPs (dim 32, depth 2, 8x8 patches) on a few hundred Fashion-MNIST images, on CPU.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from resmlp.core.checkpoint import load_checkpoint, save_checkpoint
from resmlp.core.config import load_config, save_config, to_dict
from resmlp.core.errors import UserError


def _have_fashion_mnist() -> bool:
    from resmlp.data.fashion_mnist import search_dirs
    return any(os.path.exists(os.path.join(d, "train-images-idx3-ubyte.gz"))
               or os.path.exists(os.path.join(d, "train-images-idx3-ubyte")) for d in search_dirs())


needs_data = pytest.mark.skipif(not _have_fashion_mnist(), reason="Fashion-MNIST files not found "
                                "(apt-get install dataset-fashion-mnist)")

TINY = ["model.dim=32", "model.depth=2", "data.subset=128", "batch_size=32", "num_workers=0",
        "demo=false", "log_every=2", "eval_every=0"]
QUICK_TEST = ["eval_limit=200", "eval_batch_size=200"]   # the supervised commands' test-split evaluation
PLAIN = ["aug.mixup=0", "aug.cutmix=0", "aug.auto_augment=null", "aug.re_prob=0", "aug.smoothing=0",
         "model.drop_path_rate=0", "optim.warmup_epochs=0", "aug.scale=[0.9,1]"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight over a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def config(command, tmp_path, name, *extra, model="resmlp_s12", base=None):
    quick = QUICK_TEST if command in ("supervised", "distill", "finetune") else []
    return load_config(command, model, [*TINY, *quick, f"out={tmp_path / name}", *extra], base=base)


def log_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


def save_tiny_classifier(tmp_path, num_classes: int, name: str = "teacher") -> Path:
    """A project supervised checkpoint of a tiny ResMLP (random weights) with `num_classes`."""
    from resmlp.models.from_config import build_model
    cfg = config("supervised", tmp_path, name)
    model = build_model(cfg.model, num_classes=num_classes)
    path = tmp_path / name / "checkpoint.pth"
    save_checkpoint(path, {"command": "supervised", "config": to_dict(cfg), "model": model.state_dict(),
                           "num_classes": num_classes, "epoch": 1, "iteration": 8})
    return path


def save_dino_checkpoint(tmp_path, name: str = "dino") -> tuple[Path, dict, dict]:
    """A DINO-format run dir (config.yaml + checkpoint.pth) whose teacher and student
    backbones differ from each other and from any fresh initialisation."""
    from resmlp.models.from_config import build_model
    cfg = config("dino", tmp_path, name)
    g = torch.Generator().manual_seed(123)
    nets = {}
    for key in ("teacher", "student"):
        bb = build_model(cfg.model, num_classes=0)
        sd = {k: torch.randn(v.shape, generator=g) for k, v in bb.state_dict().items()}
        head = {"head.last_layer.weight": torch.randn(16, 8, generator=g)}
        nets[key] = {**{f"backbone.{k}": v for k, v in sd.items()}, **head}
    run_dir = tmp_path / name
    save_config(cfg, run_dir / "config.yaml")
    save_checkpoint(run_dir / "checkpoint.pth", {"command": "dino", "config": to_dict(cfg), "epoch": 3,
                                                "iteration": 24, **nets})
    strip = lambda net: {k[len("backbone."):]: v for k, v in net.items() if k.startswith("backbone.")}  # noqa: E731
    return run_dir, strip(nets["teacher"]), strip(nets["student"])


# ---- the loss ---------------------------------------------------------------------------------

def test_distillation_loss_equals_formula():
    from resmlp.supervised.train import distillation_loss
    s = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 0.3]])
    t = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 0.0]])   # teacher argmax: 1, 0
    y = torch.tensor([0, 2])
    ls = torch.log_softmax(s, dim=1)
    ce_y = -(ls[0, 0] + ls[1, 2]) / 2
    ce_t = -(ls[0, 1] + ls[1, 0]) / 2
    assert torch.allclose(distillation_loss(s, t, y, "hard", 0.5), 0.5 * ce_y + 0.5 * ce_t)
    assert torch.allclose(distillation_loss(s, t, y, "hard", 0.3), 0.7 * ce_y + 0.3 * ce_t)
    # soft targets (mixup): the label term is the soft cross-entropy
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]])
    ce_soft = -(soft * ls).sum(1).mean()
    assert torch.allclose(distillation_loss(s, t, soft, "hard"), 0.5 * ce_soft + 0.5 * ce_t)
    # soft distillation, DeiT's formula: sum KL(p_t || p_s) at tau, * tau^2 / (batch * classes)
    tau = 2.0
    p_t, lp_s = torch.softmax(t / tau, 1), torch.log_softmax(s / tau, 1)
    kl = (p_t * (p_t.log() - lp_s)).sum() * tau ** 2 / s.numel()
    assert torch.allclose(distillation_loss(s, t, y, "soft", 0.5, tau), 0.5 * ce_y + 0.5 * kl, atol=1e-6)
    with pytest.raises(UserError):
        distillation_loss(s, t, y, "medium")


# ---- training --------------------------------------------------------------------------------

@needs_data
def test_supervised_run_lowers_loss_and_writes_results(tmp_path, capsys):
    from resmlp.supervised.train import train
    cfg = config("supervised", tmp_path, "sup", "epochs=3", "optim.lr=0.1", "optim.lr_batch=32", "data.subset=256",
                 *PLAIN)
    _, model, res = train(cfg)
    losses = [r["train_loss"] for r in log_records(tmp_path / "sup") if "train_loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, losses
    saved = json.loads((tmp_path / "sup" / "results.json").read_text())
    for key in ("top1", "top5", "best_top1", "best_epoch", "last_epoch", "wall_time_s", "images_per_s",
                "params", "device"):
        assert key in saved, key
    assert saved["last_epoch"] == 3 and saved["params"] == sum(p.numel() for p in model.parameters())
    assert saved["top1"] > 20  # 10 classes: chance is 10
    assert "supervised top1=" in capsys.readouterr().out
    ckpt = load_checkpoint(tmp_path / "sup")
    assert {"model", "optimizer", "ema", "scaler", "epoch", "iteration", "rng"} <= set(ckpt)


@needs_data
def test_full_recipe_resume_and_changed_config(tmp_path, capsys):
    """The DeiT recipe (RandAugment, mixup/cutmix, erasing, repeated aug, EMA) runs; a run
    resumes; a changed model config on the same run dir is refused naming the key."""
    from resmlp.supervised.train import train
    args = ["epochs=1", "aug.repeats=2", "ema.enabled=true", "model.drop_path_rate=0.1"]
    _, _, res = train(config("supervised", tmp_path, "full", *args))
    assert "ema_top1" in res and res["epochs"] == 1
    capsys.readouterr()
    _, _, res = train(config("supervised", tmp_path, "full", *args[1:], "epochs=2"))
    assert "resuming from" in capsys.readouterr().out and res["last_epoch"] == 2
    assert load_checkpoint(tmp_path / "full")["epoch"] == 2
    with pytest.raises(UserError, match=r"model\.dim: 32 -> 48"):
        train(config("supervised", tmp_path, "full", *args[1:], "epochs=2", "model.dim=48"))


@needs_data
def test_distill_run_and_teacher_class_mismatch(tmp_path):
    from resmlp.supervised.train import train
    bad = save_tiny_classifier(tmp_path, num_classes=7, name="teacher7")
    with pytest.raises(UserError, match=r"7 classes.*has 10"):
        train(config("distill", tmp_path, "dis_bad", "epochs=1", f"distill.teacher={bad}"))
    good = save_tiny_classifier(tmp_path, num_classes=10, name="teacher10")
    _, _, res = train(config("distill", tmp_path, "dis", "epochs=1", f"distill.teacher={good.parent}",
                             "distill.type=soft", "distill.tau=2.0"))
    assert res["teacher"]["spec"] == str(good.parent) and res["distill_type"] == "soft"
    with pytest.raises(UserError, match="DINO checkpoint"):
        dino_dir, _, _ = save_dino_checkpoint(tmp_path)
        train(config("distill", tmp_path, "dis_dino", "epochs=1", f"distill.teacher={dino_dir}"))


@needs_data
def test_finetune_starts_from_the_checkpoint_teacher(tmp_path):
    from resmlp.core.checkpoint import saved_config
    from resmlp.supervised.step import layer_decay_groups
    from resmlp.supervised.train import build_networks, train
    dino_dir, teacher_sd, student_sd = save_dino_checkpoint(tmp_path)
    # as `bash run.sh finetune <dir>` builds it: model and data from the checkpoint's config
    cfg = load_config("finetune", None, ["num_workers=0", "eval_limit=200", "batch_size=32", "demo=false",
                                         "eval_every=0", "epochs=1", "finetune.layer_decay=0.75",
                                         "finetune.min_steps=12", f"checkpoint={dino_dir}", f"out={tmp_path / 'ft'}"],
                      base=saved_config(str(dino_dir)))
    assert cfg.model.dim == 32 and cfg.model.depth == 2 and cfg.data.subset == 128
    model, teacher, info = build_networks(cfg, 10, torch.device("cpu"))
    sd = model.state_dict()
    assert teacher is None and info["init"]["key"] == "teacher"
    assert set(teacher_sd) == {k for k in sd if not k.startswith("head.")}
    for k, v in teacher_sd.items():
        assert torch.equal(sd[k], v), k
        assert not torch.equal(sd[k], student_sd[k]), k
    assert sd["head.weight"].shape == (10, 32)
    groups = layer_decay_groups(model, 0.75)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert scale[id(named["head.weight"])] == 1.0
    assert scale[id(named["blocks.1.mlp.fc1.weight"])] == pytest.approx(0.75)
    assert scale[id(named["patch_embed.proj.weight"])] == pytest.approx(0.75 ** 3)
    _, _, res = train(cfg)
    assert res["init"]["checkpoint"] == str(dino_dir) and res["layer_decay"] == 0.75
    # 128 images in batches of 32: 1 epoch is 4 steps, under finetune.min_steps=12: 3 epochs ran,
    # as the log's iterations say; config.yaml keeps what was asked (what a rerun compares)
    assert (res["epochs"], res["steps"], res["min_steps"]) == (3, 12, 12)
    assert max(r.get("iteration", 0) for r in log_records(tmp_path / "ft")) == 12
    assert OmegaConf.load(tmp_path / "ft" / "config.yaml").epochs == 1


@pytest.mark.parametrize("demo", ["true", "false"])
def test_the_finetune_default_gives_a_small_labeled_set_its_minimum_of_steps(demo):
    """500 labeled images, the default budget (the CPU demo's and the GPU preset's): the
    schedule the trainer makes holds at least finetune.min_steps optimizer steps, with the
    fewest epochs that reach it and the warm-up in proportion; a large set keeps its epochs."""
    from resmlp.core.schedules import cosine_schedule
    from resmlp.data.resumable import EpochSampler
    from resmlp.supervised.train import step_budget
    cfg = load_config("finetune", "resmlp_s12", [f"demo={demo}", "checkpoint=x"])
    least = cfg.finetune.min_steps
    ipe = EpochSampler(500, cfg.batch_size, world_size=1, rank=0).batches_per_epoch
    assert least > 0 and cfg.epochs * ipe < least   # the asked epochs alone fall short
    plan, line = step_budget(cfg, 500, ipe)
    lr = cosine_schedule(1.0, 0.0, plan["epochs"], ipe, plan["warmup_epochs"])
    assert len(lr) >= least and (plan["epochs"] - 1) * ipe < least
    assert plan["warmup_epochs"] / plan["epochs"] == pytest.approx(cfg.optim.warmup_epochs / cfg.epochs)
    assert f"under finetune.min_steps={least}; training {plan['epochs']} epochs" in line and "\n" not in line
    ipe = EpochSampler(60000, cfg.batch_size, world_size=1, rank=0).batches_per_epoch
    assert step_budget(cfg, 60000, ipe) == ({"epochs": cfg.epochs, "warmup_epochs": cfg.optim.warmup_epochs,
                                              "eval_every": cfg.eval_every, "ckpt_epochs": cfg.ckpt_epochs}, None)


@needs_data
def test_finetune_rejects_a_checkpoint_that_does_not_fit(tmp_path):
    from resmlp.supervised.train import build_networks
    dino_dir, _, _ = save_dino_checkpoint(tmp_path)
    cfg = config("finetune", tmp_path, "ft_bad", f"checkpoint={dino_dir}", "model.dim=48")
    with pytest.raises(UserError, match="is not a backbone resmlp_s12 can take"):
        build_networks(cfg, 10, torch.device("cpu"))
    junk = tmp_path / "junk.pth"
    torch.save({"epoch": 3, "note": "not weights"}, junk)
    cfg = config("finetune", tmp_path, "ft_junk", f"checkpoint={junk}")
    with pytest.raises(UserError):
        build_networks(cfg, 10, torch.device("cpu"))


# ---- configs ---------------------------------------------------------------------------------

def test_distill_and_finetune_extend_the_supervised_recipe(tmp_path, monkeypatch):
    """distill.yaml and finetune.yaml say `extends: supervised`: they get every recipe key
    from it and change only their own; a base that is missing or a cycle is a user error."""
    from resmlp.core import config as config_module
    sup = load_config("supervised", "resmlp_s12", ["demo=false"])
    dis = load_config("distill", "resmlp_s12", ["demo=false"])
    fin = load_config("finetune", "resmlp_s12", ["demo=false", "checkpoint=x"])
    assert OmegaConf.to_container(dis.aug) == OmegaConf.to_container(sup.aug)
    assert dis.optim.lr == sup.optim.lr and dis.epochs == sup.epochs and dis.distill.type == "hard"
    assert fin.optim.opt == sup.optim.opt and fin.optim.lr_batch == sup.optim.lr_batch
    assert (fin.optim.lr, fin.epochs, fin.finetune.key) == (1e-3, 30, "teacher") and fin.optim.lr != sup.optim.lr
    assert "extends" not in dis and "distill" not in sup and "finetune" not in dis
    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "a.yaml").write_text("extends: b\n")
    (tmp_path / "method" / "b.yaml").write_text("extends: a\n")
    (tmp_path / "method" / "c.yaml").write_text("extends: nowhere\n")
    monkeypatch.setattr(config_module, "CONFIG_DIR", tmp_path)
    with pytest.raises(UserError, match="cycle"):
        config_module.method_config("a")
    with pytest.raises(UserError, match="nowhere"):
        config_module.method_config("c")


def test_cpu_demos_share_the_dino_demos_model_images_and_batch():
    """The demos are compared in one table (and in the README): same model size, training
    images and batch for every path, and compare's DINO budget is the DINO demo's."""
    def demo(command, *extra):
        return load_config(command, "resmlp_s12", ["demo=true", *extra])
    dino = demo("dino")
    shape = lambda c: (c.model.dim, c.model.depth, c.data.subset, c.batch_size)  # noqa: E731
    for command in ("supervised", "distill", "compare"):
        assert shape(demo(command)) == shape(dino), command
    assert demo("compare").compare.epochs.dino == dino.epochs


# ---- compare ---------------------------------------------------------------------------------

FAKE = {  # structurally real results.json contents per command
    "supervised": lambda s: {"command": s.command, "model": s.model, "epochs": 1, "params": 30000,
                             "top1": 81.25 if s.key == "supervised" else 84.5, "top5": 98.5,
                             "wall_time_s": 12.0, "device": "cpu (2 cores)"},
    "distill": lambda s: {"command": "distill", "epochs": 1, "params": 30000, "top1": 82.75, "top5": 99.0,
                          "wall_time_s": 15.0, "device": "cpu (2 cores)", "distill_type": "hard",
                          "teacher": {"spec": "x", "model": "regnety_002", "top1": 84.5}},
    "dino": lambda s: {"command": "dino", "epochs": 1, "params": 29000, "knn_top1": 71.5, "knn_top5": 96.0,
                       "knn_k": 20, "knn_T": 0.07, "wall_time_s": 30.0, "device": "cpu (2 cores)"},
    "linear": lambda s: {"command": "linear", "protocol": "lbfgs", "mode": "cached", "l2": 1e-5, "top1": 74.0,
                         "top5": 97.0, "wall_time_s": 3.0, "device": "cpu (2 cores)"},
    "finetune": lambda s: {"command": "finetune", "epochs": 1, "params": 30000, "top1": 83.5, "top5": 99.25,
                           "wall_time_s": 10.0, "device": "cpu (2 cores)"},
}


def test_compare_keeps_what_the_linear_paths_protocol_chose(tmp_path, monkeypatch):
    """The linear path's results.json: lbfgs's chosen L2 and no epochs (it has none), DINO's
    protocol its epochs and best lr, as its linear.json says."""
    import resmlp.eval.linear
    from resmlp.supervised import compare
    cfg = load_config("compare", "resmlp_s12", ["demo=false", "model.dim=32", "model.depth=2",
                                                "compare.linear_mode=cached", f"out={tmp_path / 'cmp'}"])
    step = next(s for s in compare.plan(cfg) if s.key == "linear")
    sub = compare.sub_config(cfg, step)
    wrote = {}

    def probe(_cfg):   # the linear command's file, as it writes it
        step.dir.mkdir(parents=True, exist_ok=True)
        (step.dir / "linear.json").write_text(json.dumps(wrote))
    monkeypatch.setattr(resmlp.eval.linear, "run", probe)
    monkeypatch.setattr(compare, "record_inputs", lambda *a: None)   # no DINO run here to name
    wrote.update(protocol="lbfgs", l2=3e-5, top1=70.0, top5=95.0)
    res = compare.run_step(step, sub)
    assert (res["protocol"], res["mode"], res["l2"], res["top1"]) == ("lbfgs", "cached", 3e-5, 70.0)
    assert "epochs" not in res and "lr" not in res
    assert json.loads((step.dir / "results.json").read_text()) == res
    wrote.update(protocol="dino", lr=1e-3)
    res = compare.run_step(step, sub)
    assert (res["protocol"], res["epochs"], res["lr"]) == ("dino", 100, 1e-3) and "l2" not in res


def test_compare_builds_its_table_from_finished_runs(tmp_path, monkeypatch, capsys):
    from resmlp.supervised import compare

    def cfg_with(*extra):
        return load_config("compare", "resmlp_s12", [
            "demo=false", "model.dim=32", "model.depth=2", "data.subset=128", "batch_size=32",
            "compare.epochs.teacher=1", "compare.epochs.supervised=1", "compare.epochs.distill=1",
            "compare.epochs.dino=1", "compare.epochs.linear=1", "compare.epochs.finetune=1",
            "compare.linear_mode=cached", f"out={tmp_path / 'cmp'}", *extra])

    cfg = cfg_with()
    steps = compare.plan(cfg)
    assert [s.key for s in steps] == ["teacher", "supervised", "distill", "dino", "linear", "finetune"]
    for step in steps:  # fake finished runs: the configs compare would write, and results
        sub = compare.sub_config(cfg, step)
        save_config(sub, step.dir / "config.yaml")
        (step.dir / "results.json").write_text(json.dumps(FAKE[step.command](step)))

    def no_training(*_a, **_k):
        raise AssertionError("compare retrained a finished run")
    import resmlp.eval.linear
    import resmlp.ssl.train
    import resmlp.supervised.train
    monkeypatch.setattr(resmlp.supervised.train, "train", no_training)
    monkeypatch.setattr(resmlp.ssl.train, "train", no_training)
    monkeypatch.setattr(resmlp.eval.linear, "run", no_training)

    assert compare.run(cfg) == 0
    out = capsys.readouterr().out
    assert out.count("reusing the finished run") == 6
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| Training path | Params (M) | Epochs | Top-1 | Top-5 | Wall time | Hardware |" in md
    assert "| supervised, from scratch | 0.03 | 1 | 81.25 | 98.50 | 12 s | cpu (2 cores) | 76.6 |" in md
    assert "distillation (hard, teacher regnety_002, 84.5% top-1)" in md and "82.75" in md
    assert "k-NN (k=20, T=0.07) | 0.03 | 1 | 71.50" in md
    # the probe says what ran: lbfgs names the L2 it chose and has no epochs of its own
    assert "linear probe (lbfgs on cached features, L2 1e-05) | 0.03 | 1 | 74.00" in md and "33 s (incl. DINO)" in md
    assert "fine-tuning | 0.03 | 1 + 1 | 83.50 | 99.25 | 40 s (incl. DINO)" in md
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["path"] for r in data["rows"]] == list(compare.PATHS)
    # DINO's protocol: its epochs after DINO's (a run from before linear.protocol ran it too)
    dino_probe = {**data["runs"], "linear": {"protocol": "dino", "mode": "augmented", "epochs": 100, "top1": 70.0}}
    older = {**data["runs"], "linear": {"mode": "cached", "epochs": 100, "top1": 70.0}}
    for runs, label in ((dino_probe, "DINO's protocol, augmented"), (older, "DINO's protocol, cached")):
        row = compare.rows(cfg, runs)[3]
        assert (row["label"], row["epochs"]) == (f"pre-trained SSL (DINO) + linear probe ({label})", "1 + 100")
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 0

    # another budget for a finished run: refused, naming the difference
    with pytest.raises(UserError, match=r"supervised.*epochs: 1 -> 2"):
        compare.collect(cfg_with("compare.epochs.supervised=2"), log=lambda m: None)
