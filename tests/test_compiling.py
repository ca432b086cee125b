"""compile=true (core/compiling.py): each block compiled in place and reused across the depth.

Dynamo's counters tell what was compiled: `unique_graphs` (one per kind of call that
compiled) and `calls_captured` (the ops traced into them); Dynamo makes them, whatever
backend then compiles each graph. So the tests here force a cheap backend: eager for the
counts, aot_eager (the autograd split as Inductor gets it, without generating code) for
the values; tests/test_bench.py runs the DINO step through Inductor.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from resmlp.core.compiling import compile_as, compile_form, compile_regions, regions
from resmlp.core.config import load_config
from resmlp.data.crop_plan import crop_plan
from resmlp.models.resmlp import ResMLP

import kit

ROOT = Path(__file__).resolve().parent.parent


def cheap_compile(backend: str = "aot_eager"):
    return torch.compiler.set_stance("default", force_backend=backend)


def tiny(depth: int) -> ResMLP:
    return ResMLP(img_size=16, patch_size=4, dim=16, depth=depth, num_classes=0, grid_adapt="interpolate")


def compiled_counts(depth: int, how) -> dict:
    """What Dynamo compiled for two training steps at two crop sizes (4x4 and 2x2 patch
    grids) of a depth-`depth` network compiled by `how(model)`."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = tiny(depth)
    with cheap_compile("eager"):
        how(model)
        for _ in range(2):
            for side in (16, 8):
                model(torch.randn(2, 3, side, side)).sum().backward()
    torch._dynamo.reset()
    return {"graphs": counters["stats"]["unique_graphs"], "ops": counters["stats"]["calls_captured"]}


def reused_across_the_depth(how) -> tuple[bool, dict]:
    """One graph per input shape, each of one block's ops, whatever the depth; and the
    counts at depth 3."""
    one, three = compiled_counts(1, how), compiled_counts(3, how)
    return one == three and three["graphs"] == 2, three


def distinct_block_classes(model):
    """A negative control: blocks that Dynamo cannot take for one another (a class each)."""
    for i, block in enumerate(model.blocks):
        block.__class__ = type(f"Block{i}", (type(block),), {})
    compile_regions(model)


@pytest.mark.slow
def test_the_block_compiles_once_per_input_shape_whatever_the_depth():
    assert reused_across_the_depth(compile_regions)[0]
    # the counters tell the other ways apart: the whole network traces every block (its ops
    # grow with the depth), blocks compiled one by one make a graph each per shape
    assert not reused_across_the_depth(lambda m: m.compile(dynamic=False))[0]
    reused, counts = reused_across_the_depth(distinct_block_classes)
    assert not reused and counts["graphs"] == 6


def test_every_block_gets_tokens_of_one_layout():
    """Dynamo guards a compiled block on its input's strides: block 0 must get what the
    blocks after it make (contiguous tokens), or it compiles apart. A block whose output is
    a fresh GEMM result (the fused one) made 6 graphs of the DINO step instead of 3 when the
    patch embedding handed block 0 a transposed view."""
    model = tiny(3)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: seen.append((args[0].stride(), args[0].is_contiguous())))
    model(torch.randn(2, 3, 16, 16))
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0][1]


def test_regions_are_the_blocks_whatever_their_class_and_a_network_without_is_compiled_whole():
    model = tiny(3)
    assert regions(model) == list(model.blocks)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    assert regions(conv) == [] and compile_regions(conv) == [conv]


@pytest.mark.parametrize("form", ["regions", "whole"])
def test_a_compiled_network_keeps_its_keys_and_computes_the_same(form):
    torch.manual_seed(0)
    plain, compiled = tiny(2), tiny(2)
    compiled.load_state_dict(plain.state_dict())
    x = torch.randn(3, 3, 16, 16)
    try:
        with cheap_compile():
            assert compile_as(compiled, form) == (list(compiled.blocks) if form == "regions" else [compiled])
            out = compiled(x)
        assert list(compiled.state_dict()) == list(plain.state_dict())  # no _orig_mod. anywhere
        torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


def test_compile_true_on_a_cpu_compiles_by_region_as_before_and_whole_is_one_graph_per_shape():
    """compile=true on a CPU is the regional compile it always was, for every trainer; the
    whole form (DINO's on a GPU when its step is not graphed, or compile=whole) compiles the
    network as one graph per input shape with every block traced into it (its ops grow with
    the depth)."""
    cpu = torch.device("cpu")
    for command in ("dino", "supervised", "distill", "finetune"):
        assert compile_form(True, cpu, command) == ("regions", None)
    whole = lambda m: compile_as(m, "whole")  # noqa: E731
    one, three = compiled_counts(1, whole), compiled_counts(3, whole)
    assert one["graphs"] == three["graphs"] == 2 and three["ops"] > one["ops"]
    assert compile_as(tiny(2), None) == []


