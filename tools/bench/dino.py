"""The bench's dino row: one DINO step on synthetic crops, per model, crop strategy and batch
(the profile's, and the largest that fits where `largest_batch` asks): ours
(resmlp.ssl.step.DinoStep) with the plain and the fused blocks (model.fused), eager,
compiled and graphed; the fused block with each of the profile's `levers` (LEVERS); and
the reference-style loop (reference.py). On a shared CPU ours eager and the reference may
be timed in alternating repeats (`interleave`).
"""
from __future__ import annotations

import contextlib
import time

import torch
from omegaconf import OmegaConf

from bench.step import (Skip, build_our_step, build_reference_step, call_step, compile_cleanup, dino_config,
                        fused_values, ours, step_fields, step_flops, synthetic_crops, time_step)
from bench.timing import count_flops, measure_interleaved, peak_memory_gb, reset_memory, sync

# The fused block's levers (issue 43), each a line "ours fused <lever> <kind>" of its own:
# the model overrides it sets, or none for a compile option (INDUCTOR_MODES).
LEVERS = {
    "token-major": ["model.token_major=true"],
    "triton": ["model.kernels=triton"],
    "bf16-residual": ["model.residual_dtype=bf16"],
    "max-autotune": [],
}
# Levers that compile the blocks in another Inductor mode (compiled lines only): max-autotune's
# GEMM templates may fuse GELU into fc1's epilogue where cuBLAS cannot; its first call holds
# the autotuning. Not Inductor's own CUDA graphs, which cannot nest in the step's capture.
INDUCTOR_MODES = {"max-autotune": "max-autotune-no-cudagraphs"}


def lever_lines(p) -> list[str]:
    """The profile's `levers` (a profile written before them: none), each alone, then those
    that change the model all together ("token-major+triton+..."), when there are two."""
    levers = [str(v) for v in (p.get("levers") or [])]
    on_model = [v for v in levers if LEVERS[v]]
    return levers + (["+".join(on_model)] if len(on_model) > 1 else [])


def lever_overrides(line: str | None) -> list[str]:
    """The model overrides of a lever line ("a+b": both levers'); none for None."""
    return [o for lever in (line.split("+") if line else []) for o in LEVERS[lever]]


def inductor_mode(line: str | None):
    """A context that compiles in the lever line's Inductor mode (nothing for other lines)."""
    mode = INDUCTOR_MODES.get(line or "")
    if mode is None:
        return contextlib.nullcontext()
    import torch._inductor
    return torch._inductor.config.patch(torch._inductor.list_mode_options(mode))


def dino_family(ctx) -> None:
    p = ctx.p
    for model in ctx.models:
        for strategy in p.strategies:
            batches = [int(p.batch_size)]
            if p.get("largest_batch"):
                ident = {"model": model, "strategy": strategy, "impl": "largest batch search"}
                found = ctx.attempt("dino", ident, lambda: _largest_batch(ctx, model, strategy))
                if found["status"] == "ok" and found["batch"] not in batches:
                    batches.append(found["batch"])
            for batch in batches:
                _dino_lines(ctx, model, strategy, batch)


