"""`run.sh campaign`: a rehearsal of a GPU window on the CPU (a call killed with its process
group mid-stage, a fresh machine that only has the last report, a call cut by its time),
which ends with every figure of every call in the last report and nothing measured twice;
the stages' order, start times and pytest bookkeeping; the preset's graphs decision; the
bench's lines shared between its two stages; the checkpoint cadence and its time in the
results; bad input; the report folder's limits."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from resmlp.bench import bench as B
from resmlp.bench import campaign_stages as CS
from resmlp.bench import rows as R
from resmlp.bench.bench import Context
from resmlp.bench.campaign import CUT_ENV, REPORT_FILES, STARTED_ENV, Campaign
from resmlp.bench.report import MAX_BYTES, ReportError, write_report
from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TINY = ["campaign.profile=tiny"]


# --------------------------------------------------------------------------- the rehearsal

def call(out, report, carried=None, kill=None, cut=None):
    """One call as the lent machine makes it: its own process group; `kill`: a regex of
    the output at which the whole group gets SIGKILL (the tool's time limit). Returns
    (exit code, output lines, process group)."""
    env = {k: v for k, v in os.environ.items() if k not in (CUT_ENV, STARTED_ENV)}
    if cut:
        env[CUT_ENV] = cut
    argv = [sys.executable, "-m", "resmlp.core.cli", "campaign", *TINY, f"out={out}", f"campaign.report={report}",
            "campaign.call_s=200", *([f"campaign.from_report={carried}"] if carried else [])]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if kill and re.search(kill, line):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    return proc.wait(timeout=600), lines, proc.pid


def alive_in_group(pgid: int) -> list:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found


def summary(report: Path) -> tuple[dict, dict]:
    s = json.loads((report / "summary.json").read_text())
    return s, {x["name"]: x for x in s["stages"]}


def carry(report: Path, to: Path) -> Path:
    """What the caller does with a call's files: a copy carried into the next call."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(report, to)
    return to


def records(path: Path) -> list:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line the kill cut short
            pass
    return out


RATIOS = ("vs_ref", "vs_ref_resize", "vs_timm_eager", "vs_lightly")  # recomputed as lines come


def facts(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in RATIOS}


def report_obeys_the_limits(folder: Path, killed: bool = False) -> None:
    """At most 8 flat files of under 16 MiB: 7, and a kill may leave one write's temp file."""
    entries = list(folder.iterdir())
    temp = [p for p in entries if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert len(temp) <= killed and len(entries) - len(temp) <= 7, entries
    assert all(p.is_file() and p.stat().st_size < 16 * 2**20 for p in entries)
    assert {p.name for p in entries if p not in temp} <= set(REPORT_FILES)


@pytest.mark.slow
def test_a_rehearsal_of_a_gpu_window_loses_nothing_and_measures_nothing_twice(tmp_path):
    out = tmp_path / "campaign"
    reports = [tmp_path / f"report{i}" for i in (1, 2, 3)]

    # call 1: tests and bench_first end; the preset is killed mid-epoch with the whole group
    rc, lines1, pgid = call(out, reports[0], kill=r"^ep 1/2 it 2/6 ")
    assert rc == -signal.SIGKILL, lines1[-20:]
    deadline = time.time() + 10
    while alive_in_group(pgid) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive_in_group(pgid), "a process of the killed call outlived it"
    s1, st1 = summary(reports[0])
    assert [st1[n]["status"] for n in ("tests", "bench_first", "preset")] == ["done", "done", "running"]
    assert st1["tests"]["tests"] == st1["tests"]["skipped"] >= 7  # test_graphs.py's CUDA tests, skipped here
    assert st1["tests"]["skip_reasons"] == ["needs a CUDA GPU"]
    bench1 = json.loads((reports[0] / "bench.json").read_text())["rows"]
    assert bench1 and all(r["run"] == 1 for r in bench1)
    report_obeys_the_limits(reports[0], killed=True)

    # call 2, a fresh machine: only the report comes in; the bench is cut by the call's end
    shutil.rmtree(out)
    rc, lines2, _ = call(out, reports[1], carried=carry(reports[0], tmp_path / "carried1"),
                         cut=r"^\[bench\] dino: resmlp_s24 interpolate ours eager")
    assert rc == 75, lines2[-30:]
    first = lines2[0]
    assert first.startswith("campaign: call 2 ") and "a fresh machine" in first, first
    assert "preset starts again from epoch 0" in first and "nothing it holds is measured again" in first, first
    assert any(line.startswith("campaign: preset starts again from epoch 0 (attempt 2)") for line in lines2)
    s2, st2 = summary(reports[1])
    assert st2["preset"]["status"] == "done" and st2["bench"]["status"] == "cut" and s2["call_again"]
    assert "without dino.cuda_graphs" in st2["preset"]["graphs"]["why"]  # the graph tests skipped here

    # call 3 on the same (warm) machine: the bench goes on from its last line
    rc, lines3, _ = call(out, reports[2], carried=carry(reports[1], tmp_path / "carried2"))
    assert rc == 0, lines3[-30:]
    s3, st3 = summary(reports[2])
    report_obeys_the_limits(reports[2])
    assert not s3["call_again"] and all(x["status"] == "done" for x in st3.values())
    assert [len(s["calls"]) for s in (s1, s2, s3)] == [1, 2, 3]

    # no stage ran again once done, and the finished ones ran once
    done, every = set(), lines1 + lines2 + lines3
    for line in every:
        m = re.match(r"^campaign: (\w+)(?:: (done) after| (starts|continues))", line)
        if m:
            assert not (m.group(3) and m.group(1) in done), f"{m.group(1)} ran after it was done"
            if m.group(2):
                done.add(m.group(1))
    assert (st3["tests"]["runs"], st3["bench_first"]["runs"], st3["preset"]["attempt"]) == (1, 1, 2)

    # no bench line measured twice: every line printed as measured is one row of the last bench.json
    bench3 = json.loads((reports[2] / "bench.json").read_text())
    keys = [r["key"] for r in bench3["rows"]]
    measured = [line for line in every if line.startswith("[bench] ") and not re.search(r"\(run \d+\)$", line)
                and "before this line" not in line]
    assert len(keys) == len(set(keys)) == len(measured) and bench3["left"] == 0
    assert {r["run"] for r in bench3["rows"]} == {1, 2, 3}

    # every figure of every call is in the last report
    rows3 = {r["key"]: r for r in bench3["rows"]}
    for r in bench1 + json.loads((reports[1] / "bench.json").read_text())["rows"]:
        if not r.get("left"):
            assert facts(rows3[r["key"]]) == facts(r)
    assert st3["tests"]["outcomes"] == st1["tests"]["outcomes"]
    log3 = records(reports[2] / "preset_log.jsonl")
    restart = next(i for i, r in enumerate(log3) if "restart" in r)
    assert log3[:restart] == records(reports[0] / "preset_log.jsonl")  # the killed attempt, as call 1 reported it
    assert st3["preset"]["earlier_attempts"][0]["knn_curve"] == st1["preset"]["knn_curve"]
    assert [e for e, _ in st3["preset"]["knn_curve"]] == [0, 1, 2] and st3["preset"]["epochs_trained"] == 2
    assert st3["preset"]["results"]["timing"]["checkpoints"] == 2  # ckpt_epochs=1 here: both epoch ends


# --------------------------------------------------------------------------- the stages

def test_stages_run_in_the_order_given_and_start_only_with_their_time(tmp_path):
    cfg = load_config("campaign", None, [*TINY, f"out={tmp_path}"])
    p, stages = CS.plan(cfg, tmp_path)
    assert [s.name for s in stages] == ["tests", "bench_first", "preset", "bench", "compare"]
    gpu = load_config("campaign", None, [f"out={tmp_path}", "campaign.stages=[preset,tests]"])
    p, stages = CS.plan(gpu, tmp_path)
    assert [(s.name, s.min_start_s) for s in stages] == [("preset", 150), ("tests", 60)]
    assert "ckpt_epochs=10" in stages[0].argv and "compile=true" in stages[0].argv
    for bad, says in ((["campaign.stages=[preset,preset]"], "each stage once"),
                      (["campaign.stages=[preset,viz]"], "one of tests, bench_first, preset, bench, compare"),
                      (["campaign.call_s=170"], "no time for the preset stage")):
        with pytest.raises(UserError, match=says):
            CS.plan(load_config("campaign", None, [f"out={tmp_path}", *bad]), tmp_path)
    # the bench stages share one bench.json; the first one asks for the S12 lines of the step and the k-NN
    _, stages = CS.plan(load_config("campaign", None, [f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    assert by["bench_first"].dir == by["bench"].dir == tmp_path / "bench"
    assert "bench.rows=[dino,knn]" in by["bench_first"].argv and "bench.models=[resmlp_s12]" in by["bench_first"].argv
    assert by["bench_first"].line_s == 90 and by["bench"].line_s == 150


def test_pytest_output_is_kept_test_by_test_and_a_cut_runs_only_the_rest():
    outcomes: dict = {}
    lines = ["tests/test_graphs.py::test_a[False] PASSED                         [ 20%]",
             "tests/test_graphs.py::test_a[True] SKIPPED (needs a CUDA GPU)      [ 40%]",
             "tests/test_x.py::test_b FAILED                                      [ 60%]",
             "tests/test_x.py::test_c PASSED                                      [ 80%]",
             "tests/test_x.py::test_c ERROR                                       [ 80%]",
             "FAILED tests/test_x.py::test_b - AssertionError: 1 != 2",
             "collecting ... collected 6 items", "ep 1/2 it 2/6 loss 6.5"]
    said = [CS.note_test_line(line, outcomes) for line in lines]
    assert said == [True] * 6 + [False] * 2
    assert outcomes == {"tests/test_graphs.py::test_a[False]": {"outcome": "passed"},
                        "tests/test_graphs.py::test_a[True]": {"outcome": "skipped", "message": "needs a CUDA GPU"},
                        "tests/test_x.py::test_b": {"outcome": "failed", "message": "AssertionError: 1 != 2"},
                        "tests/test_x.py::test_c": {"outcome": "error"}}
    stage = CS.Stage("tests", ["-m", "pytest", "tests"], Path("."), 5, outcomes=outcomes)
    argv = CS.launch(stage, {}, {}, [], None)
    assert argv[:3] == ["-m", "pytest", "tests"] and argv[3::2] == ["--deselect"] * 4
    assert set(argv[4::2]) == set(outcomes)
    CS.classify(stage, 1, None)
    assert stage.status == "done" and stage.note.startswith("2 test(s) failed")
    CS.classify(stage, -15, "call")
    assert stage.status == "cut"


def test_the_preset_is_graphed_only_when_the_graph_tests_passed():
    tests = CS.Stage("tests", [], Path("."), 5, status="done")
    graph = "tests/test_graphs.py"
    tests.outcomes = {f"{graph}::test_a": {"outcome": "passed"}, f"{graph}::test_b[True]": {"outcome": "passed"},
                      "tests/test_x.py::test_c": {"outcome": "failed"}}
    assert CS.graphs_decision(tests, graph, [])["on"] is True
    tests.outcomes[f"{graph}::test_c"] = {"outcome": "skipped", "message": "needs a CUDA GPU"}
    off = CS.graphs_decision(tests, graph, [])
    assert off["on"] is False and "1 of the 3" in off["why"] and "needs a CUDA GPU" in off["why"]
    assert CS.graphs_decision(None, graph, [])["why"].endswith("not in campaign.stages")
    tests.status = "cut"
    assert CS.graphs_decision(tests, graph, [])["on"] is False
    assert CS.graphs_decision(tests, graph, ["dino.cuda_graphs=false"])["on"] is None
    # decided once, at the preset's first start, and kept
    tests.status, tests.outcomes = "done", {f"{graph}::test_a": {"outcome": "passed"}}
    preset = CS.Stage("preset", ["-m", "x"], Path("."), 5)
    assert CS.launch(preset, {"tests": tests}, {"graph_tests": graph}, [], None)[-1] == "dino.cuda_graphs=true"
    tests.outcomes[f"{graph}::test_a"]["outcome"] = "failed"
    assert CS.launch(preset, {"tests": tests}, {"graph_tests": graph}, [], None)[-1] == "dino.cuda_graphs=true"


def test_a_budget_stage_ends_when_its_budget_is_spent():
    compare = CS.Stage("compare", [], Path("."), 5, budget_s=900)
    CS.classify(compare, 75, "budget")
    assert compare.status == "done" and "budget of 900 s" in compare.note
    CS.classify(compare, 75, "call")
    assert compare.status == "cut"
    CS.classify(compare, 3, None)
    assert compare.status == "failed"


# --------------------------------------------------------------------------- the bench's lines

def test_bench_lines_are_kept_across_stages_and_a_family_that_raised_is_not_done(tmp_path, monkeypatch):
    base = ["bench.profile=tiny", f"out={tmp_path}", "bench.resume=true", "bench.models=[resmlp_s12]"]

    def run(*extra):
        return B.bench(load_config("bench", "resmlp_s12", [*base, *extra]))
    first = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch]")
    assert [r["row"] for r in first["rows"]] == ["peak", "knn"]
    # another choice of lines (as the second bench stage makes): the first run's are kept, not measured again
    real = B.FAMILIES["knn"]

    def breaks_after_one_line(ctx):
        ctx.attempt("knn", {"backend": "torch-raw", "n_train": 500, "dim": 16, "k": 20}, lambda: {"seconds": 1.0})
        raise RuntimeError("the family broke")
    monkeypatch.setitem(B.FAMILIES, "knn", breaks_after_one_line)
    second = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch,torch-raw]")
    rows = {(r["row"], r.get("backend"), r.get("impl")): r for r in second["rows"]}
    assert rows[("peak", None, "dense matmul")]["run"] == 1 and rows[("knn", "torch", None)]["run"] == 1
    assert rows[("knn", "torch-raw", None)]["run"] == 2 and rows[("knn", None, "(setup)")]["status"] == "error"
    assert "knn" not in second["families_done"]
    # the family that raised runs again; its line measured before is kept; the setup error is gone
    monkeypatch.setitem(B.FAMILIES, "knn", real)
    third = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch,torch-raw]")
    assert [(r["backend"], r["run"]) for r in third["rows"] if r["row"] == "knn"] == [("torch", 1), ("torch-raw", 2)]
    assert "knn" in third["families_done"] and third["runs"] == 3
    # lines this run does not choose stay in bench.json
    fourth = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch-raw]")
    assert {r.get("backend") for r in fourth["rows"] if r["row"] == "knn"} == {"torch", "torch-raw"}
    # a setting that changes how a line is measured is refused
    with pytest.raises(UserError, match="other settings"):
        run("bench.rows=[knn]", "bench.tiny.knn.k=5")


# --------------------------------------------------------------------------- the preset's checkpoints

def test_checkpoints_every_n_epochs_count_in_the_training_time(tmp_path, monkeypatch):
    """ckpt_epochs=2 over 3 epochs: a checkpoint at epoch 2 and at the last; each write's
    seconds (made 100 here by a clock the write moves) are summed apart and the one a run
    goes on after is in train_s, as a user waits for it."""
    from resmlp.bench.jpegs import make_jpeg_folder
    from resmlp.core import engine
    from resmlp.ssl.train import train
    make_jpeg_folder(str(tmp_path / "images"), 32, 36, 48)
    offset = [0.0]
    monkeypatch.setattr(engine, "time", types.SimpleNamespace(time=lambda: time.time() + offset[0]))
    real = engine.save_checkpoint

    def slow_save(*args, **kwargs):
        offset[0] += 100.0
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "save_checkpoint", slow_save)
    tiny = load_config("campaign", None, TINY).campaign.tiny.preset
    cfg = load_config("dino", "resmlp_s12", [*tiny, "data=imagefolder", f"data.root={tmp_path / 'images'}",
                                             f"out={tmp_path / 'run'}", "epochs=3", "eval_every=0", "ckpt_epochs=2"])
    summary = train(cfg)[3]
    t = summary["timing"]
    assert t["checkpoints"] == 2 and 200 <= t["checkpoint_s"] < 210
    assert 100 <= t["train_s"] < 200 and summary["wall_time_s"] >= 200
    saved = torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=False, map_location="cpu")
    prev = torch.load(tmp_path / "run" / "checkpoint_prev.pth", weights_only=False, map_location="cpu")
    assert (prev["epoch"], saved["epoch"]) == (2, 3)


