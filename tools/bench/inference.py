"""The bench's inference row: the backbone's forward alone, random weights: ours (eager, with
every Aff folded away, compiled) against timm's ResMLP (eager, compiled), after a check that
timm's weights loaded into ours and folded give timm's logits.
"""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from bench.step import compile_cleanup, dino_config
from bench.timing import measure, measure_interleaved, peak_memory_gb
from resmlp.core.dist import AMP_DTYPES

def inference_family(ctx) -> None:
    from bench.reference import model_dims
    q = ctx.p.inference
    for model in ctx.inference_models():
        cfg = dino_config(ctx.p, model, "none")
        dims = model_dims(cfg.model, cfg.data.img_size)
        ident = {"model": model, "dtype": str(q.dtype), "batch": int(q.batch_size)}
        check: dict = {}
        ctx.attempt("inference", {**ident, "impl": "check: folded ours = timm (fp32)"},
                    lambda: _fold_check(cfg, dims, check))
        # the eager ones side by side, repeats alternated; the compiled ones one at a time
        eager = {"timm eager": ("timm", False), "ours eager": ("ours", False), "ours folded eager": ("ours", True)}
        timed: dict = {}
        for name in eager:
            def fields(name=name):
                if not timed:  # timed together by the first of them an earlier run did not measure
                    try:
                        timed.update(_infer_together(ctx, cfg, dims, eager))
                    except Exception as e:  # noqa: BLE001 - reported (with its traceback) on each of its lines
                        timed["failure"] = e
                if name not in timed:
                    raise timed["failure"]
                return timed[name]
            ctx.attempt("inference", {**ident, "impl": name}, fields)
        if q.compile:
            for name, kind, fold in (("timm compile", "timm", False), ("ours folded compile", "ours", True)):
                ctx.attempt("inference", {**ident, "impl": name},
                            lambda: _infer(ctx, cfg, dims, kind, fold, True))


def _fold_check(cfg, dims, check) -> dict:
    """timm's model with perturbed random weights, loaded into ours and folded: same logits."""
    from bench.reference import timm_resmlp
    from resmlp.models import fold_affine, load_pretrained
    from resmlp.models.from_config import build_model
    g = torch.Generator().manual_seed(0)
    ref = timm_resmlp(dims, 0.0, num_classes=1000).eval()
    with torch.no_grad():
        for t in ref.parameters():
            t.add_(0.05 * torch.randn(t.shape, generator=g))
    ours = build_model(OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0, "fused": False}), num_classes=1000)
    load_pretrained(ours, ref.state_dict())
    folded = fold_affine(ours).eval()
    x = torch.randn(4, 3, dims["img"], dims["img"], generator=g)
    with torch.no_grad():
        want, got = ref(x), folded(x)
    check["rel_err"] = float((got - want).norm() / want.norm())
    return {"rel_err": check["rel_err"]}


def _inference_net(ctx, cfg, dims, kind: str, fold: bool):
    from bench.reference import timm_resmlp
    from resmlp.models import fold_affine
    from resmlp.models.from_config import build_model
    if kind == "timm":
        net = timm_resmlp(dims, 0.0, num_classes=1000)
    else:
        # the plain blocks: "ours eager" is the line it was before model.fused
        net = build_model(OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0, "fused": False}), num_classes=1000)
        if fold:
            net = fold_affine(net)
    return net.to(ctx.device, AMP_DTYPES[str(ctx.p.inference.dtype)]).eval()


def _infer_together(ctx, cfg, dims, variants: dict) -> dict:
    """Eager inference of several networks, timed with alternating repeats: {name: fields}."""
    q, dev = ctx.p.inference, ctx.device
    x = torch.randn(int(q.batch_size), 3, dims["img"], dims["img"], device=dev, dtype=AMP_DTYPES[str(q.dtype)])
    nets = {name: _inference_net(ctx, cfg, dims, kind, fold) for name, (kind, fold) in variants.items()}

    def runner(net):
        def call():
            with torch.inference_mode():
                net(x)
        return call
    times = measure_interleaved({n: runner(net) for n, net in nets.items()}, dev, int(q.warmup), int(q.steps),
                                int(q.repeats))
    mem = peak_memory_gb(dev)
    return {n: {"images_per_s": int(q.batch_size) / t.seconds, "ms": 1e3 * t.seconds, "first_s": t.first_s,
                "spread": t.spread, "mem_gb": mem, "interleaved": True} for n, t in times.items()}


def _infer(ctx, cfg, dims, kind: str, fold: bool, comp: bool) -> dict:
    q, dev = ctx.p.inference, ctx.device
    dtype = AMP_DTYPES[str(q.dtype)]
    net = _inference_net(ctx, cfg, dims, kind, fold)
    fwd = torch.compile(net) if comp else net
    x = torch.randn(int(q.batch_size), 3, dims["img"], dims["img"], device=dev, dtype=dtype)

    def call():
        with torch.inference_mode():
            fwd(x)
    try:
        t = measure(call, dev, int(q.warmup), int(q.steps), int(q.repeats))
    finally:
        compile_cleanup(comp)
    return {"images_per_s": int(q.batch_size) / t.seconds, "ms": 1e3 * t.seconds, "first_s": t.first_s,
            "spread": t.spread, "mem_gb": peak_memory_gb(dev)}
