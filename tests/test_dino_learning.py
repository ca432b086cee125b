"""DINO must learn on a small ResMLP (issues 15 and 21, docs/dino_learning.md): the head's
bottleneck norm, the collapse watch, and two short Fashion-MNIST runs of one tiny recipe,
one with DINO as published (its teacher drifts to uniform targets, and the watch must say
so while it happens) and one with the recipe's DINOv2 remedies, Sinkhorn-Knopp centering and
KoLeo (it must keep learning)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.ssl.health import COLLAPSE_KL, CollapseWatch, collapse_kl, drift_advice

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")

# The CI recipe: a ResMLP small enough for CI at a learning rate where DINO as published
# drifts to uniform targets within the run, with DINOv2's remedies, which learned there at
# least as well as the bottleneck norm (seed 0; the numbers asserted below were measured on it).
LEARN = ["demo=false", "model.dim=32", "model.depth=2", "model.drop_path_rate=0.0", "data.subset=1000",
         "batch_size=32", "epochs=20", "dino.out_dim=256", "dino.hidden_dim=128", "dino.bottleneck_dim=32",
         "dino.n_local_crops=2", "optim.lr=0.004", "optim.warmup_epochs=1", "dino.momentum_teacher=0.99",
         "eval_every=1000", "num_workers=0", "dino.final_linear=false", "log_every=25",
         "dino.centering=sinkhorn", "dino.koleo_weight=0.1"]
PUBLISHED = ["dino.bottleneck_norm=none", "dino.centering=mean", "dino.koleo_weight=0"]


def _dino(out, *extra):
    proc = subprocess.run([sys.executable, "-m", "resmlp.core.cli", "dino", "resmlp_s12", *LEARN, f"out={out}",
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    return proc.stdout, [r for r in lines if "loss" in r], json.loads((Path(out) / "results.json").read_text())


# ---- pieces ------------------------------------------------------------------------------
def test_batch_standardize_is_batchnorm_without_weights_or_state():
    from resmlp.ssl.head import BatchStandardize
    torch.manual_seed(0)
    x = torch.randn(40, 6) * 3 + torch.arange(6.0)
    norm = BatchStandardize()
    y = norm(x)
    assert torch.allclose(y, torch.nn.BatchNorm1d(6, affine=False)(x), atol=1e-5)
    assert torch.allclose(y.mean(0), torch.zeros(6), atol=1e-5)  # nothing left that every image shares
    assert not list(norm.state_dict())                            # checkpoints keep their keys
    assert torch.allclose(norm.eval()(x), y)                      # no running statistics to switch to


def test_bottleneck_norm_keeps_the_head_keys_and_can_be_turned_off(tmp_path):
    from resmlp.ssl.head import BatchStandardize, build_head
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "dino.bottleneck_norm=none", f"out={tmp_path}"])
    plain = build_head(16, cfg.dino)
    assert not any(isinstance(m, BatchStandardize) for m in plain.modules())  # DINO's head as published
    cfg.dino.bottleneck_norm = "batchnorm"
    normed = build_head(16, cfg.dino)
    assert any(isinstance(m, BatchStandardize) for m in normed.modules())
    assert list(plain.state_dict()) == list(normed.state_dict())  # checkpoints load either way
    frozen = [n for n, p in normed.named_parameters() if not p.requires_grad]
    assert "layers.4.bias" in frozen  # the shift the standardization removes is not trained
    assert "layers.4.bias" not in [n for n, p in plain.named_parameters() if not p.requires_grad]
    cfg.dino.bottleneck_norm = "layernorm"
    with pytest.raises(UserError, match="dino.bottleneck_norm"):
        build_head(16, cfg.dino)


def test_each_preset_uses_the_head_its_runs_chose(tmp_path):
    """DINO's published head everywhere (no run showed the bottleneck norm to beat DINOv2's
    remedies); DINO's centering wherever no run on that budget measured another; and each
    preset's file says which head and why."""
    chosen = {("demo=true",): ("none", "sinkhorn", 0.1), ("demo=false",): ("none", "mean", 0.0),
              ("data=imagenet",): ("none", "mean", 0.0), ("data=cifar10", "demo=false"): ("none", "mean", 0.0)}
    for overrides, want in chosen.items():
        d = load_config("dino", "resmlp_s12", [*overrides, f"out={tmp_path}"]).dino
        assert (d.bottleneck_norm, d.centering, d.koleo_weight) == want, overrides
    for recipe in ("dino_fashion_mnist", "dino_imagenet"):
        lines = (ROOT / "configs" / "recipe" / f"{recipe}.yaml").read_text().splitlines()
        i = next(i for i, line in enumerate(lines) if line.strip().startswith("bottleneck_norm:"))
        assert "published" in " ".join(lines[i - 2:i]), recipe