# --------------------------------------------------------------------------- input and output

def test_bad_input_is_exit_2_and_a_changed_campaign_is_refused(tmp_path, capsys):
    out = f"out={tmp_path}"
    assert main(["campaign", "campaign.profile=nope", out]) == 2
    assert main(["campaign", "campaign.profile=tiny", "campaign.call_s=10", out]) == 2
    assert "min_start_s.tests + stop_grace_s" in capsys.readouterr().err
    state = {"commands": {"preset": ["-m", "resmlp.core.cli", "dino", "resmlp_s12", "epochs=3"]}, "stages": {},
             "calls": []}
    (tmp_path / "campaign.json").write_text(json.dumps(state))
    assert main(["campaign", "campaign.profile=tiny", "campaign.stages=[preset]", out]) == 2
    err = capsys.readouterr().err
    assert "another command" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a carried report: of another campaign, unreadable, or the report folder itself; checked before any work
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "summary.json").write_text(json.dumps({"state": state}))
    fresh = tmp_path / "fresh"
    for extra, says in (([f"campaign.from_report={carried}"], "another command"),
                        ([f"campaign.from_report={carried}", f"campaign.report={carried}"], "both"),
                        ([f"campaign.from_report={tmp_path}"], "cannot read its summary.json")):
        assert main(["campaign", *TINY, "campaign.stages=[preset]", f"out={fresh}", *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert not fresh.exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["campaign", *TINY, f"out={fresh}", f"campaign.report={taken}"]) == 2
    assert "holds other things (notes.txt)" in capsys.readouterr().err and not fresh.exists()
    # none yet (the first call): a new campaign, and it says so
    c = Campaign(load_config("campaign", None, [*TINY, f"out={fresh}", f"campaign.from_report={tmp_path / 'none'}"]))
    c.load()
    assert c.restored.startswith("no report in") and not fresh.exists()
    # through run.sh, whose campaign case sets up before any Python runs
    sh = subprocess.run(["bash", str(ROOT / "run.sh"), "campaign", "campaign.profile=nope", out], cwd=ROOT,
                        env={**os.environ, "RESMLP_PYTHON": sys.executable}, capture_output=True, text=True)
    assert sh.returncode == 2 and sh.stderr.strip().splitlines() == [
        "error: campaign.profile=nope is not allowed: campaign.profile must be one of gpu, tiny"], sh.stderr


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
    assert MAX_BYTES < 16 * 2**20 and len(REPORT_FILES) == 7


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
    tiny = load_config("campaign", None, TINY).campaign.tiny.preset
    cfg = load_config("dino", "resmlp_s12", [*tiny, "data=imagefolder", f"data.root={tmp_path / 'images'}",
                                             f"out={tmp_path / 'run'}", "ckpt_epochs=2"])
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
    saved = torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=False, map_location="cpu")
    assert saved["iteration"] == 3  # saved by the stop although epoch 1 is no checkpoint epoch under ckpt_epochs=2
    assert saved["results"]["timing"]["starts"][0]["first_iteration_s"] > 0
