"""The benchmark: the tiny profile runs every row on the CPU, and the two DINO steps it
compares compute the same thing (so the speed ratio compares like with like)."""
import importlib.util
import json

import pytest
import torch

from resmlp.bench import rows as R
from resmlp.bench.bench import Context, render
from resmlp.bench.reference import RefDinoStep, build_reference_networks
from resmlp.core.cli import main
from resmlp.core.config import load_config
from resmlp.models import convert_state_dict, load_pretrained
from resmlp.data.crop_plan import crop_plan


def tiny_profile():
    return load_config("bench", "resmlp_s12", ["bench.profile=tiny"]).bench.tiny


def test_tiny_profile_measures_every_row(tmp_path):
    assert main(["bench", "bench.profile=tiny", f"out={tmp_path}"]) == 0
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
    assert set(by) == {"peak", "dino", "e2e", "inference", "knn", "aug", "loader"}
    assert report["meta"]["torch"] == torch.__version__ and report["meta"]["date"]
    assert by["peak"][0]["tflops"] > 0

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
        assert e2e[path]["vs_synthetic"] > 0

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
    cfg = R.dino_config(tiny_profile(), "resmlp_s12", strategy, ["model.drop_path_rate=0.0"])
    plan = crop_plan(cfg)
    ours = R.build_our_step(cfg, cpu, "fp32", compile=False)
    student, teacher = build_reference_networks(cfg, plan, cpu, backbone)
    ref = RefDinoStep(student, teacher, cfg.dino.out_dim, plan.n_crops, cpu, fp16=False)
    if backbone == "timm":
        load_pretrained(ours.student.backbone, student.backbone.state_dict())
    else:
        ours.student.backbone.load_state_dict(student.backbone.state_dict())
    ours.student.head.load_state_dict(student.head.state_dict())
    ours.teacher.load_state_dict(ours.student.state_dict())
    for seed in range(3):
        crops = R.synthetic_crops(plan, 4, cpu, seed=seed)
        loss_ours = R.call_step(ours, crops)
        loss_ref = R.call_step(ref, crops)
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
    p = load_config("bench", "resmlp_s12", ["bench.profile=tiny", "bench.tiny.compile=[false,true]",
                                           "bench.tiny.graphs=[eager,compile]", "bench.tiny.largest_batch=true",
                                           "bench.tiny.strategies=[subgrid]", "bench.tiny.interleave=false"]).bench.tiny
    built = []
    monkeypatch.setattr(R, "_dino_ours", lambda ctx, model, strategy, batch, comp, flops, graphs=False, fused=False:
                        built.append((bool(comp), graphs, fused, batch)) or {"images_per_s": 1.0})
    monkeypatch.setattr(R, "_dino_reference", lambda *a: {"images_per_s": 1.0})
    monkeypatch.setattr(R, "build_our_step", lambda cfg, *a, **k: built.append(("search", cfg.model.fused)))
    monkeypatch.setattr(R, "synthetic_crops", lambda plan, batch, dev: [])
    monkeypatch.setattr(R, "call_step", lambda step, crops: None)
    ctx = Context(torch.device("cpu"), "tiny", p, ["resmlp_s12"], False)
    R.dino_family(ctx)
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
    cfg = R.dino_config(tiny_profile(), "resmlp_s12", "subgrid", ["model.drop_path_rate=0.0"])
    plan = crop_plan(cfg)
    steps = {c: R.build_our_step(cfg, cpu, "fp32", compile=c) for c in (False, True)}
    steps[True].student.load_state_dict(steps[False].student.state_dict())
    steps[True].teacher.load_state_dict(steps[False].teacher.state_dict())
    crops = R.synthetic_crops(plan, 4, cpu)
    torch._dynamo.reset()
    counters.clear()
    try:
        for _ in range(2):  # the second step sees the first one's optimizer state and EMA
            losses = {c: R.call_step(step, [x.clone() for x in crops]) for c, step in steps.items()}
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
    """knn.baseline: another knn_search.py timed against ours in alternating repeats, with
    a check that both give the same votes; torch-fp16 runs the pass in float16 on this
    device; torch-pass times the candidate pass alone. A baseline that is not a file: one
    line, exit 2, nothing written."""
    import shutil
    from pathlib import Path

    import resmlp.eval.knn_search as ours
    base = tmp_path / "knn_before.py"
    shutil.copy(ours.__file__, base)
    out = tmp_path / "bench"
    assert main(["bench", "bench.profile=tiny", f"out={out}", "bench.rows=[knn]", f"bench.tiny.knn.baseline={base}",
                 "bench.tiny.knn.backends=[torch,torch-fp16,torch-pass]"]) == 0
    knn = {r["backend"]: r for r in json.loads((out / "bench.json").read_text())["rows"] if r["row"] == "knn"}
    for backend in ("torch", "torch-fp16"):
        r = knn[backend]
        assert r["status"] == "ok" and r["same_as_baseline"] is True and r["baseline"] == str(base), r
        assert len(r["repeats"]) == len(r["baseline_repeats"]) == 2 and r["vs_baseline"] > 0
    assert knn["torch-fp16"]["pass_dtype"] == "float16" and "pass_dtype" not in knn["torch"]
    assert knn["torch-pass"]["status"] == "ok" and "30 candidates, tiles of" in knn["torch-pass"]["note"]
    assert 0 < knn["torch-pass"]["matmul_s"] and 0 < knn["torch-pass"]["maxima_s"]
    assert ours._TorchSearch.DTYPES["cpu"] == torch.float32            # put back
    capsys.readouterr()
    missing = tmp_path / "missing"
    assert main(["bench", "bench.profile=tiny", f"out={missing}", "bench.rows=[knn]",
                 f"bench.tiny.knn.baseline={tmp_path / 'nope.py'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "knn.baseline" in err[0] and "no such file" in err[0]
    assert not Path(missing).exists()


def test_a_failing_line_is_reported_and_the_rest_go_on():
    ctx = Context(torch.device("cpu"), "tiny", tiny_profile(), ["resmlp_s12"], False)
    ctx.attempt("knn", {"backend": "broken"}, lambda: 1 / 0)
    ctx.attempt("knn", {"backend": "absent"}, lambda: (_ for _ in ()).throw(R.Skip("not installed")))
    ctx.attempt("knn", {"backend": "fine"}, lambda: {"seconds": 0.5, "queries": 10})
    assert [r["status"] for r in ctx.results] == ["error", "skipped", "ok"]
    meta = {"cpu": "cpu", "cpu_cores": 2, "torch_threads": 1, "load_average": [0.0], "torch": "x", "date": "d"}
    text = render(ctx.results, [], meta, "tiny")
    assert "ERROR: ZeroDivisionError" in text and "SKIPPED: not installed" in text and "0.500" in text


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
            return {"mem_gb": R.peak_memory_gb(ctx.device)}
        return fn
    ctx.attempt("dino", {"impl": "reference", "batch": 512}, line(57.6))
    ctx.attempt("knn", {"backend": "torch-device"}, line(3.5))
    ctx.attempt("knn", {"backend": "broken"}, lambda: 1 / 0)
    ctx.attempt("knn", {"backend": "small"}, line(0.5))
    assert [r.get("mem_gb") for r in ctx.results] == [pytest.approx(57.6), pytest.approx(3.5), None,
                                                      pytest.approx(0.5)]
    assert mem["resets"] >= 4   # before every line (and after the failed one)


def test_the_knn_profile_times_the_bench_knn_by_phase(tmp_path, capsys):
    """`python -m resmlp.bench.profile profile.phases=knn`: the bench's knn row at a bench
    profile's sizes, timed whole and by phase, its votes unchanged by the clock; bad values
    of its keys: one line, exit 2, nothing written."""
    from resmlp.bench import profile
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
    for bad, says in (("profile.phases=knn,stp", "profile: profile.phases: stp is not one of loader, augment, "
                                                 "step, knn"),
                      ("profile.knn=huge", "profile: profile.knn=huge is not one of gpu, cpu, tiny")):
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
    ctx.attempt("dino", {"impl": "ours"}, R.need_lightly)
    ctx.attempt("knn", {"backend": "faiss-cpu"}, lambda: R._knn_one(ctx, "faiss-cpu", data))
    ctx.attempt("knn", {"backend": "torch"}, lambda: R._knn_one(ctx, "torch", data))
    assert [r["status"] for r in ctx.results] == ["skipped", "skipped", "ok"]


def test_compile_cost_times_each_mode_in_a_fresh_process(tmp_path, capsys):
    """bench/compile_cost.py's plumbing (the eager mode: compiling is what costs minutes
    here; tests/test_compiling.py checks what compile=true compiles), and its one-line
    refusal of an unknown mode."""
    from resmlp.bench import compile_cost
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
    assert err == ["compile_cost: --modes fast is not one of eager, whole, regional"]
