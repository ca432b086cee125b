"""The graphed DINO step under a process group (ssl/graphs.py): the gradients in one flat
buffer, one all-reduce of it, then the update, run here uncaptured on two gloo processes
against DistributedDataParallel on the same inputs; and one process in a group (torchrun's
one-process line) taking the same path, where a plain run reduces nothing.

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
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from resmlp.bench import rows as R
from resmlp.ssl.graphs import GraphedStep

from test_dino import ROOT, TINY as TRAINER_TINY, needs_fmnist
from test_graphs import SCHEDULE, tiny

BATCH = 8   # global: 4 images per process


def _join(rank: int, out_dir: str, world_size: int = 2) -> None:
    """The processes meet through a file in the test's folder: no port to pick."""
    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                             world_size=world_size)


def _built(kind: str, world_size: int):
    """The tiny step as the trainer builds it for `world_size` processes on the CPU (DDP
    there), all from seed 0: "ddp" as it is, "flat" with the graphed step's body (its own
    reduction wherever a process group is), "local" with that body but no reduction (the
    control that must differ)."""
    from resmlp.ssl.step import build_dino_step
    cfg, plan = tiny()
    torch.manual_seed(0)
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
            step, plan = _built(kind, 2)
            assert isinstance(step.student, torch.nn.parallel.DistributedDataParallel) == (kind == "ddp")
            grads, losses = [], []
            for i, (lr, wd, m, temp, epoch) in enumerate(SCHEDULE):
                crops = R.synthetic_crops(plan, BATCH, torch.device("cpu"), seed=i)
                mine = [c[4 * rank:4 * rank + 4].clone() for c in crops]   # this process's half of the batch
                losses.append(step(mine, lr, wd, m, temp, epoch)[0].item())
                grads.append(_grads(step))
            out[kind] = {"grads": grads, "losses": losses, "student": step.raw_student.state_dict(),
                         "teacher": step.teacher.state_dict(), "center": step.loss_fn.center.clone()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_the_flat_all_reduce_gives_ddps_gradients_and_weights_on_two_gloo_processes(tmp_path):
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
            crops = R.synthetic_crops(plan, 4, torch.device("cpu"))
            step([c.clone() for c in crops], *SCHEDULE[2])
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
from resmlp.ssl.graphs import GraphedStep
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
