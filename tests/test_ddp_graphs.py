"""The graphed DINO step under a process group (ssl/graphed_step.py): the gradients in one flat
buffer, one all-reduce of it, then the update, run here uncaptured on two gloo processes
against DistributedDataParallel on the same inputs, the processes seeded differently (the
step starts every rank from rank 0's weights, as DDP does); and one process in a group
(torchrun's one-process line) taking the same path, where a plain run reduces nothing.
Then the faults of torchrun (ssl/fallback.py): ranks that built different networks, a rank
whose compiler fails alone (asked for, and under auto), every rank's compiler failing (they
fall back together, in step): each ends in one line per process, never in a hang.

The tolerance: each gradient is the mean of two processes' shares, each divided by two
before the sum, by DDP and by the flat buffer alike. With two processes a sum of two terms
rounds the same in either order, so the gradients of the first step, taken from the same
weights, agree to float rounding and no more (1e-6 relative; a missing all-reduce or a
missing 1/2 is off by the size of the gradients). After it the two updates differ by how
the weight decay is applied (a tensor rate before the optimizer against AdamW's own decay)
and by the learning rate held in fp32, which AdamW turns into weight differences of a small
fraction of the rate (tests/test_graphs.py): the weights after a few steps agree to 1e-5."""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from resmlp.ssl.graphed_step import GraphedStep

import kit
from test_dino import ROOT, TINY as TRAINER_TINY, needs_fmnist
from test_graphs import SCHEDULE, tiny

BATCH = 8   # global: 4 images per process


def _join(rank: int, out_dir: str, world_size: int = 2) -> None:
    """The processes meet through a file in the test's folder: no port to pick."""
    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                             world_size=world_size)


def _built(kind: str, world_size: int, seed: int = 0):
    """The tiny step as the trainer builds it for `world_size` processes on the CPU (DDP
    there), from `seed`: "ddp" as it is, "flat" with the graphed step's body (its own
    reduction wherever a process group is), "local" with that body but no reduction (the
    control that must differ)."""
    from resmlp.ssl.step import build_dino_step
    cfg, plan = tiny()
    torch.manual_seed(seed)
    step = build_dino_step(cfg, plan, torch.device("cpu"), world_size=world_size)
    if kind != "ddp":
        step.graphed = GraphedStep(step, capture=False, reduce=None if kind == "flat" else False)
    return step, plan


def _grads(step) -> dict:
    """Every parameter's gradient after a step (None where DinoStep gave it none: the frozen
    last layer, whose graphed gradient is a zero one)."""
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in step.raw_student.named_parameters()
            if p.requires_grad}


