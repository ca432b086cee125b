"""`run.sh campaign`: a rehearsal of a GPU window on the CPU (two calls, the first killed with
its process group mid-stage, the second on a fresh machine with only the last report and the
window nearly spent, then the next window's call), which ends with every figure of every call
in the last report and nothing measured twice; when a stage may start (its requirement, the
window's end, the preset's prediction from its config and from the 2026-11-26 H100 log); the
stages' order and pytest bookkeeping; the default command first, with its resume (its
command line, tools/campaign/starts.py, its output and results into figures); the preset's graphs
decision; the bench's lines shared between its two stages; the awaited keys of other
branches; the profiles in summary.json; the checkpoint cadence and its time in the results;
bad input; the report folder's limits."""
import ast
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
from omegaconf import OmegaConf

from campaign import call as C
from campaign import report as RE
from campaign import stages as CS
from campaign import state as S
from campaign.bench import BenchStage, ProfileStage, profile_figures
from campaign.call import REPORT_FILES, STARTED_ENV, Campaign, main
from campaign.costs import CompileStage, HeadStage
from campaign.config import YAML
from campaign.config import load as load_campaign
from campaign.folder import MAX_BYTES, ReportError, write_report
from campaign.plan import plan
from campaign.predict import measured, predict, schedule
from campaign.tests import TestsStage, note_test_line
from campaign.training import DefaultStage, PresetStage, TrainingStage, graphs_decision
from bench import bench as B
from bench import dino as D
from bench.bench import Context
from bench.config import bench_config
from resmlp.core.config import load_config
from resmlp.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TINY = ["campaign.profile=tiny"]
H100_LOG = ROOT / "docs" / "bench" / "h100-2026-11-26" / "preset_log.jsonl"
H100_LOG_27 = ROOT / "docs" / "bench" / "h100-2026-11-27" / "preset_log.jsonl"


# --------------------------------------------------------------------------- the rehearsal

def call(out, report, window, carried=None, kill=None):
    """One call as the lent machine makes it, told the window's time left: its own process
    group; `kill`: a regex of the output at which the whole group gets SIGKILL (the tool's
    time limit). Returns (exit code, output lines, process group)."""
    env = {k: v for k, v in os.environ.items() if k != STARTED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools"), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "campaign", *TINY, f"out={out}", f"campaign.report={report}",
            "campaign.call_s=600", f"campaign.window_left_s={window}",
            *([f"campaign.from_report={carried}"] if carried else [])]
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
    tiny = load_campaign(TINY).campaign.tiny

    # the window's call 1: the default command and its resume, the tests, the profiles, then the
    # preset, whose prediction fits; the tool's kill of the whole group lands in its first epoch
    rc, lines1, pgid = call(out, reports[0], window=100000, kill=r"^ep 1/2 it 2/6 ")
    assert rc == -signal.SIGKILL, lines1[-20:]
    deadline = time.time() + 10
    while alive_in_group(pgid) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive_in_group(pgid), "a process of the killed call outlived it"
    s1, st1 = summary(reports[0])
    assert [st1[n]["status"] for n in ("default_command", "device_tests", "tests", "profile_preset", "profile_224",
                                       "preset", "torchrun")] == ["done"] * 5 + ["running", "pending"]
    # the default command first: one epoch, then its resume, each start's lines and figures
    one, two = st1["default_command"]["starts"]
    assert one["lines"]["device"] == two["lines"]["device"] and one["lines"]["device"][0].startswith("device: cpu (")
    assert one["lines"]["path"][0] == "path: eager, not graphed"
    assert two["lines"]["notes"][0].startswith("resuming from ")
    assert one["first_iteration_s"] > 0 and two["first_iteration_s"] > 0 and two["at_iteration"] == 3
    assert one["results"]["precision"] == "fp32" and two["results"]["path"] == {"compile": False, "cuda_graphs": False}
    # test_graphs.py's and test_device_check.py's CUDA tests, then the others: skipped here
    assert st1["device_tests"]["tests"] == st1["device_tests"]["skipped"] >= 8
    assert st1["tests"]["tests"] == st1["tests"]["skipped"] >= 3
    assert st1["tests"]["skip_reasons"] == st1["device_tests"]["skip_reasons"] == ["needs a CUDA GPU"]
    # the preset's prediction, from its config (2 epochs of 48 images, the k-NN every epoch) and the constants
    k = tiny.predict
    pred = st1["preset"]["prediction"]
    assert (pred["epochs"], pred["images_per_epoch"], pred["evaluations"]) == (2, 48, 1)
    assert set(pred["from"].values()) == {"campaign.tiny.predict"}
    assert pred["need_s"] == pytest.approx(k.launch_s + k.startup_s + 2 * 48 / k.images_per_s + k.eval_s + k.end_s,
                                           abs=0.1)
    assert any(line.startswith(f"campaign: preset: predicted {pred['need_s']:.0f} s = ") for line in lines1)
    report_obeys_the_limits(reports[0], killed=True)

    # call 2, a fresh machine with only the report, and the window nearly spent: 60 s, of
    # which 5 go to the machine's start and 20 to the margin, 10 to the stop signal's grace:
    # under 25 s for a stage. The preset (at least its 30 s) is not started in this window;
    # the first bench stage (torchrun) starts, its lines kept one by one
    shutil.rmtree(out)
    rc, lines2, _ = call(out, reports[1], window=60, carried=carry(reports[0], tmp_path / "carried1"))
    assert rc == 0, lines2[-30:]
    first = lines2[0]
    assert first.startswith("campaign: call 2 ") and "a fresh machine" in first, first
    assert "preset starts again from epoch 0" in first and "nothing it holds is measured again" in first, first
    assert "the call ends 35 s after run.sh's start, by the window" in first, first
    s2, st2 = summary(reports[1])
    window2 = s2["calls"][-1]
    assert (window2["fresh_machine"], window2["ends_by"], window2["ends_after_s"]) == (True, "window", 35)
    assert window2["wall_s"] <= 60 - tiny.start_s  # the margin (20 s) is the slack for the last report's writes
    verdicts = {x["stage"]: x["verdict"] for x in window2["not_started"]}
    assert verdicts["preset"] == "window" and st2["preset"]["status"] == "cut"
    assert any(re.match(r"campaign: preset: needs \d+ s .*not started in this window$", line) for line in lines2)
    assert any(line.startswith("campaign: torchrun starts (run 1)") for line in lines2)
    if st2["torchrun"]["status"] == "done":  # then compile was weighed too
        assert verdicts["compile"] == "window"
    assert not s2["call_again"]
    assert {"preset", "compile", "profile_knn"} <= set(s2["left_for_another_window"])
    assert "left for another window: " in "\n".join(lines2)

    # call 3, the next window's first, on a fresh machine with call 2's report: the rest
    shutil.rmtree(out)
    rc, lines3, _ = call(out, reports[2], window=100000, carried=carry(reports[1], tmp_path / "carried2"))
    assert rc == 0, lines3[-30:]
    s3, st3 = summary(reports[2])
    report_obeys_the_limits(reports[2])
    assert not s3["call_again"] and all(x["status"] == "done" for x in st3.values()), lines3[-30:]
    assert [len(s["calls"]) for s in (s1, s2, s3)] == [1, 2, 3]

    # no stage ran again once done, and the finished ones ran once
    done, every = set(), lines1 + lines2 + lines3
    for line in every:
        m = re.match(r"^campaign: (\w+)(?:: (done) after| (starts|continues))", line)
        if m:
            assert not (m.group(3) and m.group(1) in done), f"{m.group(1)} ran after it was done"
            if m.group(2):
                done.add(m.group(1))
    assert (st3["tests"]["runs"], st3["preset"]["attempt"], st3["profile_preset"]["runs"]) == (1, 2, 1)

    # no bench line measured twice: every line printed as measured is one row of the last bench.json
    # (a line that failed, or that a stop signal met, which a later call measures again, is no measurement)
    bench3 = json.loads((reports[2] / "bench.json").read_text())
    keys = [r["key"] for r in bench3["rows"]]
    measured_lines = [line for line in every if line.startswith("[bench] ") and not re.search(r": ERROR ", line)
                      and not re.search(r"\(run \d+\)$", line) and not re.search(r"(before|during) this line$", line)]
    assert len(keys) == len(set(keys)) == len(measured_lines) and bench3["left"] == 0
    benches = [s.name for s in plan(load_campaign([*TINY, f"out={out}"]), out)[1] if isinstance(s, BenchStage)]
    assert benches == ["torchrun", "e2e", "bench_knn", "bench_linear", "levers", "bench_fused", "autotune", "bench"]
    assert bench3["runs"] == sum(st3[n]["runs"] for n in benches)

    # every figure of every call is in the last report
    rows3 = {r["key"]: r for r in bench3["rows"]}
    for r in json.loads((reports[1] / "bench.json").read_text())["rows"]:
        if r["status"] == "error":   # no figure: measured again by call 3's run of its family
            assert rows3[r["key"]]["run"] > r["run"], (r, rows3[r["key"]])
        elif not r.get("left"):
            assert facts(rows3[r["key"]]) == facts(r)
    assert st3["tests"]["outcomes"] == st1["tests"]["outcomes"]
    log3 = records(reports[2] / "preset_log.jsonl")
    restarts = [i for i, r in enumerate(log3) if "restart" in r]
    assert len(restarts) == 1, restarts  # call 2 did not start it: one restart, not two
    assert log3[:restarts[0]] == records(reports[0] / "preset_log.jsonl")  # the killed attempt, as call 1 reported it
    assert st3["preset"]["earlier_attempts"][0]["knn_curve"] == st1["preset"]["knn_curve"]
    assert [e for e, _ in st3["preset"]["knn_curve"]] == [0, 1, 2] and st3["preset"]["epochs_trained"] == 2
    assert st3["preset"]["results"]["timing"]["checkpoints"] == 2  # ckpt_epochs=1 here: both epoch ends
    # the profiles of the preset's step and of the larger one, folded into summary.json
    assert st3["profile_preset"]["profile"]["config"]["crops"] == "2x32+2x16"
    assert st3["profile_224"]["profile"]["config"]["crops"] == "2x64+2x32"
    assert all("step eager" in st3[n]["profile"]["phases"] for n in ("profile_preset", "profile_224"))
    # every op of the profiled steps, by class against its floor at the rates measured there
    eager = st3["profile_preset"]["profile"]["kernels_eager"]
    assert len(eager["top"]) > 20 and eager["classes"]["GEMM"]["ms"] > 0 and eager["classes"]["GEMM"]["floor_ms"] > 0
    assert st3["profile_preset"]["profile"]["rates"]["copy"]["tb_per_s"] > 0
    # the compile stage's two runs, and every stage's estimate beside what its last run took
    assert set(st3["compile"]["cost"]) == {"cold", "warm"} and st3["compile"]["cost"]["warm"]["mode"] == "eager"
    assert all(x["expected"]["took_s"] > 0 and x["expected"]["need_s"] > 0 for x in st3.values())
    assert {r["row"] for r in bench3["rows"]} >= {"torchrun", "e2e"}
    # the k-NN beside its baseline file (the tiny profile's: ours, so both vote alike), in bench_knn's figures
    knn_lines = {r["backend"]: r for r in st3["bench_knn"]["knn"]}
    assert "torch" in knn_lines, ([r for r in bench3["rows"] if r.get("status") == "error"],
                                  [x for x in (reports[2] / "campaign.log").read_text().splitlines() if "Error" in x])
    assert knn_lines["torch"]["baseline"] == "eval/knn_search.py" and knn_lines["torch"]["same_as_baseline"] is True
    assert knn_lines["torch"]["baseline_seconds"] > 0 and knn_lines["torch"]["seconds"] > 0
    # the lever's lines (token-major at the tiny profile, eager), each beside the fused block's and the reference's
    levers = st3["levers"]["levers"]
    assert {(r["lever"], r["kind"]) for r in levers} == {("token-major", "eager")} and len(levers) == 2  # 2 batches
    assert all(r["vs_fused"] > 0 and r["vs_ref"] > 0 for r in levers)
    # the head's precisions on the preset's step and on the larger one, each beside fp32's
    for name, batch in (("head_preset", 16), ("head_224", 4)):
        cost = st3[name]["cost"]
        assert list(cost) == ["fp32", "tf32", "bf16"] and cost["fp32"]["batch"] == batch, cost
        assert cost["fp32"]["vs_fp32"] == 1 and cost["bf16"]["images_per_s"] > 0
    assert st3["kernel_tests"]["status"] == "done" and st3["kernel_tests"]["failed"] == 0
    # and the device k-NN's phases at the tiny bench profile's sizes (here on the CPU)
    knn = st3["profile_knn"]["profile"]["knn"]
    assert (knn["n_train"], knn["queries"], knn["same_votes"]) == (500, 50, True)
    assert {"pass: matmul", "pass: block maxima, merge", "re-rank", "vote"} <= set(knn["phases"])


