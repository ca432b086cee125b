"""Your own folder on a CPU: demo=auto sizes data=folder / imagefolder as the Fashion-MNIST
demo (32 px, patch 4, the demo's small model) and says so in its first line; progress shows
by time as well as by iteration count (log_every_s), and during a long extraction."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.cadence import Cadence
from resmlp.eval import features
from test_folder import labeled, photos

DEMO_SIZE = {"data.img_size": 32, "data.local_size": 16, "model.patch_size": 4, "data.crop_ratio": 1.0}


@pytest.mark.parametrize("data", ["folder", "imagefolder"])
def test_the_cpu_demo_on_your_own_images_trains_at_fashion_mnist_s_size(data):
    cfg = load_config("dino", "resmlp_s12", ["demo=true", f"data={data}", "data.root=/x"])
    assert {k: OmegaConf.select(cfg, k) for k in DEMO_SIZE} == DEMO_SIZE
    assert cfg.model.dim == 64 and cfg.model.depth == 4 and cfg.epochs == 8
    # the command line still wins; demo=false keeps the folder's own size
    assert load_config("dino", "resmlp_s12", ["demo=true", f"data={data}", "data.root=/x",
                                              "data.img_size=64"]).data.img_size == 64
    real = load_config("dino", "resmlp_s12", ["demo=false", f"data={data}", "data.root=/x"])
    assert real.data.img_size == 224 and real.model.patch_size == 16
    # a command that reads a checkpoint keeps the size the checkpoint was trained at
    saved = {"model": {"name": "resmlp_s12", "patch_size": 16}, "data": {"name": data, "img_size": 224}}
    tuned = load_config("finetune", None, ["demo=true", "data.root=/x"], base=saved)
    assert tuned.data.img_size == 224 and tuned.model.patch_size == 16


class FakeRun(SimpleNamespace):
    def memory_mb(self):
        return {}


def test_a_slow_iteration_still_gets_a_log_line_by_time():
    cfg = OmegaConf.create({"epochs": 1, "log_every": 50, "log_every_s": 20, "ckpt_every": 0, "ckpt_epochs": 1,
                            "eval_every": 0})
    run = FakeRun(cfg=cfg, started=0.0)
    cadence = Cadence(run, iterations_per_epoch=1000, start_it=0, results={}, state={})
    now = [100.0]
    cadence.clock = lambda: now[0]
    cadence.logged_at = now[0]
    assert cadence.log_due(1)                     # the first iteration, as before
    cadence.log_record(1)
    now[0] += 19.9
    assert not cadence.log_due(2)                 # neither 50 iterations nor 20 s yet
    now[0] += 0.2
    assert cadence.log_due(3)                     # 20 s since the last line: one now
    cadence.log_record(3)
    assert not cadence.log_due(4) and cadence.log_due(50)
    cadence.log_every_s = 0                       # log_every_s=0: by iterations only
    now[0] += 1000
    assert not cadence.log_due(5)


def test_an_extraction_says_where_it_is_by_time(capsys):
    now = [0.0]
    said = features.Progress("knn train", 600, enabled=True, clock=lambda: now[0])
    for _ in range(6):
        said.batch(100)
        now[0] += features.PROGRESS_S / 2 + 0.1   # two batches per PROGRESS_S
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["knn train: 200/600 images (20 s)", "knn train: 400/600 images (40 s)"]
    quiet = features.Progress("knn train", 600, enabled=False, clock=lambda: now[0])
    now[0] += 1000
    quiet.batch(1)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_the_cpu_demo_on_a_folder_runs_and_says_its_size_first(tmp_path, capsys):
    """A short run of the folder's CPU demo, on a machine with little memory to spare: its
    raw-pixel baseline (24 + 24 labeled images of 3 x 32 x 32 floats, counted twice: 1.1 MiB)
    comes at the largest side that fits 0.5 MiB."""
    root, lab = photos(tmp_path / "imgs", 32), labeled(tmp_path / "lab", per_class=12)
    out = tmp_path / "run"
    assert main(["dino", "resmlp_s12", "demo=true", "data=folder", f"data.root={root}", "eval.data=imagefolder",
                 f"eval.root={lab}", "epochs=1", "batch_size=16", "knn.k=[5]", "dino.final_linear=false",
                 f"features.memory_gb={0.5 / 1024}", f"out={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU demo: a small ResMLP (dim 64, depth 4, patch 4) on 32 folder images at 32 px "
                               "for 1 epochs") and "demo=false" in lines[0]
    side = int(math.isqrt(2**19 // (48 * 3 * 4 * 2)))
    assert f"raw-pixel baseline at {side} px, area-averaged from 32 px" in "\n".join(lines)
    res = json.loads((out / "results.json").read_text())
    assert res["demo"] and res["pixels_side"] == side < 32 and 0 <= res["knn_top1"] <= 100
    assert OmegaConf.load(out / "config.yaml").data.img_size == 32