def _dino_lines(ctx, model: str, strategy: str, batch: int) -> None:
    """Ours for each `fused` value, then the fused block with each lever line (eager and
    compiled, then graphed), then the reference."""
    p = ctx.p
    flops: dict = {}
    fused_list = fused_values(p)
    levers = lever_lines(p)
    together = bool(p.get("interleave")) and bool(p.reference) and False in list(p.compile)
    timed: dict = {}  # impl -> fields of the lines timed together (interleave)
    for fused, lever in [(f, None) for f in fused_list] + [(True, line) for line in levers]:
        prefix = f"{lever} " if lever else ""
        for comp in p.compile:
            if lever in INDUCTOR_MODES and not comp:
                continue
            ident = {"model": model, "strategy": strategy, "impl": ours(prefix + ("compile" if comp else "eager"), fused),
                     "batch": batch}
            if together and not comp:
                ctx.attempt("dino", ident, lambda: timed.pop(ident["impl"], None) or
                            _dino_together(ctx, model, strategy, batch, fused_list, flops, timed, levers)[ident["impl"]])
            else:
                ctx.attempt("dino", ident, lambda: _dino_ours(ctx, model, strategy, batch, bool(comp), flops,
                                                              fused=fused, **({"lever": lever} if lever else {})))
        for kind in p.get("graphs") or []:  # the whole step as one CUDA graph (ssl/graphed_step.py)
            if str(kind) not in ("eager", "compile"):
                raise ValueError(f"bench graphs: {kind!r} is not eager or compile")
            if lever in INDUCTOR_MODES and str(kind) != "compile":
                continue
            ident = {"model": model, "strategy": strategy, "impl": ours(f"{prefix}{kind}+graphs", fused), "batch": batch}
            ctx.attempt("dino", ident, lambda: _dino_ours(ctx, model, strategy, batch, str(kind) == "compile",
                                                          flops, graphs=True, fused=fused,
                                                          **({"lever": lever} if lever else {})))
    if p.reference:
        ident = {"model": model, "strategy": strategy, "impl": "reference", "batch": batch}
        # timed with the eager lines when those ran in this process (not taken from an earlier run)
        ctx.attempt("dino", ident, lambda: timed.pop("reference", None) or
                    _dino_reference(ctx, model, strategy, batch, flops))


def _largest_batch(ctx, model: str, strategy: str) -> dict:
    """The largest batch, doubling from batch_size up to max_batch, for which our eager
    step runs (two steps: the second one allocates what the steady state holds); stops at
    the first out-of-memory error."""
    p, dev = ctx.p, ctx.device
    # the plain step when it is measured: it holds more activations, so every line fits
    cfg, plan, _ = _step_inputs(ctx, model, strategy, int(p.batch_size), fused=False not in fused_values(p))
    step = build_our_step(cfg, dev, p.precision, False)
    fits, tried, stop = int(p.batch_size), [], "max_batch reached"
    batch = 2 * fits
    try:
        while batch <= int(p.max_batch):
            tried.append(batch)
            try:
                crops = synthetic_crops(plan, batch, dev)
                for _ in range(2):
                    call_step(step, crops)
                sync(dev)
            except torch.OutOfMemoryError:
                stop = f"out of memory at batch {batch}"
                break
            finally:
                crops = None
                reset_memory(dev)
            fits, batch = batch, 2 * batch
    finally:
        step = None
        reset_memory(dev)
    return {"batch": fits, "tried": tried, "stop": stop, "crops": plan.label()}


def _step_inputs(ctx, model, strategy, batch: int, fused: bool = False, lever: str | None = None):
    """(config, crop plan, synthetic crops on the device) for one DINO step line."""
    from resmlp.data.crop_plan import crop_plan
    cfg = dino_config(ctx.p, model, strategy, [f"batch_size={batch}", f"model.fused={str(fused).lower()}",
                                                *lever_overrides(lever)])
    plan = crop_plan(cfg)
    return cfg, plan, synthetic_crops(plan, batch, ctx.device)


