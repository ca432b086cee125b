"""The bench (tools/bench, `bash run.sh bench`): the tiny profile runs every row on the CPU, and
the two DINO steps it compares compute the same thing (so the speed ratio compares like with
like); the k-NN baseline in its own process; the profile and the cost scripts."""
import importlib.util
import json
import signal
from pathlib import Path

import pytest
import torch

from bench import dino as D
from bench import knn as K
from bench import step as S
from bench.bench import Context, main, render
from bench.config import bench_profile
from bench.reference import RefDinoStep, build_reference_networks
from bench.timing import peak_memory_gb
from resmlp.data.crop_plan import crop_plan
from resmlp.models import convert_state_dict, load_pretrained


def tiny_profile():
    return bench_profile("tiny")


def test_tiny_profile_measures_every_row(tmp_path):
    assert main(["bench.profile=tiny", f"out={tmp_path}"]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    # faiss is optional (the GPU image has none): its line is then SKIPPED, never an error
    has_faiss = importlib.util.find_spec("faiss") is not None
    bad = [r for r in rows if r["status"] != "ok" and (has_faiss or r.get("backend") != "faiss-cpu")]
    assert not bad, bad
    rows = [r for r in rows if r["status"] == "ok"]
    by = {}
    for r in rows:
        by.setdefault(r["row"], []).append(r)
    assert set(by) == {"peak", "dino", "e2e", "torchrun", "inference", "knn", "linear", "aug", "loader"}
    assert report["meta"]["torch"] == torch.__version__ and report["meta"]["date"]
    assert by["peak"][0]["tflops"] > 0 and by["peak"][1]["impl"] == "device-to-device copy"
    assert by["peak"][1]["tb_per_s"] > 0

    dino = by["dino"]
    assert {(r["strategy"], r["impl"]) for r in dino} == {
        (s, i) for s in ("resize", "interpolate", "subgrid", "none")
        for i in ("ours eager", "ours fused eager", "reference")}
    for r in dino:
        assert r["images_per_s"] > 0 and r["crops_per_s"] > r["images_per_s"] and r["gflop_per_image"] > 0
        if r["impl"] != "reference":
            assert r["vs_ref"] > 0 and r["vs_ref_resize"] > 0
    assert {r["crops"] for r in dino if r["strategy"] == "subgrid"} == {"2x32+2x16"}
    assert {r["crops"] for r in dino if r["strategy"] == "none"} == {"2x32"}

    e2e = {r["path"]: r for r in by["e2e"]}
    assert set(e2e) == {"write JPEGs", "synthetic input", "CPU augmentation in workers", "GpuMultiCrop on cpu"}
    for path in ("CPU augmentation in workers", "GpuMultiCrop on cpu"):
        assert e2e[path]["images_per_s"] > 0 and e2e[path]["loader_only_images_per_s"] > 0
        assert e2e[path]["vs_synthetic"] == pytest.approx(e2e[path]["images_per_s"]
                                                          / e2e["synthetic input"]["images_per_s"])
    assert e2e["write JPEGs"]["image"] == "64x48 q90"   # the profile's real-size shape (tiny here)

    # the same step in this process and in a one-process torchrun job (gloo on a CPU)
    run = {r["path"]: r for r in by["torchrun"]}
    one, job = run["one process"], run["torchrun --standalone --nproc_per_node 1"]
    assert job["backend"] == "gloo" and job["world_size"] == 1 and job["crops"] == one["crops"] == "2x32+2x16"
    assert job["vs_one_process"] == pytest.approx(job["images_per_s"] / one["images_per_s"])

    inf = {r["impl"]: r for r in by["inference"]}
    assert inf["check: folded ours = timm (fp32)"]["rel_err"] < 1e-4
    for impl in ("timm eager", "ours eager", "ours folded eager"):
        assert inf[impl]["images_per_s"] > 0 and inf[impl]["vs_timm_eager"] > 0

    knn = {r["backend"]: r for r in by["knn"]}
    assert set(knn) == {"torch", "torch-raw", *(["faiss-cpu"] if has_faiss else [])}
    assert all(r["seconds"] > 0 and r["queries"] == 50 for r in knn.values())
    assert knn["torch"]["top1"] > 20  # chance is 20
    if has_faiss:
        assert knn["torch"]["top1"] == knn["faiss-cpu"]["top1"]  # the same exact neighbours
    assert [r["protocol"] for r in by["linear"]] == ["lbfgs", "dino"]   # tests below: what they hold

    aug = {r["impl"]: r for r in by["aug"]}
    assert len(aug) == 5 and all(r["images_per_s"] > 0 for r in aug.values())
    assert all(r["vs_lightly"] > 0 for name, r in aug.items() if name != "lightly DINOTransform" and r["crops"] != "-")
    loader = [r for r in by["loader"] if r["impl"] != "write JPEGs"]
    assert len(loader) == 5 and all(r["images_per_s"] > 0 and r["per_core"] for r in loader)
    assert sum(r.get("vs_reference") is not None for r in loader) == 3
    assert report["summary"] and all(s["value"] is not None for s in report["summary"])
    assert any(s["what"].startswith("loader side per CPU core") for s in report["summary"])


@pytest.mark.parametrize("strategy,backbone", [("resize", "timm"), ("subgrid", "ours")])
def test_reference_step_and_ours_compute_the_same_step(strategy, backbone):
    """Same weights (timm's ResMLP loaded into ours where the reference uses timm's), same
    crops, fp32: the same losses, and the same student, teacher and center after three
    steps (the later ones see the optimizer state and the EMA): our fused clipping, fused
    EMA, on-device bookkeeping and fp32 head compute what DINO's loops compute."""
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    cfg = S.dino_config(tiny_profile(), "resmlp_s12", strategy, ["model.drop_path_rate=0.0"])
    plan = crop_plan(cfg)
    ours = S.build_our_step(cfg, cpu, "fp32", compile=False)
    student, teacher = build_reference_networks(cfg, plan, cpu, backbone)
    ref = RefDinoStep(student, teacher, cfg.dino.out_dim, plan.n_crops, cpu, fp16=False)
    if backbone == "timm":
        load_pretrained(ours.student.backbone, student.backbone.state_dict())
    else:
        ours.student.backbone.load_state_dict(student.backbone.state_dict())
    ours.student.head.load_state_dict(student.head.state_dict())
    ours.teacher.load_state_dict(ours.student.state_dict())
    for seed in range(3):
        crops = S.synthetic_crops(plan, 4, cpu, seed=seed)
        loss_ours = S.call_step(ours, crops)
        loss_ref = S.call_step(ref, crops)
        assert torch.allclose(loss_ours, loss_ref, rtol=1e-5, atol=1e-6), seed
    assert torch.allclose(ours.loss_fn.center.reshape(-1), ref.loss_fn.center.reshape(-1), atol=1e-6)
    for mine, theirs in ((ours.teacher, teacher), (ours.student, student)):
        want = convert_state_dict(theirs.backbone.state_dict())
        got = mine.backbone.state_dict()
        assert set(want) == set(got)
        for key in got:
            assert torch.allclose(got[key], want[key], atol=1e-5), key
        for a, b in zip(mine.head.parameters(), theirs.head.parameters()):
            assert torch.allclose(a, b, atol=1e-5)


def test_the_fused_knob_crosses_every_line_of_ours(monkeypatch):
    """bench.<profile>.fused: each of ours' lines (eager, compiled, graphed) for each value,
    at the profile's batch and the largest one, labelled "ours fused ..." where true and as
    before where false; the reference and the batch search once; the search with the plain
    step (the larger one), and each line's step built with its own model.fused."""
    p = bench_profile("tiny", ["bench.tiny.compile=[false,true]", "bench.tiny.graphs=[eager,compile]",
                               "bench.tiny.largest_batch=true", "bench.tiny.strategies=[subgrid]",
                               "bench.tiny.interleave=false"])
    built = []
    monkeypatch.setattr(D, "_dino_ours", lambda ctx, model, strategy, batch, comp, flops, graphs=False, fused=False:
                        built.append((bool(comp), graphs, fused, batch)) or {"images_per_s": 1.0})
    monkeypatch.setattr(D, "_dino_reference", lambda *a: {"images_per_s": 1.0})
    monkeypatch.setattr(D, "build_our_step", lambda cfg, *a, **k: built.append(("search", cfg.model.fused)))
    monkeypatch.setattr(D, "synthetic_crops", lambda plan, batch, dev: [])
    monkeypatch.setattr(D, "call_step", lambda step, crops: None)
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    D.dino_family(ctx)
    lines = [(r["impl"], r["batch"]) for r in ctx.results if r["impl"] != "largest batch search"]
    kinds = ("eager", "compile", "eager+graphs", "compile+graphs")
    want = [(f"ours {f}{k}", b) for b in (4, 8) for f in ("", "fused ") for k in kinds]
    assert sorted(lines) == sorted(want + [("reference", 4), ("reference", 8)])
    assert built[0] == ("search", False) and ctx.results[0]["batch"] == 8  # the profile's max_batch
    assert sorted(built[1:]) == sorted((c, g, f, b) for b in (4, 8) for f in (False, True)
                                       for c, g in ((False, False), (True, False), (False, True), (True, True)))


def test_compiled_step_equals_eager():
    """torch.compile (what the trainer and bench run on a GPU; inductor on the CPU here)
    gives the same two steps as eager: loss, center, teacher; subgrid exercises the grid
    adaptation of the cross-patch weights inside the compiled graph. Compiled as the
    trainer compiles (core/compiling.py): one block, reused across the depth, once per kind
    of call (3 graphs: the whole networks would be 2, the blocks one by one 3 x depth),
    the heads (2: student, teacher) and the loss's cross-entropy and centered softmax (1
    each), the networks keeping their state_dict keys."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    cfg = S.dino_config(tiny_profile(), "resmlp_s12", "subgrid", ["model.drop_path_rate=0.0"])
    plan = crop_plan(cfg)
    steps = {c: S.build_our_step(cfg, cpu, "fp32", compile=c) for c in (False, True)}
    steps[True].student.load_state_dict(steps[False].student.state_dict())
    steps[True].teacher.load_state_dict(steps[False].teacher.state_dict())
    crops = S.synthetic_crops(plan, 4, cpu)
    torch._dynamo.reset()
    counters.clear()
    try:
        for _ in range(2):  # the second step sees the first one's optimizer state and EMA
            losses = {c: S.call_step(step, [x.clone() for x in crops]) for c, step in steps.items()}
            assert torch.allclose(losses[True], losses[False], rtol=1e-4, atol=1e-5)
        assert counters["stats"]["unique_graphs"] == 3 + 2 + 2 and cfg.model.depth == 2
    finally:
        torch._dynamo.reset()
    for net in ("student", "teacher"):
        assert list(getattr(steps[True], net).state_dict()) == list(getattr(steps[False], net).state_dict())
    assert torch.allclose(steps[True].loss_fn.center, steps[False].loss_fn.center, atol=1e-5)
    eager = steps[False].teacher.state_dict()
    for key, value in steps[True].teacher.state_dict().items():
        assert torch.allclose(value, eager[key], atol=1e-4), key


def test_the_knn_row_times_a_baseline_alternated_and_the_pass_alone(tmp_path, capsys):
    """knn.baseline: another knn_search.py timed against ours in alternating repeats, in a
    process of its own, with a check that both give the same votes; torch-fp16 runs the pass
    in float16 on this device (the baseline too, where its knn_search takes pass_dtype, else
    no baseline at that dtype); torch-pass times the candidate pass by its spans. A baseline
    that is not a file: one line, exit 2, nothing written."""
    import shutil
    import sys
    from pathlib import Path

    import resmlp.eval.knn_search as ours
    base = tmp_path / "knn_before.py"
    shutil.copy(ours.__file__, base)
    out = tmp_path / "bench"
    assert main(["bench.profile=tiny", f"out={out}", "bench.rows=[knn]", f"bench.tiny.knn.baseline={base}",
                 "bench.tiny.knn.backends=[torch,torch-fp16,torch-pass]"]) == 0
    knn = {r["backend"]: r for r in json.loads((out / "bench.json").read_text())["rows"] if r["row"] == "knn"}
    for backend in ("torch", "torch-fp16"):
        r = knn[backend]
        assert r["status"] == "ok" and r["same_as_baseline"] is True and r["baseline"] == str(base), r
        assert len(r["repeats"]) == len(r["baseline_repeats"]) == 2 and r["vs_baseline"] > 0
    assert knn["torch-fp16"]["pass_dtype"] == "float16" and "pass_dtype" not in knn["torch"]
    assert knn["torch-pass"]["status"] == "ok" and "30 candidates in its first round" in knn["torch-pass"]["note"]
    assert 0 < knn["torch-pass"]["matmul_s"] <= knn["torch-pass"]["maxima_s"] <= knn["torch-pass"]["seconds"]
    assert "knn_search_baseline" not in sys.modules   # the baseline ran in its own process
    # a baseline from before knn_search's pass_dtype: timed at its own dtype only
    old = tmp_path / "knn_older.py"
    old.write_text(base.read_text().replace("pass_dtype: torch.dtype | None = None) ->", ") ->")
                   .replace("_TorchSearch(train, dev, budget, pass_dtype)", "_TorchSearch(train, dev, budget)"))
    out = tmp_path / "older"
    assert main(["bench.profile=tiny", f"out={out}", "bench.rows=[knn]", f"bench.tiny.knn.baseline={old}",
                 "bench.tiny.knn.backends=[torch,torch-fp16]"]) == 0
    knn = {r["backend"]: r for r in json.loads((out / "bench.json").read_text())["rows"] if r["row"] == "knn"}
    assert knn["torch"]["same_as_baseline"] is True and "vs_baseline" not in knn["torch-fp16"]
    assert "takes no pass_dtype" in knn["torch-fp16"]["baseline_note"]
    capsys.readouterr()
    missing = tmp_path / "missing"
    assert main(["bench.profile=tiny", f"out={missing}", "bench.rows=[knn]",
                 f"bench.tiny.knn.baseline={tmp_path / 'nope.py'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "knn.baseline" in err[0] and "no such file" in err[0]
    assert not Path(missing).exists()


def test_the_linear_row_times_the_linear_commands_default_and_dinos_protocol(tmp_path, capsys):
    """The lbfgs line is the `linear` command's default probe on the row's features, whole
    (every L2 of configs/method/linear.yaml's grid, the held-out part, the refit), its time
    split into the selection and the refit, its passes counted; the dino line times a few of
    DINO's epochs and counts the rest at the last one's time. The features are seeded and
    scaled per dimension. A protocol the row has not: one line, exit 2."""
    from bench import linear as L
    from resmlp.eval.linear import default_probe, probe_cached
    out = tmp_path / "bench"
    assert main(["bench.profile=tiny", f"out={out}", "bench.rows=[linear]"]) == 0
    report = json.loads((out / "bench.json").read_text())
    lines = {r["protocol"]: r for r in report["rows"] if r["row"] == "linear"}
    probe, p = default_probe(), tiny_profile().linear
    lb = lines["lbfgs"]
    assert (lb["status"], lb["n_train"], lb["dim"], lb["classes"]) == ("ok", p.n_train, p.dim, p.classes)
    assert [r["l2"] for r in lb["per_l2"]] == sorted(probe.l2) and lb["l2"] in probe.l2
    assert lb["l2s"] == sum("skipped" not in r for r in lb["per_l2"]) >= 1
    assert 0 < lb["selection_s"] < lb["seconds"] and lb["refit_s"] == pytest.approx(lb["seconds"] - lb["selection_s"])
    tried = [r for r in lb["per_l2"] if "skipped" not in r]
    assert lb["iterations"] == sum(r["iterations"] for r in tried) + lb["refit_iterations"] < lb["passes"]
    assert lb["converged"] is True and lb["top1"] > 100 / p.classes
    # the command's own probe on the same features chooses the same L2 and scores the same
    features = L.linear_features(p)
    res = probe_cached(*features, probe, seed=0, device="cpu")
    assert (res["l2"], res["top1"]) == (lb["l2"], lb["top1"])
    dino = lines["dino"]
    assert (dino["status"], dino["epochs"], dino["epochs_full"]) == ("ok", p.dino_epochs, probe.epochs)
    assert dino["seconds_full"] == pytest.approx(dino["seconds"] + (probe.epochs - p.dino_epochs) * dino["epoch_s"])
    assert dino["lrs"] == len(probe.lrs) and "not the protocol's" in dino["note"]
    assert any(s["what"].startswith("linear probe (lbfgs, the default)") for s in report["summary"])
    assert "== linear: " in capsys.readouterr().out
    # seeded, every dimension at its own scale (the probe standardizes them)
    again = L.linear_features(p)
    assert all(torch.equal(a, b) for a, b in zip(features[:4], again[:4]))
    spread = features[0].std(0)
    assert spread.max() / spread.min() > 10
    never = tmp_path / "never"
    assert main(["bench.profile=tiny", f"out={never}", "bench.rows=[linear]", "bench.tiny.linear.protocols=[sgd]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bench.tiny.linear.protocols" in err[0] and "lbfgs, dino" in err[0], err
    assert main(["bench.profile=tiny", f"out={never}", "bench.rows=[linear]", "bench.tiny.linear.dino_epochs=1"]) == 2
    assert "bench.tiny.linear.dino_epochs" in capsys.readouterr().err and not never.exists()


def test_a_failing_line_is_reported_and_the_rest_go_on():
    ctx = Context(torch.device("cpu"), "tiny", tiny_profile(), ["resmlp_s12"], False)
    ctx.attempt("knn", {"backend": "broken"}, lambda: 1 / 0)
    ctx.attempt("knn", {"backend": "absent"}, lambda: (_ for _ in ()).throw(S.Skip("not installed")))
    ctx.attempt("knn", {"backend": "fine"}, lambda: {"seconds": 0.5, "queries": 10})
    assert [r["status"] for r in ctx.results] == ["error", "skipped", "ok"]
    meta = {"cpu": "cpu", "cpu_cores": 2, "torch_threads": 1, "load_average": [0.0], "torch": "x", "date": "d"}
    text = render(ctx.results, [], meta, "tiny")
    assert "ERROR: ZeroDivisionError" in text and "SKIPPED: not installed" in text and "0.500" in text


def test_a_stop_signal_inside_a_line_leaves_it_for_the_next_run_not_failed():
    """The campaign's SIGTERM at a window's end reaches the bench inside a k-NN line, whose
    search ends between two batches (preempt.stop_between_batches): that line was not
    measured, and bench.resume measures it next, as one the signal came before."""
    from resmlp.core import preempt
    from resmlp.eval.knn import knn_classify
    ctx = Context(torch.device("cpu"), "tiny", tiny_profile(), ["resmlp_s12"], False)
    train, labels = torch.randn(64, 8), torch.randint(3, (64,))

    def signalled_line():
        signal.raise_signal(signal.SIGTERM)
        return {"seconds": knn_classify(train, labels, torch.randn(4, 8), 3, k=5, temperature=0.07).sum().item()}
    with preempt.watch():
        row = ctx.attempt("knn", {"backend": "torch"}, signalled_line)
    assert (row["status"], row["left"], ctx.left) == ("skipped", True, 1), row
    assert row["reason"] == "stopped by SIGTERM during this line"


def test_each_line_reports_its_own_peak_memory(monkeypatch):
    """A line's mem_gb is the peak of that line alone: the peak counter is reset before each
    line (the knn line of 2026-11-27 read the DINO line's 57.62 GB). A fake CUDA allocator,
    so that the reset path runs without a GPU."""
    gb = 2**30
    mem = {"now": 0, "peak": 0, "resets": 0}

    def allocate(n_gb):   # what a line holds at its peak, freed when it ends
        mem["peak"] = max(mem["peak"], mem["now"] + n_gb * gb)

    def reset(device=None):
        mem["peak"], mem["resets"] = mem["now"], mem["resets"] + 1
    for name, fn in (("synchronize", lambda device=None: None), ("empty_cache", lambda: None),
                     ("reset_peak_memory_stats", reset), ("max_memory_allocated", lambda device=None: mem["peak"])):
        monkeypatch.setattr(torch.cuda, name, fn)
    ctx = Context(torch.device("cuda"), "tiny", tiny_profile(), ["resmlp_s12"], False)

    def line(n_gb):
        def fn():
            allocate(n_gb)
            return {"mem_gb": peak_memory_gb(ctx.device)}
        return fn
    ctx.attempt("dino", {"impl": "reference", "batch": 512}, line(57.6))
    ctx.attempt("knn", {"backend": "torch-device"}, line(3.5))
    ctx.attempt("knn", {"backend": "broken"}, lambda: 1 / 0)
    ctx.attempt("knn", {"backend": "small"}, line(0.5))
    assert [r.get("mem_gb") for r in ctx.results] == [pytest.approx(57.6), pytest.approx(3.5), None,
                                                      pytest.approx(0.5)]
    assert mem["resets"] >= 4   # before every line (and after the failed one)


def test_the_knn_profile_times_the_bench_knn_by_phase(tmp_path, capsys):
    """`python -m bench.profile profile.phases=knn`: the bench's knn row at a bench
    profile's sizes, timed whole and by phase, its votes unchanged by the clock; bad values
    of its keys: one line, exit 2, nothing written."""
    from bench import profile
    out = tmp_path / "prof"
    assert profile.main(["profile.phases=knn", "profile.knn=tiny", "profile.steps=2", f"profile.out={out}"]) == 0
    report = json.loads((out / "profile.json").read_text())
    knn = report["knn"]
    assert report["config"] is None and report["phases"] == {} and "kernels_knn" not in report   # no GPU here
    assert (knn["n_train"], knn["dim"], knn["queries"], knn["k"], knn["device"]) == (500, 16, 50, 20, "cpu")
    assert knn["same_votes"] is True and knn["top1"] > 100 / 5 and len(knn["repeats"]) == 2
    assert knn["rounds"][0] == {"candidates": 30, "queries": 50, "chunk": 4096}
    assert list(knn["phases"]) == ["inputs: copy, checks", "bank: norms, unit rows", "queries: gather",
                                   "queries: norms, unit rows", "pass: matmul", "pass: block maxima, merge",
                                   "re-rank", "check, scatter", "round's count (host sync)", "vote", "copy back"]
    assert 0 < sum(v["device_ms"] for v in knn["phases"].values()) <= 1e3 * knn["phased_s"]
    printed = capsys.readouterr().out
    assert "knn 500 x 16, 50 queries, k=20, float32 pass on cpu" in printed and "pass: matmul" in printed
    for bad, says in (("profile.phases=knn,stp", "profile: profile.phases=['knn', 'stp'] is not allowed: each of "
                                                 "profile.phases must be one of loader, augment, step, knn"),
                      ("profile.knn=huge", "profile: profile.knn=huge is not allowed: profile.knn must be one of "
                                           "auto, gpu, cpu, tiny")):
        never = tmp_path / "never"
        args = ["profile.phases=knn", bad, f"profile.out={never}"] if "knn=" in bad else [bad, f"profile.out={never}"]
        assert profile.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(says), err
        assert not never.exists()


def test_lines_needing_an_absent_package_are_skipped(monkeypatch):
    """The GPU image lacks lightly and faiss: their lines say SKIPPED, not ERROR."""
    monkeypatch.setitem(__import__("sys").modules, "lightly", None)
    monkeypatch.setitem(__import__("sys").modules, "faiss", None)
    ctx = Context(torch.device("cpu"), "tiny", tiny_profile(), ["resmlp_s12"], False)
    labels = torch.zeros(50, dtype=torch.long)
    data = (torch.randn(50, 8), labels, torch.randn(5, 8), labels[:5], 2)
    ctx.attempt("dino", {"impl": "ours"}, S.need_lightly)
    ctx.attempt("knn", {"backend": "faiss-cpu"}, lambda: K._knn_one(ctx, "faiss-cpu", data))
    ctx.attempt("knn", {"backend": "torch"}, lambda: K._knn_one(ctx, "torch", data))
    assert [r["status"] for r in ctx.results] == ["skipped", "skipped", "ok"]


def test_compile_cost_times_each_mode_in_a_fresh_process(tmp_path, capsys):
    """tools/bench/compile_cost.py's plumbing (the eager mode: compiling is what costs minutes
    here; tests/test_compiling.py checks what compile=true compiles), and its one-line
    refusal of an unknown mode."""
    from bench import compile_cost
    tiny = ["model.dim=16", "model.depth=2", "batch_size=2", "dino.out_dim=64", "dino.hidden_dim=32",
            "dino.bottleneck_dim=16", "device=cpu"]
    out = tmp_path / "cost.json"
    assert compile_cost.main([*tiny, "--modes", "eager", "--steps", "2", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())
    assert r["mode"] == "eager" and r["graphs"] == 0 and r["batch"] == 2 and r["crops"] == "2x32+8x16"
    assert len(r["seconds"]) == 3 and all(s > 0 for s in r["seconds"])
    assert compile_cost.main([*tiny, "--modes", "eager", "--interleave", "2", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())) == ["eager"] and len(json.loads(out.read_text())["eager"]) == 2
    assert compile_cost.main(["--modes", "eager,fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compile_cost: --modes fast is not one of eager, whole, regional, warm"]


# ---- the whole profile: every kernel in its class, each class against its floor --------------------

H100_27 = Path(__file__).resolve().parent.parent / "docs" / "bench" / "h100-2026-11-27"
# How the kernels of the 2026-11-27 H100 profile (their names as summary.json keeps them) are to be
# classed: the first marker in a name decides (the rules, written out here by hand).
MARKERS = (("nvjet", "GEMM"), ("triton_poi", "elementwise"), ("triton_red", "reduction"), ("direct_copy", "copy"),
           ("bfloat16_copy", "copy"), ("reduce_kernel", "reduction"), ("elementwise_kernel", "elementwise"))


def recorded_profile(which: str) -> list[dict]:
    """The 2026-11-27 preset step's profile (its top 15 kernels, per step) from the report."""
    summary = json.loads((H100_27 / "summary.json").read_text())
    stage = next(s for s in summary["stages"] if s["name"] == "profile_preset")
    return stage["profile"][which]["top"]


@pytest.mark.parametrize("which, counts", [
    ("kernels_compiled", {"GEMM": 6, "elementwise": 6, "reduction": 3}),
    ("kernels_eager", {"GEMM": 3, "elementwise": 7, "copy": 3, "reduction": 2})])
def test_the_recorded_kernels_of_a_real_profile_fall_into_their_classes(which, counts):
    from bench import kernel_classes as KC
    top = recorded_profile(which)
    for k in top:
        want = next(cls for marker, cls in MARKERS if marker in k["name"])
        assert KC.kernel_class(k["name"]) == want, k["name"]
    found = {}
    for k in top:
        found[KC.kernel_class(k["name"])] = found.get(KC.kernel_class(k["name"]), 0) + 1
    assert found == counts
    # the classes' times are their kernels' (each recorded kernel as `count` launches of one step)
    launches = [{"name": k["name"], "us": 1e3 * k["ms_per_call"] / k["count"], "bytes": None}
                for k in top for _ in range(k["count"])]
    classes = KC.classes(launches, 1, None, None, None)
    for cls in counts:
        assert classes[cls]["ms"] == pytest.approx(sum(k["ms_per_call"] for k in top
                                                       if KC.kernel_class(k["name"]) == cls))
        assert classes[cls]["kernels"] == sum(k["count"] for k in top if KC.kernel_class(k["name"]) == cls)
        assert classes[cls]["floor_ms"] is None and classes[cls]["unknown_bytes_ms"] == pytest.approx(
            classes[cls]["ms"])   # no rate, no bytes: no floor claimed
    assert classes["all"]["ms"] == pytest.approx(sum(k["ms_per_call"] for k in top))
    assert classes["other"]["ms"] == 0 and sum(c["share"] for c in map(classes.get, KC.CLASSES)) == pytest.approx(1)


def test_each_class_is_held_against_its_floor_at_the_measured_rates():
    """The 2026-11-27 figures: the compiled preset step's 13.50 TFLOP of matmuls (gpu_step_budget.md)
    at that run's measured 720.4 TFLOP/s, and its GELU backward (24 launches of 0.2145 ms, each
    reading dh and u and writing du: 604 MB) at 3.35 TB/s: 18.7 ms, and 84% of HBM."""
    from bench import kernel_classes as KC
    bench = json.loads((H100_27 / "bench.json").read_text())
    tflops = next(r["tflops"] for r in bench["rows"] if r["row"] == "peak")
    gelu = next(k for k in recorded_profile("kernels_compiled") if k["name"].startswith("triton_poi_fused_gelu_gelu"))
    gemm = next(k for k in recorded_profile("kernels_compiled") if k["name"].startswith("nvjet"))
    launches = [*([{"name": gelu["name"], "us": 214.5, "bytes": 604_000_000}] * gelu["count"]),
                *([{"name": gemm["name"], "us": 138.0, "bytes": 0}] * gemm["count"]),
                {"name": "triton_poi_unknown_bytes", "us": 10.0, "bytes": None}]
    c = KC.classes(launches, 1, 13.50e12, tflops, 3.35)
    assert c["GEMM"]["floor_ms"] == pytest.approx(1e3 * 13.50e12 / (tflops * 1e12)) == pytest.approx(18.74, abs=0.01)
    assert c["GEMM"]["of_floor"] == pytest.approx(c["GEMM"]["floor_ms"] / (36 * 0.138))
    e = c["elementwise"]
    assert e["gb"] == pytest.approx(24 * 0.604) and e["unknown_bytes_ms"] == pytest.approx(0.01)
    assert e["floor_ms"] == pytest.approx(1e3 * 24 * 0.604e9 / 3.35e12)
    assert e["of_floor"] == pytest.approx(e["floor_ms"] / (24 * 0.2145 + 0.01)) and 0.83 < e["of_floor"] < 0.85
    assert c["other"]["floor_ms"] is None and c["all"]["floor_ms"] == pytest.approx(c["GEMM"]["floor_ms"]
                                                                                   + e["floor_ms"])
    text = "\n".join(KC.table(c))
    assert "13500.0 GFLOP" in text and "14.5 GB+?" in text


def test_a_gpu_kernels_bytes_are_its_launching_ops_arguments():
    """torch's profiler events as a GPU profile gives them: an op with its arguments' shapes and
    dtypes and the device kernels it launched; the op's bytes go to its longest kernel."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from bench import kernel_classes as KC
    fused = FunctionEvent(id=1, name="triton_poi_fused_add_0", thread=0, start_us=0, end_us=9,
                          input_shapes=[[512, 384], [512, 384], [384], []],
                          input_dtypes=["c10::BFloat16", "float", "float", "Scalar"])
    fused.append_kernel("triton_poi_fused_add_0", 0, 7.0)
    mm = FunctionEvent(id=2, name="aten::mm", thread=0, start_us=10, end_us=20, input_shapes=[[512, 384], [384, 1536]],
                       input_dtypes=["c10::BFloat16", "c10::BFloat16"])
    mm.append_kernel("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN", 0, 20.0)
    mm.append_kernel("splitKreduce_kernel", 0, 2.0)
    cat = FunctionEvent(id=3, name="aten::cat", thread=0, start_us=30, end_us=31, input_shapes=[[], []],
                        input_dtypes=["TensorList", "Scalar"])
    cat.append_kernel("CatArrayBatchedCopy_contig", 0, 3.0)
    device_side = FunctionEvent(id=4, name="nvjet_x", thread=0, start_us=10, end_us=20, device_type=DeviceType.CUDA)
    found = KC.kernels_of([fused, mm, cat, device_side], "cuda")
    assert found == [{"name": "triton_poi_fused_add_0", "us": 7.0, "bytes": 512 * 384 * (2 + 4) + 384 * 4},
                     {"name": "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN", "us": 20.0,
                      "bytes": 2 * (512 * 384 + 384 * 1536)},
                     {"name": "splitKreduce_kernel", "us": 2.0, "bytes": 0},
                     {"name": "CatArrayBatchedCopy_contig", "us": 3.0, "bytes": None}]
    assert [KC.kernel_class(k["name"]) for k in found] == ["elementwise", "GEMM", "GEMM", "copy"]


def test_a_cpu_profile_classes_the_ops_and_counts_their_bytes():
    """torch.profiler on this CPU, over ops of known sizes: each op's own time is a "kernel"
    of its class, with the bytes of its arguments."""
    from torch.profiler import ProfilerActivity, profile

    from bench import kernel_classes as KC
    a, b = torch.randn(256, 128), torch.randn(128, 64)
    x = torch.randn(64, 100, dtype=torch.bfloat16)

    def work():
        with torch.no_grad():
            (a @ b).sum()
            torch.nn.functional.gelu(x)
            torch.cat([x, x])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            work()
    found = KC.kernels_of(prof.events(), "cpu")
    ops = {k["name"]: k for k in KC.by_name(found, 3)}
    assert ops["aten::mm"]["class"] == "GEMM" and ops["aten::mm"]["gb_per_call"] * 1e9 == 4 * (256 * 128 + 128 * 64)
    assert ops["aten::gelu"]["class"] == "elementwise" and ops["aten::gelu"]["gb_per_call"] * 1e9 == 2 * 6400
    assert ops["aten::sum"]["class"] == "reduction" and ops["aten::sum"]["gb_per_call"] * 1e9 == 4 * 256 * 64
    assert ops["aten::cat"]["class"] == "copy" and ops["aten::cat"]["gb_per_call"] is None   # a TensorList
    assert all(k["count"] == 1 for k in ops.values() if k["name"] in ("aten::mm", "aten::gelu", "aten::cat"))
    c = KC.classes(found, 3, 2 * 256 * 128 * 64, 0.01, 0.001)
    assert c["GEMM"]["floor_ms"] == pytest.approx(1e3 * 2 * 256 * 128 * 64 / 1e10)
    assert c["copy"]["unknown_bytes_ms"] > 0 and c["all"]["ms"] == pytest.approx(sum(k["us"] for k in found) / 3e3)


def test_the_step_profile_keeps_every_kernel_by_class(tmp_path):
    """tools/bench/profile.py on a tiny step on this CPU: the rates measured first, then the eager
    step's every op in its class against its floor, in profile.json."""
    from bench import profile
    out = tmp_path / "prof"
    tiny = ["device=cpu", "model.dim=16", "model.depth=2", "dino.out_dim=64", "dino.hidden_dim=32",
            "dino.bottleneck_dim=16", "dino.n_local_crops=2", "data.img_size=32", "model.patch_size=8",
            "data.local_size=16", "batch_size=4"]
    assert profile.main([*tiny, "profile.phases=step", "profile.steps=1", f"profile.out={out}"]) == 0
    report = json.loads((out / "profile.json").read_text())
    assert report["rates"]["matmul"]["tflops"] > 0 and report["rates"]["copy"]["tb_per_s"] > 0
    k = report["kernels_eager"]
    assert "kernels_compiled" not in report   # compile=false here
    assert len(k["top"]) == k["kernel_names"] > 20   # profile.top=null: every one kept
    assert {x["class"] for x in k["top"]} >= {"GEMM", "elementwise", "reduction", "copy", "other"}
    assert sum(k["classes"][c]["ms"] for c in ("GEMM", "elementwise", "reduction", "copy", "other")) == \
        pytest.approx(k["busy_ms"]) == pytest.approx(sum(x["ms_per_call"] for x in k["top"]))
    assert k["flops_per_call"] > 0 and k["classes"]["GEMM"]["floor_ms"] == pytest.approx(
        1e3 * k["flops_per_call"] / (report["rates"]["matmul"]["tflops"] * 1e12))
    assert profile.main([*tiny, "profile.phases=step", "profile.top=3", f"profile.out={out}"]) == 0
    assert len(json.loads((out / "profile.json").read_text())["kernels_eager"]["top"]) == 3


def test_the_torchrun_row_runs_the_step_module_in_a_one_process_job(tmp_path):
    from bench.torchrun_step import torchrun_argv
    argv = torchrun_argv(tmp_path / "spec.json", tmp_path / "out.json", python="python3")
    assert argv == ["python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "-m", "bench.torchrun_step", str(tmp_path / "spec.json"), str(tmp_path / "out.json")]
