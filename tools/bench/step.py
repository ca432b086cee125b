"""The bench's step kit: what every family that times the DINO step shares (the trainer's
config at a profile's sizes, its step built at a precision, synthetic crops, one timed
call, the fields of a step line). No family lives here, and none is imported: the families
(dino.py, e2e.py, torchrun_step.py, inference.py, knn.py, data.py) import this file, and
bench.py's table names them. Each family reports through `ctx.attempt(family, identity,
fn)`: fn returns the measured fields, and an exception becomes that line's error while the
other lines still run. NOTES.md has the method and the predictions.
"""
from __future__ import annotations

import contextlib

import torch
from omegaconf import OmegaConf

from bench.timing import count_flops, measure, peak_memory_gb
from resmlp.core.dist import AMP_DTYPES
from resmlp.ssl.step import StepValues

# One fixed point of the schedules for every timed step, and its epoch (after the frozen-last-layer one).
VALUES, EPOCH = StepValues(lr=1e-4, wd=0.04, momentum=0.996, teacher_temp=0.04), 1


class Skip(Exception):
    """A measurement that cannot run on this machine (a package or the GPU is missing)."""


def need_lightly() -> None:
    try:
        import lightly  # noqa: F401
    except ImportError:
        raise Skip("lightly is not installed (the trainer's DINO head and loss come from it); "
                   "carry its wheels, see tools/bench/NOTES.md") from None


def compile_cleanup(compiled: bool) -> None:
    if compiled:
        torch._dynamo.reset()


def dino_config(p, model: str, strategy: str, extra=()):
    """The trainer's config for `model` at the profile's sizes and `strategy`."""
    from resmlp.core.config import load_config
    o = ["demo=false", "data=imagefolder", f"data.img_size={p.img_size}", f"model.patch_size={p.patch_size}",
         f"data.local_size={p.local_size}", f"dino.local_crops={strategy}", f"dino.n_local_crops={p.n_local}",
         f"model.drop_path_rate={p.drop_path_rate}", f"dino.out_dim={p.head.out_dim}",
         f"dino.hidden_dim={p.head.hidden_dim}", f"dino.bottleneck_dim={p.head.bottleneck_dim}",
         f"batch_size={p.batch_size}"]
    if p.dim:
        o.append(f"model.dim={p.dim}")
    if p.depth:
        o.append(f"model.depth={p.depth}")
    return load_config("dino", model, [*o, *extra])


def ours(kind: str, fused: bool) -> str:
    """A line's impl: "ours eager", "ours compile+graphs", ... and "ours fused eager", ... for
    model.fused=true (the plain lines keep the names they had before the fused block)."""
    return f"ours {'fused ' if fused else ''}{kind}"


def fused_values(p) -> list[bool]:
    """The profile's `fused` list (a profile written before it: the plain block only)."""
    return [bool(f) for f in (p.get("fused") or [False])]


def plain_blocks(cfg):
    """cfg with the plain blocks: model.fused=false, the fused blocks' options (a lever line's) unset."""
    from resmlp.models.resmlp import FUSED_OPTIONS
    return OmegaConf.merge(cfg, {"model": {"fused": False, **dict.fromkeys(FUSED_OPTIONS)}})


def synthetic_crops(plan, batch: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, 3, s, s, device=device, generator=g) for s in plan.sizes]


def autocast_for(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext
    if precision not in AMP_DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(AMP_DTYPES)}")
    return lambda: torch.autocast(device.type, dtype=AMP_DTYPES[precision])


def build_our_step(cfg, device: torch.device, precision: str, compile: bool | str, graphs: bool = False,
                   world_size: int = 1):
    """The trainer's step (resmlp.ssl.step.build_dino_step), for a world of one unless
    `world_size` says more (the torchrun row's process). compile: True compiles by region, the
    form the bench's "compile" lines have always timed (or a word of `compile`, e.g. whole);
    graphs: dino.cuda_graphs (a line names it: "+graphs")."""
    need_lightly()
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    cfg = OmegaConf.merge(cfg, {"compile": "regions" if compile is True else compile,
                                "dino": {"cuda_graphs": bool(graphs)}})
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return build_dino_step(cfg, crop_plan(cfg), device, scaler, autocast_for(device, precision), world_size)


def build_reference_step(cfg, device: torch.device, strategy: str):
    """The reference-style step (reference.py): timm's ResMLP where it takes the
    crops (resize, none), ours with grid adaptation otherwise."""
    need_lightly()
    from bench.reference import RefDinoStep, build_reference_networks, model_dims, timm_name
    from resmlp.data.crop_plan import crop_plan
    plan = crop_plan(cfg)
    backbone = "timm" if strategy in ("resize", "none") else "ours"
    student, teacher = build_reference_networks(cfg, plan, device, backbone)
    step = RefDinoStep(student, teacher, int(cfg.dino.out_dim), plan.n_crops, device,
                       fp16=device.type == "cuda", clip_grad=float(cfg.optim.clip_grad),
                       freeze_last_layer=int(cfg.dino.freeze_last_layer), student_temp=float(cfg.dino.student_temp),
                       center_momentum=float(cfg.dino.center_momentum))
    name = timm_name(model_dims(cfg.model, cfg.data.img_size)) if backbone == "timm" else \
        f"ours ({cfg.dino.local_crops}; timm's takes no 96 px crop)"
    return step, name


def call_step(step, crops):
    out = step(crops, VALUES, EPOCH)
    return out[0] if isinstance(out, tuple) else out


def step_flops(cfg, dev, precision: str, crops, step=None) -> int:
    """Model FLOPs of one eager step of the plain blocks (`step`, or one built here): the
    fused ones do the same math, but FlopCounterMode has no formula for the CPU's GELU
    epilogue (_addmm_activation)."""
    if step is None:
        step = build_our_step(plain_blocks(cfg), dev, precision, False)
    return count_flops(lambda: call_step(step, crops))


def time_step(step, crops, device, p):
    last = {}

    def one():
        last["loss"] = call_step(step, crops)
    t = measure(one, device, int(p.warmup), int(p.steps), int(p.repeats))
    if not torch.isfinite(last["loss"]).all():
        raise RuntimeError("non-finite loss: the timed steps skipped their updates")
    return t, float(last["loss"])


def step_fields(t, batch: int, n_crops: int, flops: int | None, peak: float | None, device) -> dict:
    img_s = batch / t.seconds
    out = {"images_per_s": img_s, "crops_per_s": img_s * n_crops, "step_ms": 1e3 * t.seconds,
           "first_s": t.first_s, "warmup_s": t.warmup_s, "spread": t.spread, "mem_gb": peak_memory_gb(device)}
    if flops:
        out["gflop_per_image"] = flops / batch / 1e9
        out["tflops"] = flops / t.seconds / 1e12
        if peak:
            out["pct_peak"] = 100.0 * out["tflops"] / peak
    return out