# --------------------------------------------------------------------------- the stages and their time

def test_stages_run_in_the_order_given_and_start_only_with_their_time(tmp_path):
    cfg = load_campaign([*TINY, f"out={tmp_path}"])
    p, stages = plan(cfg, tmp_path)
    assert [s.name for s in stages] == ["default_command", "device_tests", "tests", "profile_preset", "profile_224",
                                        "preset", "torchrun", "compile", "e2e", "bench_knn", "bench_linear",
                                        "kernel_tests", "levers", "bench_fused", "head_preset", "head_224", "autotune",
                                        "profile_knn", "bench"]
    gpu = load_campaign([f"out={tmp_path}", "campaign.stages=[preset,tests,compare]"])
    p, stages = plan(gpu, tmp_path)
    assert [(s.name, s.min_start_s) for s in stages] == [("preset", 150), ("tests", 100), ("compare", 150)]
    # the preset is the command a user types on a GPU: only device, out and ckpt_epochs
    assert stages[0].argv == ["-m", "resmlp.core.cli", "dino", "resmlp_s12", f"out={tmp_path / 'preset'}",
                              "device=cuda", "ckpt_epochs=10"]
    assert stages[2].budget_s == 900 and "dino.centering=sinkhorn" in stages[2].argv
    for bad, says in ((["campaign.stages=[preset,preset]"], "each stage once"),
                      (["campaign.stages=[preset,viz]"], "one of default_command, device_tests, tests, "
                                                         "profile_preset, profile_224, preset, torchrun, compile"),
                      (["campaign.call_s=300"], "no time for the bench_linear stage"),
                      (["campaign.window_left_s=0"], "campaign.window_left_s must be a number > 0")):
        with pytest.raises(UserError, match=says):
            plan(load_campaign([f"out={tmp_path}", *bad]), tmp_path)
    # the bench stages share one bench.json; bench_fused asks for the S12 lines of the step
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    assert by["bench_fused"].dir == by["bench"].dir == tmp_path / "bench"
    assert "bench.rows=[dino]" in by["bench_fused"].argv and "bench.models=[resmlp_s12]" in by["bench_fused"].argv
    assert by["bench_fused"].line_s == 60 and by["bench"].line_s == 150
    # the profiles: bench/profile.py on the preset's own config, and at 224 px, each into its own folder
    assert by["profile_preset"].argv[:2] == ["-m", "bench.profile"]
    assert by["profile_preset"].argv[2:6] == ["device=cuda", "ckpt_epochs=10", "compile=true", "model.fused=true"]
    assert "data.img_size=224" in by["profile_224"].argv
    assert by["profile_knn"].argv[2:4] == ["profile.phases=knn", "profile.knn=gpu"]
    assert by["profile_knn"].min_start_s == 60
    assert by["profile_224"].argv[-1] == f"profile.out={tmp_path / 'profile_224'}"


def test_a_stage_needs_its_whole_time_under_a_window_and_a_bench_stage_its_longest_line():
    preset = PresetStage("preset", [], Path("."), 150, config=())
    bench = BenchStage("bench", [], Path("."), 120, line_s=150)
    tests = TestsStage("tests", [], Path("."), 100)
    compare = TrainingStage("compare", [], Path("."), 150, config=(), budget_s=900, wall_s=700)
    predicted = {"need_s": 1062.0}
    assert preset.requirement({}, True, predicted)[0] == 1062
    assert preset.requirement({}, True, {"need_s": 40.0})[0] == 150  # never under min_start_s
    assert preset.requirement({}, False, predicted)[0] == 150  # no window: it resumes from its checkpoint
    assert compare.requirement({"stop_grace_s": 30}, True, predicted)[0] == 170  # its budget, to its stop
    assert bench.requirement({}, True, None)[0] == 151
    assert tests.requirement({}, True, None)[0] == 100
    assert [CS.decide(100, left, later) for left, later in ((100, 0), (99, 100), (99, 99))] == \
        ["start", "next_call", "window"]


class Clock:
    """time.time for the campaign module, moved by hand."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self):
        return self.now


@pytest.fixture
def on_a_gpu_machine(monkeypatch):
    """The gpu profile planned as on the machine it runs on: there the preset's demo=auto
    (the command a user types) is no CPU demo, and its prediction is the preset's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_window_ends_the_call_and_decides_what_starts(tmp_path, monkeypatch, on_a_gpu_machine):
    clock = Clock()
    monkeypatch.setattr(C, "time", types.SimpleNamespace(time=clock.time, sleep=time.sleep))
    monkeypatch.delenv(STARTED_ENV, raising=False)

    def campaign(out, *extra):
        c = Campaign(load_campaign([f"out={out}", *extra]))
        c.load()
        c.calls.append({"call": 1, "setup_s": 6.0, "not_started": []})
        return c

    # a first call: a fresh machine; the call (570 s) ends before the window (900 - 40 - 20)
    first = campaign(tmp_path / "a", "campaign.window_left_s=900")
    first.by_name["tests"].status = "done"
    assert first.fresh and first.deadline - first.started == 570 and first.window_end - first.started == 840
    # a warm machine (the campaign dir holds a state) with 300 s left: no start to count
    (tmp_path / "b").mkdir()
    S.write_state(tmp_path / "b", {"stages": {}, "calls": []})
    warm = campaign(tmp_path / "b", "campaign.window_left_s=300")
    assert not warm.fresh and warm.deadline - warm.started == 280
    assert campaign(tmp_path / "c", "campaign.window_left_s=300").deadline - clock.now == 240
    assert campaign(tmp_path / "d").window_end is None  # no window: only call_s

    # 88 s in (the tests done): 452 s left before the stop signal; a next call could give
    # min(570 - 6, 840 - 88 - 40 - 20 - 6) - 30 = 534 s
    clock.now = first.started + 88
    assert first.next_call_s() == pytest.approx(534)
    # the preset as configured (40 epochs): 15 + 52 + 40 x 59904 / 6940 + 3 x 4 + 12 = 436 s: it starts after the tests
    need, _ = first.requirement(first.by_name["preset"])
    assert need == pytest.approx(15 + 52 + 40 * 59904 / 6940 + 3 * 4 + 12, abs=0.1)
    assert CS.decide(need, first.deadline - clock.now - 30, first.next_call_s()) == "start"
    # 45 epochs: 15 + 52 + 45 x 59904 / 6940 + 4 x 4 + 12 = 483 s, more than the 452 s left: the next call has it
    later = campaign(tmp_path / "g", "campaign.window_left_s=900", "campaign.preset_overrides=[epochs=45]")
    later.by_name["tests"].status = "done"
    clock.now = later.started + 88
    assert later.run_stage(later.by_name["preset"], later.calls[-1]) is False
    assert later.calls[-1]["not_started"][-1]["verdict"] == "next_call"
    longer = campaign(tmp_path / "e", "campaign.window_left_s=900", "campaign.preset_overrides=[epochs=100]")
    clock.now = longer.started + 88
    record = longer.calls[-1]
    preset = longer.by_name["preset"]  # 100 epochs at the 2026-11-27 rates: about 978 s, no call holds it
    assert longer.run_stage(preset, record) is True and record["not_started"][-1]["verdict"] == "window"
    assert preset.status == "pending" and preset.note.startswith("not started in call 1: needs 978 s")
    short = campaign(tmp_path / "f", "campaign.window_left_s=900", "campaign.preset_overrides=[epochs=30]")
    clock.now = short.started + 88  # 346 s: it starts
    need, _ = short.requirement(short.by_name["preset"])
    assert need == pytest.approx(15 + 52 + 30 * 59904 / 6940 + 2 * 4 + 12, abs=0.1)
    assert CS.decide(need, short.deadline - clock.now - 30, short.next_call_s()) == "start"
    # at the end of call 1 (546 s) the window has 840 - 546 = 294 s: a next call could give
    # 294 - 40 - 20 - 6 - 30 = 198 s: every stage but the preset and autotune (301 s) fits it
    # (the default command's 180 s and the bench's the longest)
    clock.now = first.started + 546
    assert [s.name for s in first.left_for_later()] == ["default_command", "device_tests", "profile_preset",
                                                        "profile_224", "torchrun", "compile", "e2e", "bench_knn",
                                                        "kernel_tests", "levers", "bench_fused", "head_preset",
                                                        "head_224", "profile_knn", "bench"]
    assert first.exit_code() == 75
    clock.now = first.started + 710  # 840 - 710 - 96 = 34 s: nothing fits (the k-NN needs 40 s); nor the preset
    assert first.left_for_later() == [] and first.exit_code() == 0


