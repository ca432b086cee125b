"""Feature banks planned against a memory budget before they are built (eval/memory.py): the
CPU demo's raw-pixel baseline at a smaller side or skipped, the trainer's k-NN bank a
class-balanced subset, the knn / linear commands' features refused in one line."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from resmlp.core.config import load_config
from resmlp.core.errors import UserError
from resmlp.eval.judge import eval_data
from resmlp.eval import memory
from resmlp.eval.features import features_for
from resmlp.eval.knn import online_knn

GB = 2**30


def small_machine(monkeypatch, available: int) -> None:
    """This machine has `available` bytes free (the budget is memory.BUDGET_FRACTION of it)."""
    monkeypatch.setattr(memory, "host_available", lambda: available)


def test_the_issue_s_pixel_baseline_is_sized_down_before_anything_is_read(monkeypatch):
    # the demo on a folder at 224 px, judged on Fashion-MNIST: 70,000 images of 150,528 floats
    cfg = load_config("dino", "resmlp_s12", ["demo=true", "data=folder", "data.root=/nowhere", "data.img_size=224",
                                             "eval.data=fashion_mnist"])
    small_machine(monkeypatch, 2 * GB)
    plan = memory.pixel_baseline(eval_data(cfg), cfg.data.img_size, cfg.features.memory_gb)
    budget = memory.BUDGET_FRACTION * 2 * GB
    assert plan.side is not None and 8 <= plan.side < 224
    assert memory.bank_bytes(70000, 3 * plan.side ** 2) <= budget < memory.bank_bytes(70000, 3 * (plan.side + 1) ** 2)
    assert plan.line.startswith(f"raw-pixel baseline at {plan.side} px, area-averaged from 224 px") and \
        memory.gb(memory.bank_bytes(70000, 3 * 224 ** 2)) in plan.line and "\n" not in plan.line
    x = torch.rand(2, 3, 224, 224)
    assert plan.model()(x).shape == (2, 3 * plan.side ** 2)


def test_pixels_that_fit_stay_whole_and_too_little_memory_skips_them_in_one_line(monkeypatch):
    whole = memory.plan_pixels(100, 32, budget=memory.bank_bytes(100, 3 * 32 * 32))
    assert whole.side == 32 and whole.line is None and isinstance(whole.model(), nn.Flatten)
    skipped = memory.plan_pixels(100, 32, budget=memory.bank_bytes(100, 3 * 8 * 8) - 1, memory_gb=0.5)
    assert skipped.side is None and skipped.model() is None
    assert skipped.line.startswith("raw-pixel baseline skipped: even at 8 px") and "features.memory_gb=0.5" in skipped.line
    assert memory.plan_pixels(100, 32, budget=None).side == 32   # no budget known: nothing is sized


def test_budget_is_the_setting_or_a_fraction_of_what_is_available(monkeypatch):
    small_machine(monkeypatch, 8 * GB)
    assert memory.budget_bytes() == int(8 * GB * memory.BUDGET_FRACTION)
    assert memory.budget_bytes(memory_gb=1.5) == int(1.5 * GB)
    monkeypatch.undo()
    have = memory.host_available()   # this machine's MemAvailable (/proc/meminfo), where it has one
    assert have is None or have > 0


def test_bank_plan_keeps_what_fits_beside_the_queries_or_refuses():
    dim = 16
    per = dim * memory.FLOAT_BYTES * memory.PEAK
    assert memory.plan_bank(1000, 100, dim, budget=1100 * per) == (1000, None)
    keep, line = memory.plan_bank(1000, 100, dim, budget=600 * per)
    assert keep == 500 and line.endswith("its bank is a class-balanced subset of 500 of them")
    with pytest.raises(UserError, match="not even 20 training images fit beside the queries"):
        memory.plan_bank(1000, 100, dim, budget=110 * per, least=20)


def tiny_features(x):
    return x.mean(dim=(2, 3))   # 3 features per image


class Tiny(nn.Module):
    def forward(self, x):
        return tiny_features(x)


def test_online_knn_bank_is_a_class_balanced_subset_within_a_small_budget(tmp_path, capsys):
    from test_folder import labeled
    root = labeled(tmp_path / "lab", per_class=20)   # 40 training and 40 test images, 2 classes
    data = load_config("knn", "resmlp_s12", ["data=imagefolder", f"data.root={root}", "data.img_size=16"]).data
    per = 3 * memory.FLOAT_BYTES * memory.PEAK
    gb = (40 + 10) * per / GB                           # room for the queries and 10 training images
    cache: dict = {}
    res = online_knn(Tiny(), data, "cpu", ks=(3,), cache=cache, memory_gb=gb)
    assert res["n_train"] == 10 and res["n_test"] == 40
    out = capsys.readouterr().out
    assert out.count("its bank is a class-balanced subset of 10 of them") == 1
    again = online_knn(Tiny(), data, "cpu", ks=(3,), cache=cache, memory_gb=gb)
    assert again["n_train"] == 10 and "subset" not in capsys.readouterr().out   # said once per run
    assert online_knn(Tiny(), data, "cpu", ks=(3,), memory_gb=1.0)["n_train"] == 40


def test_features_that_pass_the_budget_are_refused_before_extraction(tmp_path, monkeypatch):
    from resmlp.eval import features
    from test_folder import labeled
    root = labeled(tmp_path / "lab", per_class=20)
    data = load_config("knn", "resmlp_s12", ["data=imagefolder", f"data.root={root}", "data.img_size=16"]).data
    monkeypatch.setattr(features, "extract_features", lambda *a, **k: pytest.fail("extracted"))
    with pytest.raises(UserError) as e:
        features_for(Tiny(), {"weights_hash": "x"}, data, "train", cache_dir=tmp_path / "cache",
                     memory_gb=20 * 3 * memory.FLOAT_BYTES * memory.PEAK / GB)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the train features of 40 images (3 wide) would take")
    assert "data.subset=20" in msg and "features.memory_gb=" in msg
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- a stop during an evaluation

def test_a_stop_signal_ends_an_extraction_at_the_next_batch_and_the_run_keeps_its_training(monkeypatch, tmp_path):
    import os
    import signal
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from resmlp.core import preempt
    from resmlp.core.cadence import Cadence
    from resmlp.core.errors import Preempted
    from resmlp.eval.features import extract_features

    seen = []
    loader = [(torch.rand(4, 3, 8, 8), torch.zeros(4)) for _ in range(5)]

    class Counting(nn.Module):
        def forward(self, x):
            seen.append(len(x))
            if len(seen) == 2:   # the signal comes while the second batch is extracted
                os.kill(os.getpid(), signal.SIGTERM)
            return tiny_features(x)

    saved = []
    run = SimpleNamespace(cfg=OmegaConf.create({"epochs": 1, "log_every": 50, "log_every_s": 0, "ckpt_every": 0,
                                                "ckpt_epochs": 1, "eval_every": 0}),
                          started=0.0, dir=tmp_path, memory_mb=dict, save=lambda state: saved.append(state["iteration"]))
    with preempt.watch():
        cadence = Cadence(run, iterations_per_epoch=10, start_it=0, results={}, state={})
        with pytest.raises(Preempted, match="stopped by SIGTERM during an evaluation before training began"):
            with cadence.evaluating():
                extract_features(Counting(), loader, "cpu")
        assert seen == [4, 4] and saved == []          # not one batch more; nothing trained, nothing saved
        cadence.last_read = 7                          # 7 iterations trained since the last checkpoint (none)
        with cadence.evaluating():                     # a signal from before an evaluation lets it finish
            assert extract_features(Counting(), loader, "cpu")[0].shape == (20, 3)
        seen.clear()                                   # a new signal, during the next one, ends it
        with pytest.raises(Preempted, match="after iteration 7 of 10, with a checkpoint of it"):
            with cadence.evaluating():
                extract_features(Counting(), loader, "cpu")
        assert seen == [4, 4] and saved == [7]
    # outside a trainer's watch (the knn command) a signal noted earlier stops nothing
    assert extract_features(Counting(), loader, "cpu")[0].shape == (20, 3)