def test_collapse_watch_warns_once_per_episode_and_names_the_knob():
    watch = CollapseWatch(threshold=0.35, patience=3, advice="turn the knob")
    said = [watch.update(kl) for kl in (1.0, 0.3, 0.2, 0.9, 0.3, 0.2, 0.1, 0.1, 0.1)]
    # the dip at lines 2-3 is too short; the one from line 5 on warns once, at its third line
    assert [i for i, s in enumerate(said) if s] == [6]
    assert "DINO is collapsing" in said[6] and "turn the knob" in said[6]
    assert watch.update(0.5) is None and watch.update(0.1) is None  # back up: a new episode starts
    assert all(CollapseWatch(0.0, 1).update(kl) is None for kl in (0.0, 0.1))  # 0 turns it off
    with pytest.raises(ValueError):
        CollapseWatch(0.35, 0)


def test_collapse_watch_resumes_its_episode_from_the_checkpoint():
    """A resumed run continues the watch where its checkpoint left it: an episode already
    reported is not reported again, one under way warns at the same line as without the stop."""
    lines = (0.3, 0.2, 0.1, 0.1, 0.1, 0.5, 0.3, 0.2, 0.1)
    whole = CollapseWatch(0.35, 3)
    want = [i for i, kl in enumerate(lines) if whole.update(kl)]
    for cut in range(1, len(lines)):
        before = CollapseWatch(0.35, 3)
        said = [i for i, kl in enumerate(lines[:cut]) if before.update(kl)]
        after = CollapseWatch(0.35, 3)
        after.load_state_dict(dict(before.state_dict()))
        said += [cut + i for i, kl in enumerate(lines[cut:]) if after.update(kl)]
        assert said == want == [2, 8], cut


def test_drift_advice_names_the_remedy_that_fits_the_setting(tmp_path):
    def advice(*overrides):
        return drift_advice(load_config("dino", "resmlp_s12", ["demo=false", f"out={tmp_path}", *overrides]).dino)
    published = advice("dino.bottleneck_norm=none")
    assert "dino.centering=sinkhorn" in published and "dino.bottleneck_norm=batchnorm" in published
    assert "dino.koleo_weight" in advice("dino.centering=sinkhorn")
    for remedied in (["dino.bottleneck_norm=batchnorm"], ["dino.centering=sinkhorn", "dino.koleo_weight=0.1"]):
        assert "optim.lr" in advice(*remedied) and "bottleneck_norm" not in advice(*remedied)


def test_the_watch_threshold_follows_the_centering_unless_set(tmp_path):
    def threshold(*overrides):
        return collapse_kl(load_config("dino", "resmlp_s12", ["demo=false", f"out={tmp_path}", *overrides]).dino)
    assert threshold() == COLLAPSE_KL["mean"]
    assert threshold("dino.centering=sinkhorn") == COLLAPSE_KL["sinkhorn"] < COLLAPSE_KL["mean"]
    assert threshold("dino.centering=sinkhorn", "dino.collapse_kl=0.5") == 0.5


# ---- the runs ----------------------------------------------------------------------------
@needs_fmnist
def test_published_head_collapses_and_the_watch_says_so_while_it_happens(tmp_path):
    stdout, logs, _ = _dino(tmp_path / "published", *PUBLISHED)
    kl = [r["teacher_kl_mean"] for r in logs]
    assert min(kl) < 0.35, kl                                    # the drift to uniform targets happens
    warned = [i for i, line in enumerate(stdout.splitlines()) if "DINO is collapsing" in line]
    assert warned, stdout[-2000:]
    assert "dino.centering=sinkhorn" in stdout.splitlines()[warned[0]]
    last_log = max(i for i, line in enumerate(stdout.splitlines()) if line.startswith("ep "))
    assert warned[0] < last_log                                  # during the run, not after it


@needs_fmnist
def test_dino_keeps_learning_on_a_tiny_resmlp_with_dinov2s_remedies(tmp_path):
    stdout, logs, results = _dino(tmp_path / "recipe")
    kl = [r["teacher_kl_mean"] for r in logs]
    assert min(kl[2:]) > KL_FLOOR, kl                           # targets keep depending on the image
    assert "DINO is collapsing" not in stdout
    assert results["knn_top1"] > results["init_knn_top1"] + KNN_MARGIN, results


# Measured on this recipe (docs/dino_learning.md): with Sinkhorn-Knopp and KoLeo the KL never
# fell under 0.44 (the watch's threshold under Sinkhorn-Knopp is 0.2) and k-NN rose by 5.9
# points; DINO as published fell to 0.18 and rose by 0.9.
KL_FLOOR, KNN_MARGIN = 0.3, 3.0