def _dino_together(ctx, model, strategy, batch, fused_list, flops, timed, levers=()) -> dict:
    """Ours eager (for each `fused` value and each lever line) and the reference built side
    by side and timed with alternating repeats (profile key `interleave`: on a shared CPU the
    ratios then survive the other processes' load). All need memory at once: off in the gpu
    profile. Returns {impl: fields} and leaves them in `timed` for the lines that follow;
    a lever line's `vs_fused` is its rate over the fused block's, timed with it."""
    p, dev = ctx.p, ctx.device
    cfg, plan, crops = _step_inputs(ctx, model, strategy, batch)
    steps = {ours("eager", f): build_our_step(OmegaConf.merge(cfg, {"model": {"fused": f}}), dev, p.precision, False)
             for f in fused_list}
    levers = [line for line in levers if line not in INDUCTOR_MODES]
    for line in levers:
        lever_cfg = _step_inputs(ctx, model, strategy, batch, fused=True, lever=line)[0]
        steps[ours(f"{line} eager", True)] = build_our_step(lever_cfg, dev, p.precision, False)
    ref, backbone = build_reference_step(cfg, dev, strategy)
    steps["reference"] = ref
    last = {}

    def runner(name, step):
        def one():
            last[name] = call_step(step, crops)
        return one
    times = measure_interleaved({name: runner(name, step) for name, step in steps.items()}, dev,
                                int(p.warmup), int(p.steps), int(p.repeats))
    if not all(torch.isfinite(v).all() for v in last.values()):
        raise RuntimeError("non-finite loss: the timed steps skipped their updates")
    flops["flops"] = step_flops(cfg, dev, p.precision, crops, steps.get(ours("eager", False)))
    common = {"crops": plan.label(), "interleaved": True}
    for name in steps:
        timed[name] = {"precision": p.precision, "loss": float(last[name]), **common,
                       **step_fields(times[name], batch, plan.n_crops, flops["flops"], ctx.peak_tflops, dev)}
    timed["reference"].update(precision="fp16+GradScaler" if dev.type == "cuda" else "fp32", backbone=backbone)
    fused = timed.get(ours("eager", True))
    for line in levers:
        if fused:
            lever = timed[ours(f"{line} eager", True)]
            lever["vs_fused"] = lever["images_per_s"] / fused["images_per_s"]
    return timed


def _dino_ours(ctx, model, strategy, batch, comp, flops, graphs: bool = False, fused: bool = False,
               lever: str | None = None) -> dict:
    p, dev = ctx.p, ctx.device
    if graphs and dev.type != "cuda":
        raise Skip("CUDA graphs need a GPU")
    cfg, plan, crops = _step_inputs(ctx, model, strategy, batch, fused=fused, lever=lever)
    step = build_our_step(cfg, dev, p.precision, comp, graphs=graphs)
    extra = {}
    try:
        with inductor_mode(lever):  # the blocks compile at their first calls
            if graphs:  # the warm-up calls and the capture, before the timing's own warm-up
                extra["capture_s"] = _until_steady(step, crops, dev)
            t, loss = time_step(step, crops, dev, p)
        mem = peak_memory_gb(dev)
        if graphs:
            extra["captures"] = step.graphed.captures
        if "flops" not in flops and not fused:  # counted once, on the eager modules, never through a graph
            step.graphed = None
            flops["flops"] = step_flops(cfg, dev, p.precision, crops, step)
    finally:
        step = None  # free the step's memory before the next line builds its own
        compile_cleanup(comp)
    if "flops" not in flops:  # the first line is a fused one: a plain step counts, this one freed
        flops["flops"] = step_flops(cfg, dev, p.precision, crops)
    fields = step_fields(t, batch, plan.n_crops, flops["flops"], ctx.peak_tflops, dev)
    fields["mem_gb"] = mem
    return {"precision": p.precision, "crops": plan.label(), "loss": loss, **fields, **extra}


def _until_steady(step, crops, dev) -> float:
    """Seconds of the graphed step's calls up to and including its capture."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(step.graphed.calls_to_steady_state):
        call_step(step, crops)
    sync(dev)
    return time.perf_counter() - t0


def _dino_reference(ctx, model, strategy, batch, flops) -> dict:
    p, dev = ctx.p, ctx.device
    cfg, plan, crops = _step_inputs(ctx, model, strategy, batch)
    step, backbone = build_reference_step(cfg, dev, strategy)
    t, loss = time_step(step, crops, dev, p)
    mem = peak_memory_gb(dev)
    if "flops" not in flops:
        flops["flops"] = count_flops(lambda: call_step(step, crops))
    step = None
    fields = step_fields(t, batch, plan.n_crops, flops["flops"], ctx.peak_tflops, dev)
    fields["mem_gb"] = mem
    return {"precision": "fp16+GradScaler" if dev.type == "cuda" else "fp32", "crops": plan.label(),
            "backbone": backbone, "loss": loss, **fields}
