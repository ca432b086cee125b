"""The study scripts of studies/ at a tiny size: a rename in the package must break here,
not in a study's next run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.exists(), reason="Debian's dataset-fashion-mnist is not installed")

TINY = ["demo=false", "model.dim=16", "model.depth=2", "data.subset=64", "batch_size=32", "epochs=1",
        "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16", "dino.n_local_crops=2",
        "optim.warmup_epochs=1", "num_workers=0", "eval_every=0", "log_every=1", "dino.final_linear=false",
        "model.drop_path_rate=0.0"]


def _study(script, *args, env=None, timeout=600):
    proc = subprocess.run([sys.executable, str(ROOT / "studies" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_fmnist
def test_probe_with_its_interventions_then_the_spectrum(tmp_path):
    switches = {"PROBE_EVERY": "1", "HEAD_INIT": "lecun", "FEAT_SCALE": "2", "BOTTLENECK_CENTER": "1",
                "WHITEN": "0.1", "NO_PHOTOMETRIC": "1", "POOLING": "class_mlp"}
    out = _study("dino_learning_probe.py", *TINY, f"out={tmp_path / 'run'}", env=switches)
    assert "knn top1=" in out
    lines = [json.loads(line) for line in (tmp_path / "run" / "probe.jsonl").read_text().splitlines()]
    assert [r["it"] for r in lines] == [0, 1]
    assert {"x", "lin0", "lin2", "z_cos_zero_input", "zn_cos", "x_pr", "z_pr", "agree", "distinct"} <= set(lines[0])
    out = _study("dino_learning_spectrum.py", str(tmp_path / "run"))
    assert "raw pixels: top direction" in out and "whitened" in out.splitlines()[-1]


@needs_fmnist
def test_probe_with_a_timm_backbone(tmp_path):
    _study("dino_learning_probe.py", *TINY, "data.subset=32", f"out={tmp_path}", "dino.local_crops=resize",
           env={"BACKBONE": "resnet10t", "BACKBONE_NORM": "gn", "FEAT_BN": "1", "HEAD_NOBIAS": "1",
                "BOTTLENECK_BN": "1"})
    assert (tmp_path / "probe.jsonl").exists()


def test_spectrum_without_a_checkpoint_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "studies" / "dino_learning_spectrum.py"),
                           str(tmp_path / "nothing")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@needs_fmnist
def test_lr_sweep_runs_points_once_then_tables_them(tmp_path):
    tiny = [o for o in TINY if not o.startswith("eval_every=")]
    out = _study("lr_sweep.py", "run", "published", "--lr", "0.002,0.004", "--out", str(tmp_path), *tiny)
    assert out.count("bash run.sh dino resmlp_s12 ") == 2
    points = sorted(p.name for p in (tmp_path / "published").iterdir() if p.is_dir())
    assert points == ["lr0.002_b32_e1_w1", "lr0.004_b32_e1_w1"]  # the rate, and the tiny run's batch, epochs, warm-up
    for point in points:
        assert (tmp_path / "published" / point / "results.json").exists()
        record = json.loads((tmp_path / "published" / f"{point}.json").read_text())
        assert record["rc"] == 0 and "dino.centering=mean" in record["command"]
    again = _study("lr_sweep.py", "run", "published", "--lr", "0.002", "--out", str(tmp_path), *tiny)
    assert "finished, not run again" in again and "bash run.sh" not in again
    figure = tmp_path / "sweep.png"
    table = _study("lr_sweep.py", "table", "--out", str(tmp_path), "--figure", str(figure))
    rows = [line for line in table.splitlines() if line.startswith("| lr0.00")]
    assert len(rows) == 4  # each point in the main table and in the k-NN per epoch
    assert figure.stat().st_size > 0
    assert "| point | 0 | 1 |" in table  # the k-NN at init and after the one epoch


def test_lr_sweep_refuses_a_point_that_holds_another_command(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "lr0.002.json").write_text(json.dumps({"command": "bash run.sh dino something else"}))
    proc = subprocess.run([sys.executable, str(ROOT / "studies" / "lr_sweep.py"), "run", "demo", "--lr", "0.002",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "holds a run of another command" in proc.stderr
    assert not (tmp_path / "demo" / "lr0.002").exists()