def _steps_on_rank(rank: int, out_dir: str) -> None:
    from resmlp.core.dist import leaving
    _join(rank, out_dir)
    with leaving():
        out = {}
        for kind in ("ddp", "flat", "local"):
            # DDP broadcasts the student alone (the trainer seeds every rank alike): its ranks all
            # start from seed 0, rank 0's weights; the flat step's ranks from seeds of their own
            step, plan = _built(kind, 2, seed=rank if kind == "flat" else 0)
            assert isinstance(step.student, torch.nn.parallel.DistributedDataParallel) == (kind == "ddp")
            grads, losses = [], []
            for i, (values, epoch) in enumerate(SCHEDULE):
                crops = kit.synthetic_crops(plan, BATCH, torch.device("cpu"), seed=i)
                mine = [c[4 * rank:4 * rank + 4].clone() for c in crops]   # this process's half of the batch
                losses.append(step(mine, values, epoch)[0].item())
                grads.append(_grads(step))
            out[kind] = {"grads": grads, "losses": losses, "student": step.raw_student.state_dict(),
                         "teacher": step.teacher.state_dict(), "center": step.loss_fn.center.clone()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_the_flat_all_reduce_gives_ddps_gradients_and_weights_on_two_gloo_processes(tmp_path):
    """Rank 1 seeded apart: the step's broadcast gives it rank 0's student and teacher, so
    every rank's gradients and weights are those of DDP from rank 0's weights, and the ranks
    are bitwise equal."""
    mp.spawn(_steps_on_rank, args=(str(tmp_path),), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        ddp, flat, local = r["ddp"], r["flat"], r["local"]
        first_ddp, first_flat = ddp["grads"][0], flat["grads"][0]
        assert set(first_ddp) == set(first_flat)
        for name, want in first_ddp.items():
            got = first_flat[name]
            if want is None:   # frozen in epoch 0: no gradient for DDP, a zero one for the graph
                assert not got.any(), name
            else:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=name)
        # the control: without the all-reduce each process keeps its own gradients
        diffs = [(local["grads"][0][n] - g).abs().max() / g.abs().max() for n, g in first_ddp.items()
                 if g is not None and g.abs().max() > 0]
        assert max(diffs) > 1e-2
        # every step's gradients (last layer thawed after epoch 0) and the weights after them
        for step_ddp, step_flat in zip(ddp["grads"][2:], flat["grads"][2:]):
            for name, want in step_ddp.items():
                torch.testing.assert_close(step_flat[name], want, rtol=1e-4, atol=1e-7, msg=name)
        for a, b in zip(flat["losses"], ddp["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
        for key in ("student", "teacher"):
            for name, want in ddp[key].items():
                torch.testing.assert_close(flat[key][name], want, rtol=0, atol=1e-5, msg=f"{key}.{name}")
        torch.testing.assert_close(flat["center"], ddp["center"], rtol=1e-6, atol=1e-7)
    for key in ("student", "teacher"):   # the processes stay in step: the same weights on both
        for name, value in ranks[0]["flat"][key].items():
            assert torch.equal(value, ranks[1]["flat"][key][name]), f"ranks differ: {key}.{name}"


def _one_process(rank: int, out_dir: str) -> None:
    """torchrun with one process: a group of one, where the graphed step still takes its
    flat all-reduce (which then changes nothing) and DDP is not built."""
    from resmlp.core.dist import leaving
    _join(rank, out_dir, world_size=1)
    calls = []
    real = tdist.all_reduce
    with leaving():
        tdist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
        try:
            step, plan = _built("flat", 1)
            assert step.graphed.reduce and step.ddp is None and not isinstance(
                step.student, torch.nn.parallel.DistributedDataParallel)
            crops = kit.synthetic_crops(plan, 4, torch.device("cpu"))
            step([c.clone() for c in crops], *SCHEDULE[2])   # (StepValues, epoch)
        finally:
            tdist.all_reduce = real
        flat = sum(p.numel() for p in step.raw_student.parameters() if p.requires_grad)
        torch.save({"calls": calls, "flat": flat}, os.path.join(out_dir, "one.pt"))


def test_one_process_in_a_group_takes_the_flat_all_reduce_and_a_plain_run_none(tmp_path):
    mp.spawn(_one_process, args=(str(tmp_path),), nprocs=1, join=True)
    seen = torch.load(tmp_path / "one.pt")
    assert seen["flat"] in seen["calls"]   # the gradients, in one all-reduce of the flat buffer
    # no process group: the same body reduces nothing and DDP is not built
    step, plan = _built("flat", 1)
    assert not step.graphed.reduce and step.graphed.flat is None
    assert all(p.grad is None for p in step.raw_student.parameters())


TRAINER = """
import sys
from resmlp.core.config import load_config
from resmlp.core.dist import cleanup
from resmlp.ssl.graphed_step import GraphedStep
from resmlp.ssl.networks import DinoHooks
from resmlp.ssl.train import train
out, overrides = sys.argv[1], sys.argv[2:]
def graphed(step, cfg):  # the graphed step's body, uncaptured: what a GPU would capture
    step.graphed = GraphedStep(step, capture=False)
for name, hooks in (("ddp", None), ("graphed", DinoHooks(step=graphed))):
    train(load_config("dino", "resmlp_s12", [*overrides, f"out={out}/{name}"]), hooks)
cleanup()
"""


@pytest.mark.slow
@needs_fmnist
def test_the_trainer_on_two_gloo_processes_learns_the_same_with_the_graphed_body_as_with_ddp(tmp_path, short_knn):
    """The whole trainer under torchrun (2 gloo processes, 16 images each per step, the last
    layer thawing after epoch 1): the graphed step's body with its flat all-reduce against
    DDP, the same loss at every logged iteration and the same weights at the end (to what
    the two updates' rounding makes of 4 steps), each run's ranks in step."""
    script = tmp_path / "two_trainers.py"
    script.write_text(TRAINER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path), *TRAINER_TINY, *short_knn, "device=cpu",
                           "save_rank_weights=true"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()
                     if "loss" in json.loads(line)] for name in ("ddp", "graphed")}
    assert len(losses["ddp"]) == 4 and len(losses["graphed"]) == 4
    for a, b in zip(losses["graphed"], losses["ddp"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    weights = {name: [torch.load(tmp_path / name / f"weights_rank{r}.pth") for r in (0, 1)]
               for name in ("ddp", "graphed")}
    for key in ("student", "teacher"):
        for name, want in weights["ddp"][0][key].items():
            assert torch.equal(weights["graphed"][0][key][name], weights["graphed"][1][key][name]), name
            torch.testing.assert_close(weights["graphed"][0][key][name], want, rtol=0, atol=1e-5, msg=f"{key}.{name}")


def test_a_gradient_that_no_longer_views_the_flat_buffer_is_found():
    """FlatGradients.check: a `.grad` replaced or dropped since the buffer was made (it would be
    left out of the all-reduce) stops the run in one line; the views as made pass."""
    from resmlp.core.errors import RunFailed
    from resmlp.ssl.graphed_step import FlatGradients
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    flat = FlatGradients(list(net.parameters()), [n for n, _ in net.named_parameters()])
    net(torch.randn(4, 3)).sum().backward()   # accumulates into the views
    flat.check()
    assert flat.flat.any()
    net[1].weight.grad = net[1].weight.grad.clone()
    with pytest.raises(RunFailed, match=r"^the gradient of 1.weight no longer views the flat buffer the step "
                                        r"all-reduces \(replaced since"):
        flat.check()
    net[1].weight.grad, net[0].bias.grad = flat.flat[-3:-1].view(1, 2), None
    with pytest.raises(RunFailed, match=r"^the gradient of 0.bias .*\(dropped since"):
        flat.check()


# ---- torchrun's faults: one line per process, never a hang (ssl/fallback.py) -----------------
# A rank that stops leaves its process (torchrun then ends the others): the faults where one
# does run in processes of their own, the others in turn in one pair
FAULTS = (("layout", "all_auto", "eager"), ("alone_asked",), ("alone_auto",))
FAULT_ARGS = {"layout": ["dino.cuda_graphs=true", "compile=false"], "alone_asked": ["compile=true"],
              "alone_auto": [], "all_auto": [], "eager": ["compile=false"]}


def _fault_on_rank(rank: int, out_dir: str, faults: tuple) -> None:
    """`faults` in turn on two gloo processes, through the CLI as a trainer's entry (its
    exit code and stderr kept): "layout", rank 1 built with another head; "alone_asked" and
    "alone_auto", rank 1's compiler fails and rank 0's works (compile=true; compile=auto);
    "all_auto", both compilers fail under auto; "eager", the reference the last one must
    equal. A compiler that works is Dynamo's eager backend (nothing compiled for real)."""
    import contextlib
    import datetime
    import io

    import torch._inductor.compile_fx as compile_fx

    from resmlp.core import compiling
    from resmlp.core.cli import main
    from resmlp.core.run import command
    from resmlp.ssl import fallback, graphed_step
    from resmlp.ssl.step import build_dino_step
    from test_fallback import failing_compiler
    from test_graphs import TINY as STEP_TINY
    compiling.measured_here = lambda device: True   # compile=auto compiles here, as on a GPU
    fallback.AGREE_TIMEOUT = datetime.timedelta(seconds=5)
    for fault in faults:
        fails = fault == "all_auto" or (fault.startswith("alone") and rank == 1)
        compile_fx.compile_fx = failing_compiler if fails else (lambda gm, inputs, **kwargs: gm.forward)
        graphed_step.capturable = (lambda device: True) if fault == "layout" else (lambda device: False)
        os.makedirs(os.path.join(out_dir, fault), exist_ok=True)
        _join(rank, os.path.join(out_dir, fault))
        said = {"lines": []}

        def train(cfg):
            from resmlp.data.crop_plan import crop_plan
            plan = crop_plan(cfg)
            torch.manual_seed(0)
            step = build_dino_step(cfg, plan, torch.device("cpu"), world_size=2,
                                   report=lambda line, path: said["lines"].append(line))
            for i, (values, epoch) in enumerate(SCHEDULE[:3]):
                crops = kit.synthetic_crops(plan, BATCH, torch.device("cpu"), seed=i)
                step([c[4 * rank:4 * rank + 4].clone() for c in crops], values, epoch)
            said["student"] = step.raw_student.state_dict()
            said["path"] = step.path.record()

        extra = ["dino.out_dim=32"] if fault == "layout" and rank == 1 else []
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["dino", "resmlp_s12", *STEP_TINY, *FAULT_ARGS[fault], *extra, "device=cpu",
                         f"out={os.path.join(out_dir, fault, str(rank))}"], run=command(train))
        torch._dynamo.reset()
        torch.save({"code": code, "err": err.getvalue().strip().splitlines(), **said},
                   os.path.join(out_dir, fault, f"rank{rank}.pt"))


@pytest.mark.slow
def test_torchruns_faults_end_in_one_line_per_process_or_fall_back_together(tmp_path):
    """Different layouts: both ranks stop at build, naming each rank's layout. A compiler
    failing on rank 1 alone: rank 1 stops in its line (asked for: at once; auto: when rank 0,
    gone into the step's collectives, does not come to agree), and rank 0, left in a
    collective, stops in one line when rank 1 leaves: no hang. Every rank's compiler failing
    under auto: both fall back, the same line, and go on in step with the eager run's weights."""
    for faults in FAULTS:
        context = mp.spawn(_fault_on_rank, args=(str(tmp_path), faults), nprocs=2, join=False)
        deadline = time.monotonic() + 120
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.kill()
                pytest.fail(f"{faults} left the processes hanging")
    got = [{f: torch.load(tmp_path / f / f"rank{r}.pt", weights_only=False) for fs in FAULTS for f in fs}
           for r in (0, 1)]

    layout = [g["layout"] for g in got]
    assert [r["code"] for r in layout] == [2, 2]
    assert layout[0]["err"] == layout[1]["err"] and len(layout[0]["err"]) == 1
    assert re.fullmatch(r"error: the 2 processes built different networks to train \(rank 0: \d+ tensors, \d+ values, "
                        r"torch.float32, layout \w+; rank 1: .*\): every process must start with the same code and "
                        r"config \(model\.\*, dino\.\*\); their gradients cannot be all-reduced", layout[0]["err"][0])

    peer = "error: path: another process stopped in the step's first compiled or captured call ("
    asked, auto = [g["alone_asked"] for g in got], [g["alone_auto"] for g in got]
    assert [r["code"] for r in asked + auto] == [2, 2, 2, 2]
    assert asked[1]["err"] == ["error: compiling the step failed: RuntimeError: injected: Inductor could not compile "
                               "this graph (compile=true asks for it); compile=false trains eager, compile=auto falls "
                               "back by itself; no checkpoint was written before it stopped: the same command again "
                               "starts over"]
    assert auto[1]["err"] == ["error: path: compiling the step failed: RuntimeError: injected: Inductor could not "
                              "compile this graph; the other processes did not reach the same point (they went on into "
                              "the step's collectives), so they cannot fall back together: stopping; compile=false "
                              "turns it off"]
    for r in (asked[0], auto[0]):
        assert len(r["err"]) == 1 and r["err"][0].startswith(peer) and r["err"][0].endswith(
            "): its own line says why; stopping"), r["err"]

    together, eager = [g["all_auto"] for g in got], [g["eager"] for g in got]
    line = ("path: compiling the step failed: RuntimeError: injected: Inductor could not compile this graph; "
            "continuing eager, not graphed")
    for r in together:
        assert r["code"] == 0 and r["err"] == [] and r["lines"] == [line]
        assert r["path"] == {"compile": False, "cuda_graphs": False, "fell_back": [line]}
    for name, value in eager[0]["student"].items():
        assert torch.equal(together[0]["student"][name], together[1]["student"][name]), name
        assert torch.equal(together[0]["student"][name], value), name
