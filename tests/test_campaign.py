"""`run.sh campaign`: a tiny campaign cut at a point of every stage and called again ends
where an uninterrupted one does (the preset's weights bitwise), its summary lists every
stage, its exit codes say what to do, and its report folder stays within what the lent
GPU machine hands back. Also the bench's largest-batch search and the report's trimming."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resmlp.bench import rows as R
from resmlp.bench.bench import Context
from resmlp.bench.campaign import CUT_ENV, REPORT_FILES
from resmlp.bench.report import MAX_BYTES, ReportError, write_report
from resmlp.core.cli import main
from resmlp.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ["campaign.profile=tiny"]


def campaign(out, cut=None, *extra):
    env = {k: v for k, v in os.environ.items() if k not in (CUT_ENV, "RESMLP_CAMPAIGN_STARTED")}
    if cut:
        env[CUT_ENV] = cut
    done = subprocess.run([sys.executable, "-m", "resmlp.core.cli", "campaign", *TINY, f"out={out}", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "report" / "summary.json").read_text())
    return done, {s["name"]: s for s in summary["stages"]}, summary


def report_obeys_the_limits(folder: Path) -> None:
    entries = list(folder.iterdir())
    assert len(entries) <= 8 and all(p.is_file() for p in entries), entries
    assert all(p.stat().st_size < 16 * 2**20 for p in entries)
    assert {p.name for p in entries} <= set(REPORT_FILES)


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pth", weights_only=False, map_location="cpu")


@pytest.mark.slow
def test_a_campaign_cut_in_every_stage_ends_as_an_uninterrupted_one(tmp_path):
    out = tmp_path / "cut"
    cuts = [("^ep 1/2 it 2/6 ", "preset"),                                  # mid-epoch
            (r"^\[bench\] dino: resmlp_s12 interpolate ours eager", "bench"),  # after a bench line
            ("^campaign: tests starts", "tests"),                          # pytest killed at once
            ("^ep 1/2 it 2/6 ", "compare")]
    for n, (pattern, stage) in enumerate(cuts):
        done, stages, summary = campaign(out, pattern)
        assert done.returncode == 75, done.stdout[-3000:] + done.stderr[-3000:]
        assert stages[stage]["status"] == "cut", (stage, stages)
        assert all(stages[name]["status"] == "done" for _, name in cuts[:n]), stages
        assert summary["call_again"] and "CALL AGAIN" in done.stdout
        report_obeys_the_limits(out / "report")
    done, stages, summary = campaign(out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(stages) == ["preset", "bench", "tests", "compare"]
    assert all(s["status"] == "done" and s["runs"] == 2 for s in stages.values()), stages
    assert not summary["call_again"] and summary["left"] == [] and len(summary["calls"]) == 5
    report_obeys_the_limits(out / "report")
    assert (out / "report" / "preset_results.json").exists() and (out / "report" / "bench.json").exists()

    # the bench went on row by row: nothing measured twice, the first lines kept from run 1
    bench = json.loads((out / "bench" / "bench.json").read_text())
    keys = [r["key"] for r in bench["rows"]]
    assert len(keys) == len(set(keys)) and bench["runs"] == 2 and bench["left"] == 0
    assert {r["run"] for r in bench["rows"]} == {1, 2}
    assert stages["bench"]["lines"] == {"ok": len(keys)}
    # the tests stage says that the CUDA tests skipped here, and why
    assert stages["tests"]["skipped"] >= 1 and stages["tests"]["passed"] == 0
    assert stages["tests"]["skip_reasons"] == ["needs a CUDA GPU"]
    # the preset's results sum its training over both starts and keep each start apart
    preset = stages["preset"]
    timing = preset["results"]["timing"]
    assert [s["at_iteration"] for s in timing["starts"]][0] == 0 and len(timing["starts"]) == 2
    assert timing["train_images"] == (6 - 2) * 16 and timing["train_s"] > 0   # each start's first step apart
    assert [e for e, _ in preset["knn_curve"]] == [0, 1, 2] and preset["epochs_trained"] == 2

    # the same preset uninterrupted: bitwise the same weights
    argv = summary["stages"][0]["command"][1:]
    ref = tmp_path / "uninterrupted"
    argv = [a if not a.startswith("out=") else f"out={ref}" for a in argv]
    whole = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]
    a, b = weights(ref), weights(out / "preset")
    assert a["iteration"] == b["iteration"] == 6
    for key in ("student", "teacher"):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{key}.{name}"

    # resume=auto on the finished run says so and leaves its results as they are (issue 23)
    before = (out / "preset" / "results.json").read_bytes()
    assert json.loads(before)["train_images_per_s"] > 0
    from resmlp.core.errors import Finished
    from resmlp.ssl.train import train
    with pytest.raises(Finished, match="holds a finished run"):
        train(load_config("dino", "resmlp_s12", [*argv[5:], f"out={out / 'preset'}"]))  # argv[4] is out=
    assert (out / "preset" / "results.json").read_bytes() == before


def test_bad_input_is_exit_2_and_a_changed_campaign_is_refused(tmp_path, capsys):
    out = f"out={tmp_path}"
    assert main(["campaign", "campaign.profile=nope", out]) == 2
    assert main(["campaign", "campaign.profile=tiny", "campaign.call_s=10", out]) == 2
    assert "min_start_s + stop_grace_s" in capsys.readouterr().err
    assert main(["campaign", "campaign.profile=tiny", "campaign.stages=[preset,viz]", out]) == 2
    assert "must name some of preset, bench, tests, compare" in capsys.readouterr().err
    state = {"commands": {"preset": ["-m", "resmlp.core.cli", "dino", "resmlp_s12", "epochs=3"]}, "stages": {},
             "calls": []}
    (tmp_path / "campaign.json").write_text(json.dumps(state))
    assert main(["campaign", "campaign.profile=tiny", "campaign.stages=[preset]", out]) == 2
    err = capsys.readouterr().err
    assert "another command" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # through run.sh, whose campaign case sets up before any Python runs
    sh = subprocess.run(["bash", str(ROOT / "run.sh"), "campaign", "campaign.profile=nope", out], cwd=ROOT,
                        env={**os.environ, "RESMLP_PYTHON": sys.executable}, capture_output=True, text=True)
    assert sh.returncode == 2 and sh.stderr.strip().splitlines() == [
        "error: campaign.profile='nope' is not one of gpu, tiny"], sh.stderr


def test_the_report_folder_keeps_to_the_limits(tmp_path):
    folder = tmp_path / "report"
    big = tmp_path / "big.log"
    big.write_text("".join(f"line {i}\n" for i in range(20000)))
    write_report(folder, {"summary.json": {"a": 1}, "campaign.log": big, "absent.json": tmp_path / "none"},
                 max_bytes=4096)
    assert sorted(p.name for p in folder.iterdir()) == ["campaign.log", "summary.json"]
    text = (folder / "campaign.log").read_text()
    assert len(text.encode()) <= 4096 and text.startswith("line 0\n") and text.endswith("line 19999\n")
    assert "bytes left out here" in text and all(x.startswith("line ") or "left out" in x for x in text.splitlines())
    write_report(folder, {"summary.json": {"a": 2}})  # a later call's report replaces the earlier one
    assert [p.name for p in folder.iterdir()] == ["summary.json"]
    with pytest.raises(ReportError, match="at most 8"):
        write_report(folder, {f"f{i}.txt": "x" for i in range(9)})
    with pytest.raises(ReportError, match="names"):
        write_report(folder, {"a/b.txt": "x"})
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    with pytest.raises(ReportError, match="other things"):
        write_report(other, {"summary.json": {}})
    assert MAX_BYTES < 16 * 2**20


def test_largest_batch_doubles_until_out_of_memory(monkeypatch):
    cfg = load_config("bench", "resmlp_s12", ["bench.profile=tiny", "bench.tiny.max_batch=16"])
    ctx = Context(torch.device("cpu"), "tiny", cfg.bench.tiny, ["resmlp_s12"], False)
    real = R.call_step

    def tight(step, crops):
        if crops[0].shape[0] >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(step, crops)
    monkeypatch.setattr(R, "call_step", tight)
    found = R._largest_batch(ctx, "resmlp_s12", "interpolate")
    assert found["batch"] == 8 and found["tried"] == [8, 16] and "out of memory at batch 16" in found["stop"]
    monkeypatch.setattr(R, "call_step", real)
    capped = R._largest_batch(ctx, "resmlp_s12", "interpolate")
    assert capped["batch"] == 16 and capped["tried"] == [8, 16] and capped["stop"] == "max_batch reached"


def test_a_stop_at_an_epochs_last_iteration_still_evaluates_that_epoch(tmp_path, monkeypatch):
    """A cut that lands on an epoch's last iteration must not lose that epoch's k-NN
    point: the run stops at the epoch-end checkpoint, after the evaluation."""
    from resmlp.bench.jpegs import make_jpeg_folder
    from resmlp.core import engine, preempt
    from resmlp.core.errors import Preempted
    from resmlp.ssl.train import train
    make_jpeg_folder(str(tmp_path / "images"), 48, 36, 48)
    tiny = load_config("campaign", None, ["campaign.profile=tiny"]).campaign.tiny.preset
    cfg = load_config("dino", "resmlp_s12", [*tiny, "data=imagefolder", f"data.root={tmp_path / 'images'}",
                                             f"out={tmp_path / 'run'}"])
    real = engine.Cadence.after_iteration

    def signal_at_epoch_end(self, it):
        if it == self.ipe:
            monkeypatch.setattr(preempt, "_received", [15])  # SIGTERM, noted as the handler would
        real(self, it)
    monkeypatch.setattr(engine.Cadence, "after_iteration", signal_at_epoch_end)
    with pytest.raises(Preempted, match="after iteration 3 of 6"):
        train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "knn_top1" in r] == [0, 1]
    assert weights(tmp_path / "run")["results"]["timing"]["starts"][0]["first_iteration_s"] > 0