# What each stage of the gpu profile takes, as campaign.yaml's comments estimate it: a bench
# stage all its lines, the preset its prediction (436 s: the campaign predicts it itself).
ESTIMATES = {"default_command": 155, "device_tests": 65, "tests": 85, "profile_preset": 75, "profile_224": 65,
             "preset": 436, "torchrun": 92, "compile": 120, "e2e": 170, "bench_knn": 30, "bench_linear": 225,
             "kernel_tests": 130,
             "levers": 490, "bench_fused": 80, "head_preset": 90, "head_224": 70, "autotune": 255, "profile_knn": 60,
             "bench": 800}
SETUP_S, TRANSFER_S = 8, 5   # run.sh's set-up in each call; the copies around it (2026-11-27: about 5 s)


def play_windows(tmp_path, monkeypatch, windows: int) -> list:
    """15-minute windows played through the campaign's own calls (Campaign.call), each stage
    taking its estimate (ESTIMATES) or, cut by its stop signal, what was left of the call (a
    bench stage keeps the lines it measured; the next call measures the rest). Each call is
    told what the window has left (900 s less every earlier call's machine start, set-up, run
    and transfers); a window's calls go on while one exits 75; the next window starts on a
    fresh machine from the last report. Returns, per window, each call's (stages run, exit)."""
    clock = Clock()
    monkeypatch.setattr(C, "time", types.SimpleNamespace(time=clock.time, sleep=time.sleep))
    monkeypatch.delenv(STARTED_ENV, raising=False)
    monkeypatch.setattr(Campaign, "device", lambda self: "NVIDIA H200")
    left = dict(ESTIMATES)

    def supervise(self, stage, argv, end):   # the stage's run, by the clock
        stop = min(end, self.deadline) - float(self.p["stop_grace_s"])
        took = max(0.0, min(left[stage.name], stop - clock.now))
        clock.now += took
        left[stage.name] -= took
        return (0, None) if left[stage.name] <= 0 else (75, "call")
    monkeypatch.setattr(Campaign, "supervise", supervise)
    out, carried, played = tmp_path / "campaign", None, []
    for window in range(windows):
        budget, calls = 900.0, []
        while len(calls) < 5:
            fresh = not (out / "campaign.json").exists()
            c = Campaign(load_campaign([f"out={out}", f"campaign.window_left_s={budget:g}",
                                        *([f"campaign.from_report={carried}"] if carried else [])]))
            c.load()
            clock.now += SETUP_S
            code = c.call()
            budget -= (40 if fresh else 0) + clock.now - c.started + TRANSFER_S
            assert budget > 0, f"window {window + 1} overrun by call {len(calls) + 1}"
            calls.append(([x["stage"] for x in c.calls[-1]["ran"]], code))
            if code != 75:
                break
        played.append(calls)
        carried = carry(out / "report", tmp_path / f"carried{window}")
        shutil.rmtree(out)
    return played


def test_the_windows_the_estimates_plan(tmp_path, monkeypatch, on_a_gpu_machine):
    """The next windows as campaign.gpu's estimates plan them (tools/campaign/README.md).
    Window 1: call 1 the default command with its resume, the CUDA tests of graphs, compiling
    and the device checks, the other CUDA tests and both whole profiles; the preset fits no
    call left in the window, so torchrun starts and the call ends in it; call 2 the rest of
    torchrun, compile and e2e's first lines. Window 2: the preset first, e2e's rest, the k-NN;
    call 2 the kernels' tests and most of the levers' lines. Window 3: the linear probe and more
    of the levers' lines; call 2 their rest, bench_fused and head_preset. Window 4: head_224,
    max-autotune and the k-NN's phases; call 2 the rest of the bench (its estimate the least
    known), which it does not finish."""
    played = play_windows(tmp_path, monkeypatch, 4)
    assert played[0] == [(["default_command", "device_tests", "tests", "profile_preset", "profile_224", "torchrun"],
                          75), (["torchrun", "compile", "e2e"], 0)]
    assert played[1] == [(["preset", "e2e", "bench_knn"], 75), (["kernel_tests", "levers"], 0)]
    assert played[2] == [(["bench_linear", "levers"], 75), (["levers", "bench_fused", "head_preset"], 0)]
    assert played[3] == [(["head_224", "autotune", "profile_knn"], 75), (["bench"], 0)]
    s, st = summary(tmp_path / "carried3")
    assert {n for n, x in st.items() if x["status"] != "done"} == {"bench"} and st["bench"]["status"] == "cut"
    assert s["left_for_another_window"] == ["bench"] and len(s["calls"]) == 8


def test_the_new_stages_run_the_bench_rows_and_compile_cost_of_the_preset(tmp_path):
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    for name, row, line_s in (("torchrun", "torchrun", 60), ("e2e", "e2e", 45)):
        stage = by[name]
        assert isinstance(stage, BenchStage) and stage.dir == by["bench"].dir and stage.line_s == line_s
        assert f"bench.rows=[{row}]" in stage.argv and "bench.resume=true" in stage.argv
    # compile: bench/compile_cost.py on the preset's keys, cold (regional saves the cache), then warm (loads it),
    # one cache emptied at its start
    c = by["compile"]
    assert isinstance(c, CompileStage) and c.min_start_s == 150
    assert c.argv == ["-m", "bench.compile_cost", "--modes", "regional,warm", "--steps", "3", "--json",
                      str(tmp_path / "compile" / "compile_cost.json"), "device=cuda", "ckpt_epochs=10",
                      f"compile_cache_dir={tmp_path / 'compile_cache'}"]
    c.cache.mkdir(parents=True)
    (c.cache / "blob.bin").write_bytes(b"x")
    assert c.launch(100) == c.argv and not c.cache.exists()   # cold at every start
    c.dir.mkdir(parents=True)
    runs = [{"mode": "regional", "first_s": 39.5, "steady_s": 0.074, "compile_s": 39.4, "build_s": 2.0,
             "process_s": 60.0, "graphs": 3, "seconds": [39.5, 0.074]},
            {"mode": "warm", "first_s": 12.0, "steady_s": 0.074, "compile_s": 11.9, "build_s": 2.0,
             "process_s": 30.0, "graphs": 3, "seconds": [12.0, 0.074],
             "cache": {"load_s": 0.1, "fxgraph_hit": 5, "fxgraph_miss": 0}}]
    (c.dir / "compile_cost.json").write_text(json.dumps(runs))
    c.status = "done"
    c.after_run(95.0)
    assert c.cost["cold"]["first_s"] == 39.5 and c.cost["warm"]["first_s"] == 12.0 and "seconds" not in c.cost["warm"]
    assert "cold: first iteration 39.5 s" in c.describe() and "warm: first iteration 12.0 s" in c.describe()
    c.took(95.0)
    assert c.state()["cost"] == c.cost and c.state()["expected"]["took_s"] == 95.0
    assert c.cost["warm"]["cache"]["fxgraph_hit"] == 5
    # no key for the cache: the same command without it
    _, stages = plan(load_campaign([f"out={tmp_path}", "campaign.gpu.compile_cache=[]"]), tmp_path)
    assert not any("cache" in a for a in {s.name: s for s in stages}["compile"].argv)


