"""The bench's `torchrun` row: one DINO step line measured twice in the same bench run, in the
bench's own process and in a one-process job under `torchrun --standalone --nproc_per_node 1`
(which joins a process group: NCCL on a GPU, gloo on a CPU, as the trainer under torchrun
does), with the same model, crops, batch and settings; the torchrun line's images/s as a
fraction of the in-process one (goal: within 10%). The job's process is this module:
`python -m torch.distributed.run ... -m bench.torchrun_step SPEC OUT` reads the step's
config from SPEC (JSON) and writes its figures to OUT.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.process import child_env
from bench.step import build_our_step, compile_cleanup, dino_config, ours, synthetic_crops, time_step
from bench.timing import peak_memory_gb

TIMING = ("warmup", "steps", "repeats")  # the bench profile's keys that say how a step line is timed


def torchrun_argv(spec: Path, out: Path, python: str = sys.executable) -> list[str]:
    """The job's command line: one process on this machine (`--standalone`: its own
    rendezvous on a free port), running this module."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "bench.torchrun_step", str(spec), str(out)]


def torchrun_family(ctx) -> None:
    cfg = step_config(ctx)
    base = {"model": str(cfg.model.name), "strategy": str(cfg.dino.local_crops), "batch": int(cfg.batch_size),
            "impl": ours(("compile" if cfg.compile else "eager") + ("+graphs" if cfg.dino.cuda_graphs else ""),
                           bool(cfg.model.fused))}
    plain = ctx.attempt("torchrun", {**base, "path": "one process"}, lambda: in_process(ctx))
    ctx.attempt("torchrun", {**base, "path": "torchrun --standalone --nproc_per_node 1"},
                lambda: under_torchrun(ctx, plain.get("images_per_s")))


def step_config(ctx):
    """The row's step: the profile's dino lines' config for torchrun.model and .strategy, graphed
    as torchrun.graphs says (the step a user's run takes on a GPU)."""
    q = ctx.p.torchrun
    return dino_config(ctx.p, str(q.model), str(q.strategy),
                         [f"compile={bool(q.compile)}", f"dino.cuda_graphs={bool(q.graphs)}"])


def timing(ctx) -> dict:
    """How the step is timed, and what the bench set in its own process (threads, seed)."""
    return {"precision": str(ctx.p.precision), **{k: int(ctx.p[k]) for k in TIMING},
            "threads": torch.get_num_threads(), "seed": int(ctx.seed)}


def in_process(ctx) -> dict:
    return time_one_step(step_config(ctx), ctx.device, timing(ctx))


def time_one_step(cfg, device, spec: dict, world_size: int = 1) -> dict:
    """The step of `cfg` on synthetic crops, timed as the bench's dino lines are."""
    from resmlp.data.crop_plan import crop_plan
    plan = crop_plan(cfg)
    crops = synthetic_crops(plan, int(cfg.batch_size), device)
    step = build_our_step(cfg, device, spec["precision"], bool(cfg.compile), graphs=bool(cfg.dino.cuda_graphs),
                            world_size=world_size)
    try:
        t, loss = time_step(step, crops, device, SimpleNamespace(**{k: spec[k] for k in TIMING}))
    finally:
        step = None
        compile_cleanup(bool(cfg.compile))
    return {"images_per_s": int(cfg.batch_size) / t.seconds, "step_ms": 1e3 * t.seconds, "first_s": t.first_s,
            "spread": t.spread, "crops": plan.label(), "loss": loss, "mem_gb": peak_memory_gb(device)}


def under_torchrun(ctx, in_process_rate: float | None) -> dict:
    """The same step in a torchrun job of one process; its figures and the ratio."""
    from resmlp.core.config import to_dict
    spec = {"config": to_dict(step_config(ctx)), "device": ctx.device.type, **timing(ctx)}
    timeout = float(ctx.p.torchrun.timeout_s)
    with tempfile.TemporaryDirectory(prefix="resmlp_bench_torchrun_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        try:
            done = subprocess.run(torchrun_argv(spec_path, out_path), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env=child_env(PYTHONUNBUFFERED="1"))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the torchrun job ran past bench.<profile>.torchrun.timeout_s={timeout:g}") from None
        if done.returncode or not out_path.exists():
            tail = " | ".join(done.stdout.strip().splitlines()[-3:])
            raise RuntimeError(f"the torchrun job exited {done.returncode}: {tail}")
        fields = json.loads(out_path.read_text())
    fields["vs_one_process"] = fields["images_per_s"] / in_process_rate if in_process_rate else None
    return fields


def worker(spec_path: str, out_path: str) -> int:
    """A torchrun process: join the group, time the step, rank 0 writes the figures."""
    from omegaconf import OmegaConf

    from resmlp.core import dist
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(int(spec["seed"]))
    device = dist.setup(spec["device"])
    torch.backends.cudnn.benchmark = device.type == "cuda"  # as the bench (and the trainer) set it
    with dist.leaving():
        fields = time_one_step(OmegaConf.create(spec["config"]), device, spec, world_size=dist.world_size())
        fields.update(world_size=dist.world_size(), backend=torch.distributed.get_backend())
        if dist.is_main():
            Path(out_path).write_text(json.dumps(fields))
    return 0


if __name__ == "__main__":
    sys.exit(worker(*sys.argv[1:3]))