def test_evaluations_run_a_compiled_network_eagerly():
    """The k-NN's feature extraction (and the supervised evaluation) compile nothing: a
    partial last batch would otherwise cost a compilation of its own."""
    from resmlp.eval.features import extract_features
    torch.manual_seed(0)
    model = tiny(2)
    images, labels = torch.randn(10, 3, 16, 16), torch.arange(10)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=4)
    want, _ = extract_features(model, loader, "cpu")
    torch._dynamo.reset()
    counters.clear()
    try:
        with cheap_compile():
            compile_regions(model)
            got, got_labels = extract_features(model, loader, "cpu")
    finally:
        torch._dynamo.reset()
    assert counters["frames"]["total"] == 0
    torch.testing.assert_close(got, want)
    assert got_labels.tolist() == list(range(10))


@pytest.mark.slow
def test_the_supervised_step_compiles_the_blocks_and_leaves_its_ema_and_evaluation_eager():
    import contextlib
    from types import SimpleNamespace

    from resmlp.models.from_config import build_model
    from resmlp.supervised.step import build_supervised_step
    from resmlp.supervised.train import evaluate
    cfg = load_config("supervised", "resmlp_s12", ["demo=false", "model.dim=16", "model.depth=2", "batch_size=4",
                                                   "aug.mixup=0", "aug.cutmix=0", "model.drop_path_rate=0",
                                                   "ema.enabled=true", "data.img_size=32", "model.patch_size=8"])
    run = SimpleNamespace(device=torch.device("cpu"), batch_per_rank=4, world_size=1, autocast=contextlib.nullcontext,
                          scaler=torch.amp.GradScaler("cpu", enabled=False))
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    steps = {}
    torch._dynamo.reset()
    counters.clear()
    try:
        with cheap_compile():
            for compiled in (False, True):
                torch.manual_seed(0)
                cfg.compile = compiled
                model = build_model(cfg.model, num_classes=10)
                steps[compiled] = build_supervised_step(cfg, model, None, 10, run)
                for it in range(2):
                    steps[compiled](images, labels, 1e-3, it)
            graphs = counters["stats"]["unique_graphs"]
            loader = [(images[:3], labels[:3]), (images[3:], labels[3:])]
            evaluate(steps[True].raw_model, loader, run.device, run.autocast)
            evaluate(steps[True].ema.module, loader, run.device, run.autocast)
            assert counters["stats"]["unique_graphs"] == graphs == 1  # evaluations compiled nothing
    finally:
        torch._dynamo.reset()
    assert [m._compiled_call_impl is not None for m in steps[True].raw_model.blocks] == [True, True]
    assert all(m._compiled_call_impl is None for m in steps[True].ema.module.modules())  # an eager copy
    for a, b in ((steps[True].raw_model, steps[False].raw_model), (steps[True].ema.module, steps[False].ema.module)):
        want = b.state_dict()
        assert list(a.state_dict()) == list(want)
        for key, value in a.state_dict().items():
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)


DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[2])   # tests/: the kit
import kit
from resmlp.core.dist import cleanup
from resmlp.data.crop_plan import crop_plan
from resmlp.ssl.step import build_dino_step
dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = kit.small_dino_config("interpolate", ["model.drop_path_rate=0.0", "compile=true", "device=cpu"])
plan = crop_plan(cfg)
torch.manual_seed(0)
with torch.compiler.set_stance("default", force_backend="aot_eager"):
    step = build_dino_step(cfg, plan, torch.device("cpu"), world_size=2)
    crops = kit.synthetic_crops(plan, 8, torch.device("cpu"))
    for _ in range(2):
        kit.call_step(step, [c[4 * rank:4 * rank + 4].clone() for c in crops])
torch.save({"student": step.raw_student.state_dict(), "teacher": step.teacher.state_dict(),
            "graphs": counters["stats"]["unique_graphs"]}, sys.argv[1] + f"/rank{rank}.pt")
cleanup()  # the trainers' teardown: a barrier before the group goes
"""


@pytest.mark.slow
def test_two_processes_with_compiled_blocks_equal_one_eager_process(tmp_path):
    """DDP over a student whose blocks are compiled (gloo, two processes, half the batch
    each) gives the weights of one eager process on the whole batch."""
    script = tmp_path / "ddp_compiled.py"
    script.write_text(DDP_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path), str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = kit.small_dino_config("interpolate", ["model.drop_path_rate=0.0"])
    plan = crop_plan(cfg)
    torch.manual_seed(0)
    one = kit.dino_step(cfg, torch.device("cpu"), "fp32", compile=False)
    crops = kit.synthetic_crops(plan, 8, torch.device("cpu"))
    for _ in range(2):
        kit.call_step(one, [c.clone() for c in crops])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        # per rank: the blocks' student global and local crops and teacher global, the heads'
        # student and teacher, the loss's cross-entropy and centered softmax
        assert r["graphs"] == 3 + 2 + 2
    for key, net in (("student", one.raw_student), ("teacher", one.teacher)):
        for name, value in net.state_dict().items():
            assert torch.equal(ranks[0][key][name], ranks[1][key][name]), f"ranks differ: {key}.{name}"
            torch.testing.assert_close(ranks[0][key][name], value, rtol=1e-4, atol=1e-5, msg=f"{key}.{name}")