def test_a_tool_brings_its_commands_to_the_cli_without_writing_into_its_table(tmp_path, capsys):
    """core/cli.main takes the campaign as a parameter: the package's table is never written
    into, the campaign's keys and their limits come from its own YAML (tools/campaign), the
    package's help does not list it and run.sh's does."""
    from resmlp.core import cli
    seen = {}

    def run(cfg):
        seen.update(table=set(cli.COMMANDS), stages=list(cfg.campaign.stages), profile=cfg.campaign.profile)
        return 0
    assert cli.main(["campaign", *TINY, f"out={tmp_path / 'c'}"], run=run, commands={"campaign": C.COMMAND}) == 0
    assert "campaign" not in seen["table"] and seen["profile"] == "tiny"
    assert seen["stages"][:3] == ["default_command", "device_tests", "tests"]
    assert cli.main(["campaign", "campaign.call_s=-1"], commands={"campaign": C.COMMAND}) == 2
    assert capsys.readouterr().err.strip() == ("error: campaign.call_s=-1 is not allowed: campaign.call_s must be a "
                                               "number > 0")
    assert cli.main(["campaign", *TINY]) == 2 and "unknown command 'campaign'" in capsys.readouterr().err
    assert "campaign" not in cli.usage() and not (ROOT / "configs" / "method" / "campaign.yaml").exists()
    sh = subprocess.run(["bash", str(ROOT / "run.sh"), "help"], env={**os.environ, "RESMLP_PYTHON": sys.executable},
                        capture_output=True, text=True)
    assert sh.returncode == 0 and "dino <model>" in sh.stdout
    assert re.search(r"^  campaign +.*tools/campaign/README.md\)$", sh.stdout, re.M)
    assert re.search(r"^  campaign-carry +", sh.stdout, re.M)


def test_the_preset_prediction_from_its_config_and_from_the_h100_log(tmp_path):
    gpu = load_campaign([f"out={tmp_path}"]).campaign.gpu.predict
    dino = load_config("dino", "resmlp_s12", ["demo=false"])  # the Fashion-MNIST preset
    sched = schedule(dino, 60000)
    assert sched == {"epochs": 40, "images_per_epoch": 117 * 512, "eval_every": 10, "batch_size": 512}
    const = predict(sched, gpu, {}, "campaign.gpu.predict")
    assert const["evaluations"] == 3  # epochs 10..30; the last epoch's is the end's
    assert const["need_s"] == pytest.approx(15 + 52 + 40 * 59904 / 6940 + 3 * 4 + 12, abs=0.1)
    # the 2026-11-27 log, whole (40 epochs, graphed): its own terms give back the stage's 434.1 s
    today = measured(H100_LOG_27.read_bytes(), 59904, 10)
    assert (today["startup_s"], round(today["images_per_s"])) == (51.9, 6941)
    assert predict(sched, gpu, today, "campaign.gpu.predict")["need_s"] == pytest.approx(434.1, rel=0.01)
    # the log the H100 wrote on 2026-11-26 (its last attempt, before call 2's restart line)
    seen = measured(H100_LOG.read_bytes(), 59904, 10)
    assert seen["attempt"] == 1 and seen["startup_s"] == 87.6
    assert 6600 < seen["images_per_s"] < 6620  # the median of its log lines after the first
    # 95.2 s from the k-NN of epoch 10 to epoch 20's, less 10 epochs of training at that rate
    assert seen["eval_s"] == pytest.approx(95.2 - 10 * 59904 / seen["images_per_s"], abs=1e-6)
    full = predict(sched, gpu, seen, "campaign.gpu.predict")
    assert full["from"]["startup_s"] == "measured by its attempt 1"
    assert full["from"]["end_s"] == full["from"]["launch_s"] == "campaign.gpu.predict"
    # the terms give back the log's own time line: its start, 20 epochs and the k-NN of epochs 10 and 20
    assert seen["startup_s"] + 20 * 59904 / seen["images_per_s"] + 2 * seen["eval_s"] == pytest.approx(274.1, rel=0.02)
    # resumed at epoch 23.08 (its checkpoint, on the same machine): the evaluation of epoch 30 is left
    resumed = predict(sched, gpu, seen, "x", from_epoch=23.08)
    assert resumed["evaluations"] == 1 and resumed["train_s"] == pytest.approx(16.92 * 59904 / seen["images_per_s"],
                                                                                rel=1e-3)
    # the config decides: a subset, another length and evaluation cadence
    other = load_config("dino", "resmlp_s12", ["demo=false", "data.subset=30000", "epochs=50", "eval_every=5"])
    from campaign.predict import train_images
    assert train_images(other, None) == 30000 and train_images(dino, 48) == 48 and train_images(dino, None) == 60000
    assert predict(schedule(other, 30000), gpu, {}, "x")["evaluations"] == 9


def test_the_fused_stages_ask_for_the_fused_block(tmp_path):
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    assert "bench.gpu.fused=[true]" in by["bench_fused"].argv
    assert "model.fused=true" in by["profile_preset"].argv and "model.fused=true" in by["profile_224"].argv


class Lines:
    """A bench Context that measures nothing: it records the line each family would measure,
    and answers the largest batch search with `largest`."""

    def __init__(self, p, models, largest=1024):
        self.p, self.models, self.largest, self.lines = p, models, largest, []

    def attempt(self, family, ident, fn, restorable=True):
        self.lines.append((ident["impl"], ident.get("batch")))
        return {"status": "ok", "batch": self.largest} if ident["impl"] == "largest batch search" else {}


def dino_lines(stage) -> list:
    """The dino lines a bench stage's command would measure on the gpu profile, in order."""
    cfg = bench_config(stage.argv[2:])
    assert stage.argv[:2] == ["-m", "bench"] and list(cfg.bench.rows) == ["dino"]
    ctx = Lines(cfg.bench.gpu, B.choose_models(cfg, cfg.bench.gpu)[0])
    D.dino_family(ctx)
    return ctx.lines


def test_the_levers_are_lines_of_their_own_stages_beside_the_fused_block_and_the_reference(tmp_path):
    """levers: each lever compiled and graphed, then the model's levers together, between the
    fused block's line and the reference loop's, at batch 64 and the largest batch, in one
    bench run; bench_fused (after it) only the ungraphed fused lines on top; autotune the
    max-autotune line at batch 64; the rest of the bench no lever."""
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    order = [s.name for s in stages]
    assert order.index("kernel_tests") < order.index("levers") < order.index("bench_fused") < order.index("autotune")
    graphed = [f"ours fused {x}compile+graphs" for x in ("", "token-major ", "triton ", "bf16-residual ",
                                                         "token-major+triton+bf16-residual ")]
    each = [*graphed, "reference"]
    assert dino_lines(by["levers"]) == [("largest batch search", None), *[(x, 64) for x in each],
                                        *[(x, 1024) for x in each]]
    assert dino_lines(by["bench_fused"]) == [("largest batch search", None),
                                             *[(x, b) for b in (64, 1024) for x in ("ours fused compile",
                                                                                    "ours fused compile+graphs",
                                                                                    "reference")]]
    assert dino_lines(by["autotune"]) == [(x, 64) for x in ("ours fused compile+graphs",
                                                            "ours fused max-autotune compile+graphs", "reference")]
    # the rest of the bench: no lever line, on any model
    cfg = bench_config(by["bench"].argv[2:])
    assert list(cfg.bench.gpu.levers) == [] and D.lever_lines(cfg.bench.gpu) == []
    assert (by["levers"].line_s, by["autotune"].line_s, by["levers"].shows, by["autotune"].shows) == \
        (70, 300, ("levers",), ("levers",))
    # a stage whose bench.json another stage began with other levers resumes it (bench.py's SELECTION)
    settings = {"levers": ["token-major"], "knn": {"baseline": "a.py", "backends": ["torch"]}}
    assert B._measuring(settings) == B._measuring({**settings, "levers": []})
    assert B._measuring(settings) != B._measuring({**settings, "knn": {"baseline": None, "backends": ["torch"]}})


def test_the_knn_stage_times_c11c829s_search_beside_ours_and_every_bench_stage_names_it(tmp_path, capsys):
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    knn = bench_config(by["bench_knn"].argv[2:])
    assert list(knn.bench.rows) == ["knn"] and list(knn.bench.gpu.knn.backends) == ["torch-device"]
    assert knn.bench.gpu.knn.baseline == ".baselines/knn_search_c11c829.py" and by["bench_knn"].shows == ("knn",)
    # one of the settings bench.json's lines are measured with: every bench stage passes the same
    benches = [s for s in stages if isinstance(s, BenchStage)]
    assert len(benches) == 8 and all("bench.gpu.knn.baseline=.baselines/knn_search_c11c829.py" in s.argv
                                     for s in benches)
    # tools/campaign/carry.sh (run.sh's campaign-carry) writes that file, from the commit the key names
    carry = subprocess.run(["bash", str(ROOT / "tools" / "campaign" / "carry.sh"), "--which"], capture_output=True,
                           text=True, timeout=60)
    assert carry.returncode == 0 and carry.stdout.strip() == ".baselines/knn_search_c11c829.py", carry.stderr
    # a campaign without it carried in: one line, before any work
    out = tmp_path / "never"
    assert main([*TINY, "campaign.tiny.knn_baseline=.baselines/none.py", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "campaign.tiny.knn_baseline=.baselines/none.py is not in " in err[0], err
    assert "bash run.sh campaign-carry" in err[0] and "carry .baselines" in err[0] and not out.exists()


def test_the_report_shows_each_lever_beside_the_fused_block_and_the_knn_beside_its_baseline(tmp_path):
    line = {"row": "dino", "model": "resmlp_s12", "strategy": "interpolate", "status": "ok"}
    rows = [{**line, "impl": "ours fused compile+graphs", "batch": 64, "images_per_s": 2000.0, "pct_peak": 12.0},
            {**line, "impl": "ours fused token-major compile+graphs", "batch": 64, "images_per_s": 3000.0,
             "pct_peak": 18.0, "capture_s": 41.5, "run": 3},
            {**line, "impl": "ours fused max-autotune compile+graphs", "batch": 64, "images_per_s": 2500.0,
             "capture_s": 250.0},
            {**line, "impl": "reference", "batch": 64, "images_per_s": 800.0},
            {**line, "impl": "ours fused token-major compile+graphs", "batch": 1024, "images_per_s": 5000.0,
             "capture_s": 50.0},
            {**line, "impl": "ours fused compile", "batch": 64, "images_per_s": 1000.0},
            {**line, "impl": "ours fused triton compile+graphs", "batch": 64, "status": "error", "error": "x"},
            {"row": "knn", "backend": "torch-device", "status": "ok", "device": "cuda", "queries": 50000,
             "seconds": 0.4, "seconds_full": 0.4, "baseline": ".baselines/knn_search_c11c829.py",
             "baseline_seconds": 0.8, "vs_baseline": 2.0, "same_as_baseline": True}]
    (tmp_path / "bench.json").write_text(json.dumps({"runs": 3, "left": 0, "rows": rows, "summary": []}))
    levers = BenchStage("levers", [], tmp_path, 90, line_s=70, shows=("levers",))
    levers.figures = levers.read_figures()
    got = {(r["lever"], r["batch"]): r for r in levers.figures["levers"]}
    assert set(got) == {("token-major", 64), ("max-autotune", 64), ("token-major", 1024)}   # no error line
    tm = got[("token-major", 64)]
    assert (tm["kind"], tm["vs_fused"], tm["vs_ref"], tm["pct_peak"], tm["capture_s"], tm["fused_images_per_s"]) == \
        ("compile+graphs", 1.5, 3.75, 18.0, 41.5, 2000.0)
    assert got[("token-major", 1024)]["vs_fused"] is None and got[("max-autotune", 64)]["capture_s"] == 250.0
    assert "knn" not in levers.figures
    text = levers.describe()
    assert ("token-major compile+graphs b64: 3000 img/s, 1.50x the fused block, 3.75x the reference, 18.0% of the "
            "matmul rate, its first calls 42 s") in text
    knn = BenchStage("bench_knn", [], tmp_path, 40, line_s=20, shows=("knn",))
    knn.figures = knn.read_figures()
    assert [(r["seconds"], r["baseline_seconds"], r["vs_baseline"]) for r in knn.figures["knn"]] == [(0.4, 0.8, 2.0)]
    assert ("k-NN torch-device 0.400 s for 50000 queries (knn_search_c11c829.py: 0.800 s, ours 2.00x, the same "
            "votes)") in knn.describe() and "levers" not in knn.figures
    # a stage that shows nothing else counts the lines only
    assert set(BenchStage("bench", [], tmp_path, 180, line_s=150).read_figures()) == {"bench_runs", "lines", "left",
                                                                                      "goals"}


def test_the_linear_stage_times_the_default_probe_at_imagenets_size_and_the_report_shows_it(tmp_path):
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    names = [s.name for s in stages]
    by = {s.name: s for s in stages}
    stage = by["bench_linear"]
    assert names.index("bench_linear") == names.index("bench_knn") + 1
    assert isinstance(stage, BenchStage) and stage.dir == by["bench"].dir and stage.shows == ("linear",)
    assert (stage.line_s, stage.min_start_s) == (270, 290)
    cfg = bench_config(stage.argv[2:])
    lin = cfg.bench.gpu.linear
    assert list(cfg.bench.rows) == ["linear"] and list(lin.protocols) == ["lbfgs", "dino"]
    assert (lin.n_train, lin.n_test, lin.dim, lin.classes) == (1281167, 50000, 384, 1000)   # ImageNet's, S12's width
    # its lines in the report: the default's selection and refit, DINO's epochs counted whole
    line = {"row": "linear", "status": "ok", "device": "cuda", "n_train": 1281167, "dim": 384, "classes": 1000}
    rows = [{**line, "protocol": "lbfgs", "seconds": 180.0, "selection_s": 170.0, "refit_s": 10.0, "l2s": 13,
             "iterations": 1900, "passes": 2000, "l2": 1e-5, "converged": True, "top1": 76.5, "mem_gb": 2.5},
            {**line, "protocol": "dino", "seconds": 4.0, "seconds_full": 131.0, "epoch_s": 1.3, "mem_gb": 3.0},
            {**line, "protocol": "dino", "status": "error", "error": "x"}]
    (tmp_path / "bench.json").write_text(json.dumps({"runs": 1, "left": 0, "rows": rows, "summary": []}))
    shown = BenchStage("bench_linear", [], tmp_path, 290, line_s=270, shows=("linear",))
    shown.figures = shown.read_figures()
    assert [(r["protocol"], r["seconds"], r["passes"]) for r in shown.figures["linear"]] == \
        [("lbfgs", 180.0, 2000), ("dino", 4.0, None)]
    text = shown.describe()
    assert ("linear lbfgs on 1281167 x 384, 1000 classes: 180.0 s (13 L2s 170.0 s, the refit 10.0 s; 2000 passes), "
            "L2 1e-05, top-1 76.50, 2.50 GB") in text
    assert "linear dino on 1281167 x 384, 1000 classes: 131.0 s for all epochs (1.30 s each), 3.00 GB" in text


def test_the_head_stages_time_the_preset_and_the_224_px_step_per_precision(tmp_path):
    _, stages = plan(load_campaign([f"out={tmp_path}"]), tmp_path)
    by = {s.name: s for s in stages}
    for name, img, batch in (("head_preset", 32, 512), ("head_224", 224, 64)):
        h = by[name]
        results = tmp_path / name / "head_cost.json"
        assert isinstance(h, HeadStage) and h.results == results and h.dir == tmp_path / name
        assert h.argv[:8] == ["-m", "bench.head_cost", "--precisions", "fp32,tf32,bf16", "--mode", "regional",
                              "--json", str(results)]
        # the step head_cost.py builds (compile_cost.build: `dino resmlp_s12`, demo=false, these keys)
        cfg = load_config("dino", "resmlp_s12", ["demo=false", *h.argv[8:]])
        assert (cfg.data.img_size, cfg.batch_size, cfg.dino.cuda_graphs, cfg.device) == (img, batch, True, "cuda")
    cfg = load_config("dino", "resmlp_s12", ["demo=false", *by["head_224"].argv[8:]])
    assert (cfg.model.patch_size, cfg.data.local_size, cfg.dino.out_dim) == (16, 96, 65536)
    assert (by["head_preset"].min_start_s, by["head_224"].min_start_s) == (110, 90)
    # its results: each precision's figures in the state (its repeats aside), a rerun's own
    h = by["head_224"]
    h.dir.mkdir(parents=True)
    r = {"mode": "regional", "graphs": True, "precision": "bf16", "batch": 64, "crops": "2x224+8x96", "repeats": [1.0]}
    h.results.write_text(json.dumps([{**r, "head_precision": "fp32", "images_per_s": 2000.0, "vs_fp32": 1.0,
                                      "first_loss": 11.09, "first_loss_vs_fp32": 0.0},
                                     {**r, "head_precision": "tf32", "images_per_s": 2100.0, "vs_fp32": 1.05,
                                      "first_loss": 11.09, "first_loss_vs_fp32": 1e-7},
                                     {**r, "head_precision": "bf16", "images_per_s": 2200.0, "vs_fp32": 1.1,
                                      "first_loss": 11.1, "first_loss_vs_fp32": 9e-4}]))
    h.status = "done"
    h.after_run(70.0)
    assert list(h.cost) == ["fp32", "tf32", "bf16"] and h.cost["bf16"]["vs_fp32"] == 1.1
    assert "repeats" not in h.cost["fp32"] and h.state()["cost"] == h.cost
    assert h.describe() == ("regional + graphs, bf16, batch 64 (2x224+8x96): fp32 2000 img/s, tf32 2100 img/s "
                            "(1.050x fp32, first loss +1.0e-07), bf16 2200 img/s (1.100x fp32, first loss +9.0e-04)")
    assert h.launch(100) == h.argv and not h.results.exists()
    h.status = "failed"
    h.after_run(1.0)
    assert h.cost["bf16"]["images_per_s"] == 2200.0   # a failed run leaves the last figures as they were


def test_a_profile_keeps_every_kernel_in_the_summary_and_comes_back_on_a_fresh_machine(tmp_path):
    top = [{"name": f"kernel_{i}_" + "x" * 300, "class": "elementwise", "ms_per_call": 1.0 / (i + 1), "count": 3.0,
            "gb_per_call": 0.123456789} for i in range(25)]
    classes = {"GEMM": {"ms": 20.6, "floor_ms": 18.0}, "elementwise": {"ms": 10.4, "floor_ms": 8.5},
               "other": {"ms": 1.0, "floor_ms": None}, "all": {"ms": 32.0, "floor_ms": 26.5}}
    profile = {"config": {"model": "resmlp_s12", "crops": "2x32+8x16", "batch": 512},
               "phases": {"step eager": {"ms": 80.0, "images_per_s": 6400.0},
                          "step compiled": {"ms": 40.0, "images_per_s": 12800.0}},
               "rates": {"matmul": {"tflops": 720.4, "size": 8192, "dtype": "bfloat16", "repeats": [1]},
                         "copy": {"tb_per_s": 4.3, "mbytes": 2048, "repeats": [1]}},
               "kernels_compiled": {"wall_ms": 40.2, "busy_ms": 38.1, "kernels_per_call": 812.0,
                                    "flops_per_call": 13.5e12, "classes": classes, "kernel_names": 25, "top": top}}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    stage = ProfileStage("profile_preset", [], tmp_path, 120, status="done")
    stage.profile = profile_figures(tmp_path / "profile.json")
    kept = stage.profile["kernels_compiled"]
    assert len(kept["top"]) == 25 and all(k["class"] == "elementwise" for k in kept["top"])  # every kernel
    assert all(len(k["name"]) <= 160 for k in kept["top"]) and kept["top"][0]["gb_per_call"] == 0.1235
    assert kept["classes"] == classes and kept["flops_per_call"] == 13.5e12
    assert stage.profile["rates"] == {"matmul": {"tflops": 720.4, "size": 8192, "dtype": "bfloat16"},
                                      "copy": {"tb_per_s": 4.3, "mbytes": 2048}}
    assert stage.profile["phases"] == profile["phases"] and kept["busy_ms"] == 38.1
    line = stage.describe()
    assert "step compiled 40.0 ms (12800 img/s)" in line and "busy 38.1 of 40.2 ms per call" in line
    assert "GEMM 20.60 ms (floor 18.00), elementwise 10.40 ms (floor 8.50), other 1.00 ms" in line
    # in the stage's state, so in summary.json, and back from a carried report on a fresh machine
    fresh = tmp_path / "fresh"
    RE.restore(tmp_path, {"state": {"stages": {"profile_preset": stage.state()}, "calls": []}, "stages": []}, fresh, 2,
               [ProfileStage("profile_preset", [], fresh / "profile_preset", 120)])
    again = ProfileStage("profile_preset", [], fresh / "profile_preset", 120)
    again.take(S.read_state(fresh)["stages"]["profile_preset"])
    assert again.profile == stage.profile and again.status == "done"
    # the k-NN's profile: its figures whole (a few lines), its kernels, its largest phases in the line
    knn = {"seconds": 0.8, "first_s": 1.9, "phased_s": 0.81, "rounds": [{"candidates": 40, "queries": 50000}],
           "phases": {"pass: matmul": {"calls": 377, "device_ms": 120.0, "host_ms": 9.0},
                      "re-rank": {"calls": 13, "device_ms": 30.0, "host_ms": 2.0},
                      "pass: block maxima, merge": {"calls": 390, "device_ms": 500.0, "host_ms": 30.0},
                      "vote": {"calls": 1, "device_ms": 0.1, "host_ms": 6.0}}}
    (tmp_path / "profile.json").write_text(json.dumps({"config": None, "phases": {}, "knn": knn,
                                                       "kernels_knn": profile["kernels_compiled"]}))
    stage = ProfileStage("profile_knn", [], tmp_path, 60, status="done")
    stage.profile = profile_figures(tmp_path / "profile.json")
    assert stage.profile["knn"] == knn and len(stage.profile["kernels_knn"]["top"]) == 25
    line = stage.describe()
    assert ("k-NN 0.800 s (first call 1.900 s, by phase 0.810 s: pass: block maxima, merge 500 ms, pass: matmul "
            "120 ms, re-rank 30 ms)") in line and "knn: busy 38.1 of 40.2 ms per call" in line


def test_a_stage_left_out_of_campaign_stages_keeps_its_files_in_the_report(tmp_path):
    """A window that runs only the tests still carries the preset an earlier window cut: its
    log comes back from the carried report, with the restart line, and goes on in the next."""
    carried = tmp_path / "carried"
    carried.mkdir()
    log = json.dumps({"epoch": 0.5, "loss": 6.0, "elapsed_s": 20.0}) + "\n"
    (carried / "preset_log.jsonl").write_text(log)
    state = {"profile": "tiny", "dir": str(tmp_path / "old"), "commands": {},
             "stages": {"preset": {"status": "running", "runs": 1}}, "calls": [{"call": 1}]}
    (carried / "summary.json").write_text(json.dumps({"state": state, "stages": [{"name": "preset",
                                                                                 "epochs_trained": 0.5}]}))
    out = tmp_path / "campaign"
    c = Campaign(load_campaign([*TINY, f"out={out}", "campaign.stages=[tests]",
                                                f"campaign.from_report={carried}"]))
    c.load()
    assert [s.name for s in c.stages] == ["tests"] and "preset starts again from epoch 0" in c.restored
    c.report(0)
    kept = records(c.report_dir / "preset_log.jsonl")
    assert kept[0] == json.loads(log) and kept[1]["restart"] == 2
    assert S.read_state(out)["stages"]["preset"]["restart"] is True


def test_pytest_output_is_kept_test_by_test_and_a_cut_runs_only_the_rest():
    outcomes: dict = {}
    lines = ["tests/test_graphs.py::test_a[False] PASSED                         [ 20%]",
             "tests/test_graphs.py::test_a[True] SKIPPED (needs a CUDA GPU)      [ 40%]",
             "tests/test_x.py::test_b FAILED                                      [ 60%]",
             "tests/test_x.py::test_c PASSED                                      [ 80%]",
             "tests/test_x.py::test_c ERROR                                       [ 80%]",
             "FAILED tests/test_x.py::test_b - AssertionError: 1 != 2",
             "collecting ... collected 6 items", "ep 1/2 it 2/6 loss 6.5"]
    said = [note_test_line(line, outcomes) for line in lines]
    assert said == [True] * 6 + [False] * 2
    assert outcomes == {"tests/test_graphs.py::test_a[False]": {"outcome": "passed"},
                        "tests/test_graphs.py::test_a[True]": {"outcome": "skipped", "message": "needs a CUDA GPU"},
                        "tests/test_x.py::test_b": {"outcome": "failed", "message": "AssertionError: 1 != 2"},
                        "tests/test_x.py::test_c": {"outcome": "error"}}
    stage = TestsStage("tests", ["-m", "pytest", "tests"], Path("."), 5, outcomes=outcomes)
    argv = stage.launch(0)
    assert argv[:3] == ["-m", "pytest", "tests"] and argv[3::2] == ["--deselect"] * 4
    assert set(argv[4::2]) == set(outcomes)
    stage.classify(1, None)
    assert stage.status == "done" and stage.note.startswith("2 test(s) failed")
    stage.classify(-15, "call")
    assert stage.status == "cut"


def test_the_preset_is_the_default_command_unless_a_graph_test_failed():
    tests = TestsStage("tests", [], Path("."), 5, status="done")
    graph = "tests/test_graphs.py"
    tests.outcomes = {f"{graph}::test_a": {"outcome": "passed"}, f"{graph}::test_b[True]": {"outcome": "passed"},
                      "tests/test_x.py::test_c": {"outcome": "failed"}}
    passed = graphs_decision(tests, graph, [])
    assert passed["add"] is None and passed["why"] == f"the default command: the 2 tests of {graph} passed"
    tests.outcomes[f"{graph}::test_c"] = {"outcome": "skipped", "message": "needs a CUDA GPU"}
    off = graphs_decision(tests, graph, [])
    assert off["add"] == "dino.cuda_graphs=false" and "1 of the 3" in off["why"] and "needs a CUDA GPU" in off["why"]
    assert graphs_decision(None, graph, [])["why"].endswith("not in campaign.stages)")
    tests.status = "cut"
    assert graphs_decision(tests, graph, [])["add"] is None
    assert graphs_decision(tests, graph, ["dino.cuda_graphs=true"])["add"] is None
    # decided once, at the preset's first start, and kept
    tests.status, tests.outcomes = "done", {f"{graph}::test_a": {"outcome": "failed"}}
    preset = PresetStage("preset", ["-m", "x"], Path("."), 5, config=(), tests=tests, graph_tests=graph)
    assert preset.launch(0) == ["-m", "x", "dino.cuda_graphs=false"]
    tests.outcomes[f"{graph}::test_a"]["outcome"] = "passed"
    assert preset.launch(0)[-1] == "dino.cuda_graphs=false"
    assert PresetStage("preset", ["-m", "x"], Path("."), 5, config=(), tests=tests, graph_tests=graph).launch(0) == \
        ["-m", "x"]


# --------------------------------------------------------------------------- the default command, first

def test_the_default_command_comes_first_as_a_user_types_it_then_the_device_tests(tmp_path):
    """Issue 49 part 7: `dino resmlp_s12` with nothing but out= and the short length (one
    epoch; its resume to a second, campaign/starts.py), before any other stage; then the CUDA
    tests of graphs, compiling and the device checks, which the other tests stage leaves out
    and whose graph tests decide the preset's graphs."""
    d = tmp_path
    _, stages = plan(load_campaign([f"out={d}"]), d)
    first, device, tests = stages[:3]
    run = d / "default_command" / "run"
    assert isinstance(first, DefaultStage) and first.min_start_s == 180 and first.dir == d / "default_command"
    assert first.argv == ["-m", "campaign.starts", "--out", str(d / "default_command"), "--keep",
                          str(run / "results.json"), "--then", "epochs=2", "--",
                          "-m", "resmlp.core.cli", "dino", "resmlp_s12", f"out={run}", "epochs=1"]
    files = [a for a in device.argv if a.startswith("tests/")]
    assert isinstance(device, TestsStage) and device.name == "device_tests" and device.argv[6:8] == ["-m", "cuda"]
    assert {"tests/test_graphs.py", "tests/test_compiling.py", "tests/test_compile_cache.py",
            "tests/test_device_check.py"} <= set(files)
    ignored = {a.split("=", 1)[1] for a in tests.argv if a.startswith("--ignore=")}
    assert ignored == {*files, "tests/test_kernels.py"} and "tests" in tests.argv   # no test runs twice
    assert next(s for s in stages if s.name == "preset").tests is device   # its graph tests decide the preset's graphs


# What a GPU start prints, as far as the stage keeps it (a made-up recording: no figure of it was measured)
RECORDED = ["[starts] start 1 of 2: python -m resmlp.core.cli dino resmlp_s12 out=/c/default_command/run epochs=1",
            "device: NVIDIA H200 (sm 9.0, 139.8 GiB, 139.1 GiB free); precision bf16 (auto: this GPU has bf16)",
            "path: blocks compiled by region, the step as one CUDA graph",
            "compile cache: none in /c/default_command/run/compile_cache yet; the first iteration compiles, then "
            "saves it there",
            "[teacher at init] knn top1=10.00 top5=50.00 (k=20, T=0.07)",
            "ep 1/1 it 1/117 loss 10.9 lr 0.0 wd 0.040 m 0.9960 T_t 0.040 H_t 6.00 KL 0.000 30 img/s",
            "compile cache: saved 14 compiled artifacts (3.2 MiB) to /c/default_command/run/compile_cache/a.bin",
            "[starts] start 2 of 2: python -m resmlp.core.cli dino resmlp_s12 out=/c/default_command/run epochs=1 "
            "epochs=2",
            "device: NVIDIA H200 (sm 9.0, 139.8 GiB, 139.1 GiB free); precision bf16 (auto: this GPU has bf16)",
            "path: blocks compiled by region, the step as one CUDA graph",
            "resuming from /c/default_command/run/checkpoint.pth (epoch 1, iteration 117)",
            "compile cache: loaded 14 compiled artifacts (3.2 MiB) from /c/default_command/run/compile_cache/a.bin",
            "warning: a made-up warning"]


def start_results(start_it: int, first_s: float, peak: float) -> dict:
    """A start's results.json as the trainer writes it (made-up figures), its timing with
    every start so far."""
    starts = [{"at_iteration": 0, "startup_s": 9.0, "first_iteration_s": 40.0}]
    if start_it:
        starts.append({"at_iteration": start_it, "startup_s": 8.0, "first_iteration_s": first_s})
    return {"path": {"compile": "regions", "cuda_graphs": True}, "precision": "bf16", "device": "NVIDIA H200",
            "knn_top1": 70.0, "train_images_per_s": 6900.0, "peak_mem_mb": peak, "peak_reserved_mb": 2 * peak,
            "timing": {"starts": starts}}


def test_the_default_commands_lines_and_results_become_the_reports_figures(tmp_path):
    stage = DefaultStage("default_command", ["-m", "campaign.starts"], tmp_path / "default_command", 180)
    (stage.dir / "run").mkdir(parents=True)
    (stage.dir / "start1_results.json").write_text("{}")
    assert stage.launch(100) == ["-m", "campaign.starts"] and list(stage.dir.iterdir()) == []  # a rerun starts cold
    assert [stage.heard(line) for line in RECORDED] == [True, True, True, True, False, False, True,
                                                        True, True, True, True, True, True]
    (stage.dir / "start1_results.json").write_text(json.dumps(start_results(0, 0, 16000.0)))
    (stage.dir / "start2_results.json").write_text(json.dumps(start_results(117, 6.5, 15000.0)))
    stage.classify(0, None)
    stage.after_run(150.0)
    one, two = stage.starts
    assert one["lines"] == {"device": [RECORDED[1]], "path": [RECORDED[2]], "compile_cache": [RECORDED[3], RECORDED[6]]}
    assert (one["first_iteration_s"], one["startup_s"], one["peak_mem_mb"], one["peak_reserved_mb"]) == \
        (40.0, 9.0, 16000.0, 32000.0)
    assert one["results"]["path"] == {"compile": "regions", "cuda_graphs": True}
    assert one["results"]["precision"] == "bf16"
    assert (two["at_iteration"], two["first_iteration_s"], two["peak_mem_mb"]) == (117, 6.5, 15000.0)
    assert two["lines"]["notes"] == [RECORDED[10], RECORDED[12]] and two["lines"]["compile_cache"] == [RECORDED[11]]
    stage.figures = stage.read_figures()
    said = stage.describe()
    assert said.startswith("start 1: path: blocks compiled by region, the step as one CUDA graph, first iteration "
                           "40.0 s (start-up 9 s), peak 15.6 GiB allocated, 31.2 reserved, compile cache: saved 14")
    assert "start 2: first iteration 6.5 s (start-up 8 s)" in said and "compile cache: loaded 14" in said
    # a fresh machine: the run dir stayed behind, the state keeps every figure
    state = json.loads(json.dumps(stage.state()))
    again = DefaultStage("default_command", [], tmp_path / "elsewhere", 180)
    again.take(state)
    assert again.read_figures() == {"starts": stage.starts}
    # a start that fails: the stage says which, with its one line
    stage.launch(100)
    for line in [*RECORDED[:3], RECORDED[7], "error: the GPU Tesla V100-SXM2-16GB is sm_70 ..."]:
        stage.heard(line)
    stage.classify(2, None)
    assert stage.status == "failed" and stage.note == "start 2 exit 2: error: the GPU Tesla V100-SXM2-16GB is sm_70 ..."
    stage.launch(100)   # a traceback: its last line
    for line in [RECORDED[0], "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:"]:
        stage.heard(line)
    stage.classify(1, None)
    assert stage.note == "start 1 exit 1: torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:"


STARTED = """import os, signal, sys, time
from pathlib import Path
cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
print("argv", sys.argv[1:], "cache", cache.name, "empty", not cache.exists() or not any(cache.iterdir()), flush=True)
cache.mkdir(parents=True, exist_ok=True)
(cache / "kernel").write_text("compiled")
Path(sys.argv[1]).write_text(" ".join(sys.argv[2:]))
if "fail" in sys.argv:
    sys.exit(3)
if "wait" in sys.argv:
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))
    print("waiting", flush=True)
    time.sleep(30)
"""


def starts(tmp_path, *command) -> subprocess.Popen:
    """campaign/starts.py over a script that says what it was given."""
    script = tmp_path.parent / "start.py"
    script.write_text(STARTED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), *filter(None, [os.environ.get(
        "PYTHONPATH")])])}
    return subprocess.Popen([sys.executable, "-m", "campaign.starts", "--out", str(tmp_path), "--keep",
                             str(tmp_path / "results.txt"), "--then", "epochs=2", "--", str(script),
                             str(tmp_path / "results.txt"), *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_the_starts_run_the_command_twice_each_compiling_afresh_and_stop_on_a_failure_or_a_signal(tmp_path):
    proc = starts(tmp_path / "both", "epochs=1")
    lines = proc.communicate(timeout=60)[0].splitlines()
    results = tmp_path / "both" / "results.txt"
    assert proc.returncode == 0, lines
    assert [line for line in lines if line.startswith("[starts]")] == [
        f"[starts] start {n} of 2: python {tmp_path / 'start.py'} {results} epochs=1" + (" epochs=2" if n == 2 else "")
        for n in (1, 2)]
    assert [line for line in lines if line.startswith("argv")] == [
        f"argv ['{results}', 'epochs=1'] cache start1 empty True",
        f"argv ['{results}', 'epochs=1', 'epochs=2'] cache start2 empty True"]
    assert [(tmp_path / "both" / f"start{n}_results.txt").read_text() for n in (1, 2)] == ["epochs=1",
                                                                                          "epochs=1 epochs=2"]
    # a start that fails ends them, with its exit code; its results are not kept
    proc = starts(tmp_path / "failed", "fail")
    lines = proc.communicate(timeout=60)[0].splitlines()
    assert proc.returncode == 3 and sum(line.startswith("[starts]") for line in lines) == 1
    assert not (tmp_path / "failed" / "start1_results.txt").exists()
    # SIGTERM goes to the start under way, whose exit (75: saved) ends them
    proc = starts(tmp_path / "stopped", "wait")
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("waiting"):
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75 and sum(line.startswith("[starts]") for line in seen) == 1, seen


def test_a_budget_stage_ends_when_its_budget_is_spent():
    compare = TrainingStage("compare", [], Path("."), 5, config=(), budget_s=900)
    compare.classify(75, "budget")
    assert compare.status == "done" and "budget of 900 s" in compare.note
    compare.classify(75, "call")
    assert compare.status == "cut"
    compare.classify(3, None)
    assert compare.status == "failed"


def holds_a_name(node, names: set) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(holds_a_name(e, names) for e in node.elts)


def name_constants(source: str, names: set) -> set:
    """The module-level constants of `source` that hold a stage's name (TRAINING = (...))."""
    return {t.id for n in ast.parse(source).body if isinstance(n, ast.Assign) and holds_a_name(n.value, names)
            for t in n.targets if isinstance(t, ast.Name)}


def stage_branches(source: str, names: set, where: str = "<source>", constants: set = frozenset()) -> list:
    """Where `source` branches on a stage's name: a comparison or a `match` case against a
    name written out, or in a tuple, a list, a set or a module-level constant that holds one
    (its own, or `constants` of the modules beside it). A config section or a figure may
    share a stage's name: a look-up is no branch."""
    tree = ast.parse(source, where)
    constants = {*constants, *name_constants(source, names)}

    def named(node) -> bool:
        return holds_a_name(node, names)

    def names_one(node) -> bool:
        return named(node) or (isinstance(node, ast.Name) and node.id in constants)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = any(names_one(x) for x in (node.left, *node.comparators))
        elif isinstance(node, ast.MatchValue):
            hit = names_one(node.value)
        else:
            continue
        if hit:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_of_the_campaign_branches_on_a_stage_name():
    """A stage's kind decides what it does (stages.py); its name only picks its kind
    and keys, once, in the plan's table."""
    names = set(OmegaConf.load(YAML).limits["campaign.stages"])
    _, stages = plan(load_campaign(["campaign.stages=[" + ",".join(sorted(names)) + "]"]), ROOT)
    assert {s.name for s in stages} == names  # every name has a kind
    files = sorted(Path(C.__file__).parent.glob("*.py"))
    assert len(files) >= 8, files
    constants = {c for path in files for c in name_constants(path.read_text(), names)}
    found = [f for path in files for f in stage_branches(path.read_text(), names, path.name, constants)]
    assert not found, "\n".join(found)
    # what the check is for: the branches the campaign once had
    for branch in ('if stage.name == "tests":\n    pass', 'ok = stage.name in ("bench_fused", "bench")',
                   'TRAINING = ("preset", "compare")\nif n in TRAINING:\n    pass', 'ok = "tests" != name',
                   'match n:\n    case "preset":\n        pass'):
        assert stage_branches(branch, names), branch
    assert not stage_branches('d = root / "bench"\nargv = ["-m", "bench"]\nok = n == "dino"\nx = keys["preset"]', names)


# --------------------------------------------------------------------------- the bench's lines

def test_bench_lines_are_kept_across_stages_and_a_family_that_raised_is_not_done(tmp_path, monkeypatch):
    base = ["bench.profile=tiny", f"out={tmp_path}", "bench.resume=true", "bench.models=[resmlp_s12]"]

    def run(*extra):
        return B.bench(bench_config([*base, *extra]))
    first = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch]")
    assert [r["row"] for r in first["rows"]] == ["peak", "peak", "knn"]
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
    # a line that failed is no figure: the next run that chooses it measures it again
    monkeypatch.setitem(B.FAMILIES, "knn", lambda ctx: ctx.attempt(
        "knn", {"backend": "torch-raw-bf16", "n_train": 500, "dim": 16, "k": 20}, lambda: 1 / 0))
    fifth = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch-raw-bf16]")
    assert [r["status"] for r in fifth["rows"] if r.get("backend") == "torch-raw-bf16"] == ["error"]
    monkeypatch.setitem(B.FAMILIES, "knn", real)
    sixth = run("bench.rows=[knn]", "bench.tiny.knn.backends=[torch-raw-bf16]")
    again = [r for r in sixth["rows"] if r.get("backend") == "torch-raw-bf16"]
    assert [(r["status"], r["run"]) for r in again] == [("ok", 6)]
    assert {(r["backend"], r["run"]) for r in sixth["rows"] if r["row"] == "knn"} == {("torch", 1), ("torch-raw", 2),
                                                                                        ("torch-raw-bf16", 6)}
    # a setting that changes how a line is measured is refused
    with pytest.raises(UserError, match="other settings"):
        run("bench.rows=[knn]", "bench.tiny.knn.k=5")


# --------------------------------------------------------------------------- the preset's checkpoints

def test_checkpoints_every_n_epochs_count_in_the_training_time(tmp_path, monkeypatch):
    """ckpt_epochs=2 over 3 epochs: a checkpoint at epoch 2 and at the last; each write's
    seconds (made 100 here by a clock the write moves) are summed apart and the one a run
    goes on after is in train_s, as a user waits for it."""
    from bench.jpegs import make_jpeg_folder
    from resmlp.core import cadence, run as run_module
    from resmlp.ssl.train import train
    make_jpeg_folder(str(tmp_path / "images"), 32, 36, 48)
    offset = [0.0]
    clock = types.SimpleNamespace(time=lambda: time.time() + offset[0], monotonic=time.monotonic)
    for module in (run_module, cadence):  # Run's clock (wall_time_s) and the loop's (timing)
        monkeypatch.setattr(module, "time", clock)
    real = run_module.save_checkpoint

    def slow_save(*args, **kwargs):
        offset[0] += 100.0
        return real(*args, **kwargs)
    monkeypatch.setattr(run_module, "save_checkpoint", slow_save)
    tiny = load_campaign(TINY).campaign.tiny.preset
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
    assert main(["campaign.profile=nope", out]) == 2
    assert main(["campaign.profile=tiny", "campaign.call_s=10", out]) == 2
    assert "min_start_s.default_command + stop_grace_s" in capsys.readouterr().err
    assert main([*TINY, "campaign.window_left_s=-60", f"out={tmp_path / 'never'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: campaign.window_left_s=-60 is not allowed: campaign.window_left_s "
                                        "must be a number > 0 (or null)"] and not (tmp_path / "never").exists()
    state = {"commands": {"preset": ["-m", "resmlp.core.cli", "dino", "resmlp_s12", "epochs=3"]}, "stages": {},
             "calls": []}
    (tmp_path / "campaign.json").write_text(json.dumps(state))
    assert main(["campaign.profile=tiny", "campaign.stages=[preset]", out]) == 2
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
        assert main([*TINY, "campaign.stages=[preset]", f"out={fresh}", *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert not fresh.exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main([*TINY, f"out={fresh}", f"campaign.report={taken}"]) == 2
    assert "holds other things (notes.txt)" in capsys.readouterr().err and not fresh.exists()
    # none yet (the first call): a new campaign, and it says so
    c = Campaign(load_campaign([*TINY, f"out={fresh}", f"campaign.from_report={tmp_path / 'none'}"]))
    c.load()
    assert c.restored.startswith("no report in") and not fresh.exists()
    # through run.sh, whose campaign case sets up before any Python runs
    sh = subprocess.run(["bash", str(ROOT / "run.sh"), "campaign", "campaign.profile=nope", out], cwd=ROOT,
                        env={**os.environ, "RESMLP_PYTHON": sys.executable}, capture_output=True, text=True)
    assert sh.returncode == 2 and sh.stderr.strip().splitlines() == [
        "error: campaign.profile=nope is not allowed: campaign.profile must be one of gpu, tiny"], sh.stderr


def test_the_campaign_is_a_tool_of_this_repository_not_a_command_of_the_package(tmp_path, capsys):
    """tools/campaign measures this project; the package's own command line does not offer it,
    and the campaign runs only where it is called (no SLURM job)."""
    package = subprocess.run([sys.executable, "-m", "resmlp.core.cli", "campaign", *TINY], cwd=tmp_path,
                             env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True)
    assert package.returncode == 2 and "unknown command 'campaign'" in package.stderr, package.stderr
    assert main([*TINY, "launcher=slurm", f"out={tmp_path / 'never'}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["error: `campaign` does not read launcher (it runs here, on the machine it "
                                        "is called on); drop launcher=slurm"] and not (tmp_path / "never").exists()


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


def test_a_report_cut_by_a_kill_never_holds_a_summary_newer_than_its_files(tmp_path, monkeypatch):
    """The kill of a call can land inside its report's writing (as the rehearsal's call 1
    met it): the summary is written last, so a cut report is an older whole, not a summary
    naming a preset log the folder lacks."""
    log = tmp_path / "preset_log.jsonl"
    log.write_text('{"epoch": 0, "knn_top1": 10.0}\n')
    stage = types.SimpleNamespace(report_files=lambda: {"preset_log.jsonl": log})
    files = RE.report_files(tmp_path, {"stages": ["preset"]}, [stage])
    assert list(files)[-1] == "summary.json"
    folder = tmp_path / "report"
    real, written = Path.replace, []

    def killed_after_one(self, target):
        if written:
            raise KeyboardInterrupt  # stands for the SIGKILL
        written.append(Path(target).name)
        return real(self, target)
    monkeypatch.setattr(Path, "replace", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        write_report(folder, files)
    assert written == ["preset_log.jsonl"] and not (folder / "summary.json").exists()


def test_largest_batch_doubles_until_out_of_memory(monkeypatch):
    cfg = bench_config(["bench.profile=tiny", "bench.tiny.max_batch=16"])
    ctx = Context(torch.device("cpu"), "tiny", cfg.bench.tiny, ["resmlp_s12"], False)
    real = D.call_step

    def tight(step, crops):
        if crops[0].shape[0] >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(step, crops)
    monkeypatch.setattr(D, "call_step", tight)
    found = D._largest_batch(ctx, "resmlp_s12", "interpolate")
    assert found["batch"] == 8 and found["tried"] == [8, 16] and "out of memory at batch 16" in found["stop"]
    monkeypatch.setattr(D, "call_step", real)
    capped = D._largest_batch(ctx, "resmlp_s12", "interpolate")
    assert capped["batch"] == 16 and capped["tried"] == [8, 16] and capped["stop"] == "max_batch reached"


def test_a_stop_at_an_epochs_last_iteration_still_evaluates_that_epoch(tmp_path, monkeypatch):
    """A cut that lands on an epoch's last iteration must not lose that epoch's k-NN
    point: the run stops at the epoch-end checkpoint, after the evaluation."""
    from bench.jpegs import make_jpeg_folder
    from resmlp.core import cadence, preempt
    from resmlp.core.errors import Preempted
    from resmlp.ssl.train import train
    make_jpeg_folder(str(tmp_path / "images"), 48, 36, 48)
    tiny = load_campaign(TINY).campaign.tiny.preset
    cfg = load_config("dino", "resmlp_s12", [*tiny, "data=imagefolder", f"data.root={tmp_path / 'images'}",
                                             f"out={tmp_path / 'run'}", "ckpt_epochs=2"])
    real = cadence.Cadence.after_iteration

    def signal_at_epoch_end(self, it):
        if it == self.ipe:
            signal.raise_signal(signal.SIGTERM)  # what a scheduler sends; preempt's handler notes it
        real(self, it)
    monkeypatch.setattr(cadence.Cadence, "after_iteration", signal_at_epoch_end)
    with preempt.watch(), pytest.raises(Preempted, match="after iteration 3 of 6"):  # watch: as the CLI runs it
        train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "knn_top1" in r] == [0, 1]
    saved = torch.load(tmp_path / "run" / "checkpoint.pth", weights_only=False, map_location="cpu")
    assert saved["iteration"] == 3  # saved by the stop although epoch 1 is no checkpoint epoch under ckpt_epochs=2
    assert saved["results"]["timing"]["starts"][0]["first_iteration_s"] > 0
