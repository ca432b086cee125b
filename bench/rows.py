"""The benchmark's measurements, one function per family. Each reports through
`ctx.attempt(family, identity, fn)`: fn returns the measured fields, and an exception
becomes that line's error while the other lines still run.

  peak       measured dense matmul rate: the ceiling for '% of peak'
  dino       one DINO step on synthetic crops: ours (resmlp.ssl.step.DinoStep), with plain
             and fused blocks (model.fused), the fused block with each of the profile's
             `levers` (LEVERS), and the reference-style loop (bench/reference.py), per model
             and crop strategy
  e2e        the same step fed from JPEG files by DataLoader workers: the CPU multi-crop
             transform vs whole decoded images + GpuMultiCrop (on a GPU also with the
             JPEGs decoded there), against the synthetic-input step
  inference  fold_affine + torch.compile against timm's ResMLP, eager
  knn        weighted k-NN classification per search backend
  aug        augmentation throughput: CPU transforms per core, GpuMultiCrop per device
  loader     the loader side per CPU core on ImageNet-like JPEG files (read, decode,
             per-image work, collate): the device path's and the eval transform's,
             against the reference DINO transform and eval transform on the same files
bench/NOTES.md has the method and the predictions.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from resmlp.bench.jpegs import make_jpeg_folder, synthetic_image  # noqa: F401 - also the tests'
from resmlp.bench.timing import (copy_rate, count_flops, matmul_rate, measure, measure_interleaved, peak_memory_gb,
                                 reset_memory, sync, threads)
from resmlp.core.dist import AMP_DTYPES, cpu_cores

# One fixed point of the schedules for every timed step (after the frozen-last-layer epoch).
LR, WD, MOMENTUM, TEACHER_TEMP, EPOCH = 1e-4, 0.04, 0.996, 0.04, 1


class Skip(Exception):
    """A measurement that cannot run on this machine (a package or the GPU is missing)."""


def need_lightly() -> None:
    try:
        import lightly  # noqa: F401
    except ImportError:
        raise Skip("lightly is not installed (the trainer's DINO head and loss come from it); "
                   "carry its wheels, see bench/NOTES.md") from None


def _compile_cleanup(compiled: bool) -> None:
    if compiled:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- shared pieces

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
    from omegaconf import OmegaConf

    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    cfg = OmegaConf.merge(cfg, {"compile": "regions" if compile is True else compile,
                                "dino": {"cuda_graphs": bool(graphs)}})
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return build_dino_step(cfg, crop_plan(cfg), device, scaler, autocast_for(device, precision), world_size)


def build_reference_step(cfg, device: torch.device, strategy: str):
    """The reference-style step (bench/reference.py): timm's ResMLP where it takes the
    crops (resize, none), ours with grid adaptation otherwise."""
    need_lightly()
    from resmlp.bench.reference import RefDinoStep, build_reference_networks, model_dims, timm_name
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
    out = step(crops, LR, WD, MOMENTUM, TEACHER_TEMP, EPOCH)
    return out[0] if isinstance(out, tuple) else out


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


# --------------------------------------------------------------------------- peak

def peak_family(ctx) -> None:
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    size = int(ctx.p.matmul_size)
    row = ctx.attempt("peak", {"impl": "dense matmul", "dtype": str(dtype).replace("torch.", ""), "size": size},
                      lambda: matmul_rate(ctx.device, size, dtype))
    ctx.peak_tflops = row.get("tflops")  # also when an earlier run measured it
    mbytes = int(ctx.p.copy_mb)
    ctx.attempt("peak", {"impl": "device-to-device copy", "dtype": "float32", "size": f"{mbytes} MiB"},
                lambda: copy_rate(ctx.device, mbytes))


# --------------------------------------------------------------------------- dino

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
        for kind in p.get("graphs") or []:  # the whole step as one CUDA graph (ssl/graphs.py)
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


def _count_flops(cfg, dev, precision: str, crops, step=None) -> int:
    """Model FLOPs of one eager step of the plain blocks (`step`, or one built here): the
    fused ones do the same math, but FlopCounterMode has no formula for the CPU's GELU
    epilogue (_addmm_activation)."""
    if step is None:
        step = build_our_step(plain_blocks(cfg), dev, precision, False)
    return count_flops(lambda: call_step(step, crops))


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
    flops["flops"] = _count_flops(cfg, dev, p.precision, crops, steps.get(ours("eager", False)))
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
            flops["flops"] = _count_flops(cfg, dev, p.precision, crops, step)
    finally:
        step = None  # free the step's memory before the next line builds its own
        _compile_cleanup(comp)
    if "flops" not in flops:  # the first line is a fused one: a plain step counts, this one freed
        flops["flops"] = _count_flops(cfg, dev, p.precision, crops)
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


# --------------------------------------------------------------------------- e2e

def _cycle(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def loader_rate(loader, sampler, consume, warmup: int, steps: int, device, batch: int) -> float:
    """Images/s of consume(batch) over a loader, in steady state: `warmup` batches first
    (worker start, compilation), then `steps` batches; the rate is taken over the second
    half, once the prefetch queue filled during the warm-up has drained."""
    it = _cycle(loader, sampler)
    try:
        for _ in range(warmup):
            consume(next(it))
        sync(device)
        stamps = [time.perf_counter()]
        for _ in range(steps):
            consume(next(it))
            stamps.append(time.perf_counter())
        sync(device)
        stamps[-1] = time.perf_counter()
    finally:
        it.close()
    half = len(stamps) // 2
    return (len(stamps) - 1 - half) * batch / (stamps[-1] - stamps[half])


def e2e_family(ctx) -> None:
    """The trainer's data path (data.crop_plan.build_views + data.resumable.build_train_loader)
    feeding the trainer's step, for each place the views can be made, from one folder of
    photo-like JPEGs in ImageNet's layout written here (no data set travels), per model of
    e2e.models: each line's images/s against the synthetic-input step of the same run."""
    p, e, dev = ctx.p, ctx.p.e2e, ctx.device
    workers = cpu_cores() if str(e.workers) == "auto" else int(e.workers)
    root = tempfile.mkdtemp(prefix="resmlp_bench_jpeg_")
    try:
        def write():
            t0 = time.perf_counter()
            kb = make_jpeg_folder(root, int(e.n_images), 0, 0, shape=(int(e.width), int(e.height)),
                                  quality=int(e.quality))
            return {"images": int(e.n_images), "image": f"{e.width}x{e.height} q{e.quality}", "mean_kb": kb,
                    "write_s": time.perf_counter() - t0}
        first = str(e.models[0])
        if ctx.attempt("e2e", {**_e2e_ident(ctx, first, workers), "path": "write JPEGs"}, write,
                       restorable=False)["status"] != "ok":
            return
        for model in e.models:
            _e2e_lines(ctx, str(model), root, workers)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _e2e_ident(ctx, model: str, workers: int) -> dict:
    p, e = ctx.p, ctx.p.e2e
    fused = bool(dino_config(p, model, e.strategy).model.fused)  # the trainer's default
    return {"model": model, "strategy": e.strategy, "impl": ours("compile" if e.compile else "eager", fused),
            "batch": int(p.batch_size), "workers": workers}


def _e2e_lines(ctx, model: str, root: str, workers: int) -> None:
    """One model's lines: the step on synthetic crops, then fed by the loader (the CPU
    multi-crop in the workers; the JPEGs decoded in the workers and cropped on the device;
    on a GPU also decoded there, data.decode=gpu). The step is built by the first line this
    run measures (an earlier run's lines are kept, bench.resume)."""
    p, e, dev = ctx.p, ctx.p.e2e, ctx.device
    base = _e2e_ident(ctx, model, workers)
    state: dict = {}

    def built() -> dict:
        if "step" not in state:
            reset_memory(dev)
            cfg = dino_config(p, model, e.strategy, [f"data.root={root}", f"compile={bool(e.compile)}",
                                                     f"num_workers={workers}"])
            state.update(cfg=cfg, step=build_our_step(cfg, dev, p.precision, bool(e.compile)))
        return state
    try:
        synthetic = ctx.attempt("e2e", {**base, "path": "synthetic input"}, lambda: _e2e_synthetic(ctx, built()))
        state["synthetic"] = synthetic.get("images_per_s")  # also when an earlier run measured it
        ctx.attempt("e2e", {**base, "path": "CPU augmentation in workers"}, lambda: _e2e(ctx, built(), "workers"))
        ctx.attempt("e2e", {**base, "path": f"GpuMultiCrop on {dev.type}"}, lambda: _e2e(ctx, built(), "device"))
        if dev.type == "cuda":
            ctx.attempt("e2e", {**base, "path": "GpuMultiCrop, JPEGs decoded on the GPU (data.decode=gpu)"},
                        lambda: _e2e(ctx, built(), "device", "gpu"))
    finally:
        state.clear()
        _compile_cleanup(bool(e.compile))


def _e2e_synthetic(ctx, state) -> dict:
    from resmlp.data.crop_plan import crop_plan
    p, dev = ctx.p, ctx.device
    plan = crop_plan(state["cfg"])
    crops = synthetic_crops(plan, int(p.batch_size), dev)
    t, _ = time_step(state["step"], crops, dev, p)
    return {"images_per_s": int(p.batch_size) / t.seconds, "crops": plan.label(), "first_s": t.first_s,
            "mem_gb": peak_memory_gb(dev)}


def _e2e(ctx, state, where: str, decode: str = "cpu") -> dict:
    """Loader alone (views on the device, no step), then loader + step, images/s."""
    from omegaconf import OmegaConf

    from resmlp.data import build_dataset
    from resmlp.data.resumable import build_train_loader
    from resmlp.data.crop_plan import build_views, crop_plan
    p, e, dev, step = ctx.p, ctx.p.e2e, ctx.device, state["step"]
    cfg = OmegaConf.merge(state["cfg"], {"dino": {"augment": where}, "data": {"decode": decode}})
    batch = int(p.batch_size)
    views = build_views(cfg, crop_plan(cfg), out_dtype=AMP_DTYPES[p.precision] if dev.type == "cuda" else torch.float32,
                        device=dev)
    loader, sampler = build_train_loader(build_dataset(cfg.data, "train"), views.transform, batch, cfg.seed,
                                         cfg.num_workers, pin_memory=dev.type == "cuda", keyed=views.keyed,
                                         collate_fn=views.collate)

    def only(b):
        views.to_device(b, dev)
    loader_only = loader_rate(loader, sampler, only, int(e.warmup), int(e.steps), dev, batch)
    full = loader_rate(loader, sampler, lambda b: call_step(step, views.to_device(b, dev)), int(e.warmup),
                       int(e.steps), dev, batch)
    del loader
    synthetic = state.get("synthetic")
    out = {"images_per_s": full, "vs_synthetic": full / synthetic if synthetic else None,
           "loader_only_images_per_s": loader_only, "mem_gb": peak_memory_gb(dev)}
    if views.batch_augment is not None:
        out["aug"] = repr(views.batch_augment)
    return out


# --------------------------------------------------------------------------- inference

def inference_family(ctx) -> None:
    from resmlp.bench.reference import model_dims
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
    from resmlp.bench.reference import timm_resmlp
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
    from resmlp.bench.reference import timm_resmlp
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
        _compile_cleanup(comp)
    return {"images_per_s": int(q.batch_size) / t.seconds, "ms": 1e3 * t.seconds, "first_s": t.first_s,
            "spread": t.spread, "mem_gb": peak_memory_gb(dev)}


# --------------------------------------------------------------------------- k-NN

def knn_family(ctx) -> None:
    k = ctx.p.knn
    made: list = []

    def data():  # made once, by the first line an earlier run did not measure
        if not made:
            made.append(knn_features(k))
        return made[0]
    for backend in k.backends:
        ident = {"backend": str(backend), "n_train": int(k.n_train), "dim": int(k.dim), "k": int(k.k)}
        ctx.attempt("knn", ident, lambda: _knn_one(ctx, str(backend), data()))


def knn_features(k) -> tuple:
    """(train, train labels, test, test labels, classes) on the CPU for a profile's `knn`
    settings: clustered features, so that the vote has something to find (top-1 as a sanity
    check) and the search's rounds are those of the bench's line (bench/profile.py's k-NN
    phases search the same ones)."""
    n_train, n_test, dim, classes = int(k.n_train), int(k.n_test), int(k.dim), int(k.classes)
    g = torch.Generator().manual_seed(0)
    centroids = torch.randn(classes, dim, generator=g)
    train_y = torch.randint(classes, (n_train,), generator=g)
    train = torch.randn(n_train, dim, generator=g).mul_(3.0).add_(centroids[train_y])
    test_y = torch.randint(classes, (n_test,), generator=g)
    test = torch.randn(n_test, dim, generator=g).mul_(3.0).add_(centroids[test_y])
    return train, train_y, test, test_y, classes


_PASS_DTYPES = {"torch-fp16": torch.float16, "torch-bf16": torch.bfloat16, "torch-fp32": torch.float32}


@contextlib.contextmanager
def _pass_dtype(modules, device: torch.device, dtype):
    """The candidate pass in `dtype` on `device` for the block (None: its default) in each
    baseline module given: a copy of an earlier eval/knn_search.py loaded from its file, which
    may predate knn_search's `pass_dtype` argument (ours is handed that argument)."""
    old = [m._TorchSearch.DTYPES.get(device.type) for m in modules]
    for m in modules:
        if dtype is not None:
            m._TorchSearch.DTYPES[device.type] = dtype
    try:
        yield
    finally:
        for m, o in zip(modules, old):
            if o is None:
                m._TorchSearch.DTYPES.pop(device.type, None)
            else:
                m._TorchSearch.DTYPES[device.type] = o


def _knn_baseline(path):
    """Another eval/knn_search.py (e.g. an earlier commit's: `git show <commit>:eval/knn_search.py
    > /tmp/knn_before.py`), imported under its own name, or None."""
    if not path:
        return None
    import importlib.util
    spec = importlib.util.spec_from_file_location("knn_search_baseline", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _knn_one(ctx, backend: str, data) -> dict:
    train, train_y, test, test_y, classes = data
    k, dev = ctx.p.knn, ctx.device
    on_gpu = dev.type == "cuda"
    dtype = None
    if backend == "torch":
        where, name = dev, "torch"
    elif backend == "torch-device" or backend in _PASS_DTYPES:   # the features on the device, as the trainer's
        if backend == "torch-device" and not on_gpu:                # extraction leaves them
            raise Skip("no GPU")
        where, name, dtype = dev, "torch", _PASS_DTYPES.get(backend)
        train, test = train.to(dev), test.to(dev)
    elif backend in ("torch-raw", "torch-raw-bf16"):
        return _knn_raw(ctx, train, test, torch.bfloat16 if backend.endswith("bf16") else torch.float32)
    elif backend == "torch-pass":
        return _knn_pass(ctx, train, test)
    elif backend in ("faiss-gpu", "faiss-cpu"):
        try:
            import faiss  # noqa: F401
        except ImportError:
            raise Skip("faiss is not installed") from None
        if backend == "faiss-gpu":
            from resmlp.eval.knn_search import faiss_gpu_works
            if not on_gpu:
                raise Skip("no GPU")
            if not faiss_gpu_works(dev.index or 0):
                raise Skip("faiss's GPU index does not run (exactly) on this GPU")
            where, name = dev, "faiss"
        else:
            where, name = torch.device("cpu"), "faiss"
    else:
        raise ValueError(f"unknown k-NN backend {backend!r}; choose from torch, torch-device, torch-fp16, "
                         f"torch-bf16, torch-fp32, torch-pass, torch-raw, torch-raw-bf16, faiss-gpu, faiss-cpu")
    from resmlp.eval import knn_search as ours
    from resmlp.eval.knn import knn_classify
    n = test.shape[0] if where.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    base = _knn_baseline(k.baseline) if name == "torch" else None
    searches = {"ours": functools.partial(ours.knn_search, pass_dtype=dtype),
                **({"baseline": base.knn_search} if base else {})}
    scores = {}

    def classify(which):
        def run():
            scores[which] = knn_classify(train, train_y, test[:n], classes, k=int(k.k), temperature=0.07,
                                         backend=name, device=where, search=searches[which])
        return run
    # Warmed up on a small bank (the libraries, the allocator, the device), then timed on
    # the whole one: ours and the baseline's in alternating repeats (A B A B), the median.
    times = {which: [] for which in searches}
    with _pass_dtype([base] if base else [], where, dtype):
        for which in searches:
            knn_classify(train[:4096], train_y[:4096], test[:8], classes, k=int(k.k), backend=name, device=where,
                         search=searches[which])
        for _ in range(max(int(k.repeats), 2 if base else 1)):
            for which in searches:
                sync(dev)
                t0 = time.perf_counter()
                classify(which)()
                sync(dev)
                times[which].append(time.perf_counter() - t0)
    sec = statistics.median(times["ours"])
    top1 = float((scores["ours"].argmax(1) == test_y[:n]).float().mean() * 100)
    out = {"device": where.type, "queries": n, "seconds": sec, "seconds_full": sec * test.shape[0] / n,
           "queries_per_s": n / sec, "top1": top1, "mem_gb": peak_memory_gb(dev), "repeats": times["ours"]}
    if dtype is not None:
        out["pass_dtype"] = str(dtype).replace("torch.", "")
    if base:
        b = statistics.median(times["baseline"])
        out.update(baseline=str(k.baseline), baseline_seconds=b, baseline_repeats=times["baseline"],
                   vs_baseline=b / sec, same_as_baseline=bool(torch.equal(scores["ours"], scores["baseline"])))
    return out


def _knn_pass(ctx, train, test) -> dict:
    """knn_search's candidate pass alone (eval/knn_search.py _TorchSearch), features
    already on the device: all queries at the first pass's candidate count, its tiles and
    block maxima, no re-rank (what the exact path adds to it is the `torch-device` line
    minus this one). Also its tiles' matmuls alone (`matmul_s`) and with the block maxima
    (`maxima_s`): where the pass's time goes."""
    from resmlp.eval.knn_search import _pass_precision, _TorchSearch, first_candidates
    k, dev = ctx.p.knn, ctx.device
    n = test.shape[0] if dev.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    train, test = train.to(dev), test[:n].to(dev)
    search = _TorchSearch(train, dev)
    kc = first_candidates(int(k.k), search.tolerance(train.shape[1]), train.shape[0])
    rows, cols = search.tile(kc)
    unit = search.queries(test)[0]

    def tiles(maxima: bool):
        with torch.no_grad(), _pass_precision():
            for s in range(0, n, rows):
                for c in range(0, search.unit.shape[0], cols):
                    sims = unit[s:s + rows] @ search.unit[c:c + cols].T
                    if maxima:
                        sims.unfold(1, search.BLOCK, search.BLOCK).amax(2)
    repeats = max(1, int(k.repeats))
    stages = {name: measure(fn, dev, warmup=1, calls=1, repeats=repeats).seconds
              for name, fn in (("matmul_s", lambda: tiles(False)), ("maxima_s", lambda: tiles(True)))}
    t = measure(lambda: search(test, kc), dev, warmup=1, calls=1, repeats=repeats)
    return {"device": dev.type, "queries": n, "seconds": t.seconds, "seconds_full": t.seconds * k.n_test / n,
            "queries_per_s": n / t.seconds, "mem_gb": peak_memory_gb(dev), **stages,
            "note": f"{str(search.dtype).replace('torch.', '')} pass, {kc} candidates, tiles of {rows} x {cols}, "
                    f"no re-rank; matmuls alone {stages['matmul_s']:.3f} s, with the block maxima "
                    f"{stages['maxima_s']:.3f} s"}


def _knn_raw(ctx, train, test, dtype) -> dict:
    """The floor of the search alone: unit features already on the device, chunked matmul
    + topk in `dtype`, no exact re-ranking, no votes (what knn_search's candidate pass
    costs at best; bf16 candidates would need a wider margin before the exact re-rank)."""
    k, dev = ctx.p.knn, ctx.device
    n = test.shape[0] if dev.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    tr = torch.nn.functional.normalize(train.to(dev), dim=1).to(dtype)
    te = torch.nn.functional.normalize(test[:n].to(dev), dim=1).to(dtype)
    rows = max(1, min(4096, (1 << 30) // (4 * tr.shape[0])))

    def search():
        for s in range(0, n, rows):
            (te[s:s + rows] @ tr.T).topk(int(k.k), dim=1)
    t = measure(search, dev, warmup=1, calls=1, repeats=2)
    return {"device": dev.type, "queries": n, "seconds": t.seconds, "seconds_full": t.seconds * test.shape[0] / n,
            "queries_per_s": n / t.seconds, "mem_gb": peak_memory_gb(dev),
            "note": f"{str(dtype).replace('torch.', '')} matmul+topk, features on the device, no exact re-rank"}


# --------------------------------------------------------------------------- augmentation

def aug_family(ctx) -> None:
    """DINO's multi-crop augmentation: ours, lightly's and the GPU path's on the same images,
    per CPU core, then the GPU path on the device."""
    from resmlp.data.crop_plan import crop_plan
    from resmlp.data.decode import SourceDecoder, collate_sources, source_side
    a, p = ctx.p.aug, ctx.p
    cfg = dino_config(p, ctx.models[0], "subgrid")
    plan = crop_plan(cfg)
    rng = np.random.default_rng(1)
    sides = rng.integers(int(a.min_px), int(a.max_px) + 1, (int(a.n_images), 2))
    images = [synthetic_image(int(w), int(h), i) for i, (w, h) in enumerate(sides)]
    few = images[:max(1, int(a.cpu_images))]
    side = source_side(cfg.data)  # what the trainer's loader delivers
    source = SourceDecoder(side)
    sources = collate_sources([(source(im), 0, i) for i, im in enumerate(images[:int(a.batch_size)])])
    batch, sizes = sources.images, sources.sizes

    per_core = _cpu_transforms(ctx, cfg, plan, few, source, side, batch[:len(few)], sizes[:len(few)])
    _time_per_core(ctx, per_core, max(3, int(p.repeats)))
    if ctx.device.type == "cuda":
        for interp in a.interpolation:
            for comp in a.device_compile:
                ident = {"impl": f"GpuMultiCrop {interp} {'compile' if comp else 'eager'}", "where": "cuda",
                         "threads": None, "crops": plan.label()}
                ctx.attempt("aug", ident, lambda: _gpu_aug_rate(ctx, plan, cfg, batch, sizes, str(interp),
                                                                 bool(comp), ctx.device))


def _cpu_transforms(ctx, cfg, plan, few, source, side, xb, sb) -> dict:
    """key -> (identity, callable over the images, number of images): every transform the
    CPU runs, over the same images (`few` as PIL images, `xb`/`sb` as the loader's sources)."""
    from resmlp.data import build_multicrop_transform
    from resmlp.data.gpu_augment import GpuMultiCrop
    label = plan.label()
    per_core = {}
    ours = build_multicrop_transform(cfg.data, plan.global_size, plan.local_size, plan.n_local,
                                     plan.global_scale, plan.local_scale)
    per_core["ours"] = ({"impl": "ours CPU (build_multicrop_transform)", "crops": label}, _over(ours, few), len(few))
    try:
        lightly_t = _lightly_dino(plan, cfg.data)
        per_core["lightly"] = ({"impl": "lightly DINOTransform", "crops": label}, _over(lightly_t, few), len(few))
    except Skip as e:
        _skipped(ctx, "aug", {"impl": "lightly DINOTransform", "where": "cpu", "threads": 1, "crops": label}, e)
    per_core["source"] = ({"impl": f"SourceDecoder({side}) of a PIL image (GPU path's loader side)",
                           "crops": "-"}, _over(source, few), len(few))
    for interp in ctx.p.aug.interpolation:
        aug = GpuMultiCrop.from_plan(plan, cfg.data, interpolation=str(interp))
        per_core[f"gpu_{interp}"] = ({"impl": f"GpuMultiCrop {interp} eager", "crops": label},
                                     lambda aug=aug: aug(xb, seed=0, sizes=sb), len(xb))
    return per_core


def _time_per_core(ctx, per_core: dict, repeats: int) -> None:
    """Per CPU core: the transforms timed in alternating repeats, a line each."""
    timed, failure = _interleaved_on_one_core({k: v[1] for k, v in per_core.items()}, repeats)
    lines = {key: (ident, n) for key, (ident, _, n) in per_core.items()}
    _attempt_each(ctx, "aug", lines, timed, failure,
                  lambda key, t: {"images_per_s": lines[key][1] / t.seconds, "per_core": True, "spread": t.spread,
                                  "interleaved": True})


def _interleaved_on_one_core(calls: dict, repeats: int) -> tuple[dict, Exception | None]:
    """({key: timing}, None), or what stopped the timing: `calls` timed in alternating
    repeats on one CPU thread."""
    try:
        with threads(1):
            torch.manual_seed(0)
            return measure_interleaved(calls, torch.device("cpu"), warmup=1, calls=1, repeats=repeats), None
    except Exception as e:  # noqa: BLE001 - reported on every line
        return {}, e


def _attempt_each(ctx, family: str, lines: dict, timed: dict, failure, fields) -> None:
    """A line of `family` per key of `lines` ({key: (identity, ...)}), on one CPU thread:
    fields(key, its timing), or the failure that left it untimed."""
    for key, (ident, *_) in lines.items():
        def line(key=key):
            if key not in timed:
                raise failure
            return fields(key, timed[key])
        ctx.attempt(family, {**ident, "where": "cpu", "threads": 1}, line)


def _lightly_dino(plan, data_cfg):
    """lightly's DINOTransform with the crops of `plan` (Skip without lightly)."""
    from resmlp.data.transforms import mean_std
    need_lightly()
    from lightly.transforms import DINOTransform
    mean, std = mean_std(data_cfg)
    return DINOTransform(global_crop_size=plan.global_size, global_crop_scale=plan.global_scale,
                         local_crop_size=plan.local_size, local_crop_scale=plan.local_scale,
                         n_local_views=plan.n_local, normalize={"mean": list(mean), "std": list(std)})


def _skipped(ctx, family: str, ident: dict, skip: Exception) -> None:
    """The line `ident` of `family`, skipped for `skip`'s reason."""
    reason = str(skip)

    def skipped():
        raise Skip(reason)
    ctx.attempt(family, ident, skipped)


def _over(transform, images):
    def all_images():
        for im in images:
            transform(im)
    return all_images


def _gpu_aug_rate(ctx, plan, cfg, batch_u8, sizes, interp: str, comp: bool, device, n_threads=None) -> dict:
    from resmlp.data.gpu_augment import GpuMultiCrop
    aug = GpuMultiCrop.from_plan(plan, cfg.data, interpolation=interp, compile=comp)
    x, s = batch_u8.to(device), sizes.to(device)
    reset_memory(device)
    try:
        calls = 1 if device.type == "cpu" else int(ctx.p.steps)
        with threads(n_threads):
            t = measure(lambda: aug(x, seed=0, sizes=s), device, warmup=2 if comp else 1, calls=calls,
                        repeats=int(ctx.p.repeats))
    finally:
        _compile_cleanup(comp)
    return {"images_per_s": x.shape[0] / t.seconds, "batch": int(x.shape[0]), "first_s": t.first_s,
            "per_core": n_threads == 1, "spread": t.spread, "mem_gb": peak_memory_gb(device)}


# --------------------------------------------------------------------------- loader

def loader_family(ctx) -> None:
    """What one loader worker does per image, on one core: ours (the DINO device path's
    SourceDecoder + collate, with data.decode=cpu and gpu; the fast eval transform)
    against the reference (PIL decode + DINO's per-image multi-crop, as lightly's
    DINOTransform implements DataAugmentationDINO; PIL decode + DINO's eval transform),
    interleaved on the same JPEG files. Each line has the load average it ran under."""
    q = ctx.p.loader
    root = tempfile.mkdtemp(prefix="resmlp_bench_loader_")
    try:
        ident = {"impl": "write JPEGs", "where": "cpu", "image": f"{q.width}x{q.height} q{q.quality}"}
        files: dict = {}
        if ctx.attempt("loader", ident, lambda: _write_loader_files(q, root, files), restorable=False)["status"] != "ok":
            return
        _loader_lines(ctx, q, root, files)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _write_loader_files(q, root: str, files: dict) -> dict:
    """n JPEGs of width x height (half of them turned to portrait) at the given quality."""
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    sizes = []
    for i in range(int(q.n_images)):
        w, h = (int(q.width), int(q.height)) if i % 2 == 0 else (int(q.height), int(q.width))
        path = os.path.join(root, "train", f"c{i % 2}", f"{i:05d}.jpg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        synthetic_image(w, h, int(rng.integers(2**31))).save(path, quality=int(q.quality))
        sizes.append(os.path.getsize(path))
    for c in range(2):
        os.makedirs(os.path.join(root, "val", f"c{c}"), exist_ok=True)
        synthetic_image(64, 48, c).save(os.path.join(root, "val", f"c{c}", "0.jpg"), quality=int(q.quality))
    files["kb"] = float(np.mean(sizes)) / 1024
    return {"images": int(q.n_images), "mean_kb": files["kb"], "write_s": time.perf_counter() - t0}


def _loader_lines(ctx, q, root: str, files: dict) -> None:
    """What a loader worker does per image, per CPU core: ours (the DINO device path's and
    data.decode=gpu's), the reference's, and the eval transforms, timed in alternating repeats."""
    from resmlp.core.config import load_config
    from resmlp.data.crop_plan import crop_plan
    cfg = load_config("dino", "resmlp_s12", ["demo=false", "data=imagefolder", f"data.root={root}",
                                              f"data.img_size={int(q.img_size)}", f"data.local_size={int(q.local_size)}",
                                              f"dino.n_local_crops={int(q.n_local)}", "dino.local_crops=interpolate",
                                              f"model.patch_size={int(q.patch_size)}"])
    plan = crop_plan(cfg)
    n, batch = int(q.n_images), int(q.batch_size)
    image = f"{q.width}x{q.height} q{q.quality}"

    def over(dataset, collate):
        """Fetch and collate every image in batches, as a loader worker does."""
        def run():
            for start in range(0, n, batch):
                collate([dataset[k] for k in range(start, min(n, start + batch))])
        return run

    # key -> (identity, callable over all n images, the key it is compared with)
    lines = {**_train_loaders(ctx, cfg, plan, over, image), **_eval_loaders(cfg, over)}
    lines = {key: ({**ident, "image": image}, run, versus) for key, (ident, run, versus) in lines.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    timed, failure = _interleaved_on_one_core({k: v[1] for k, v in lines.items()}, max(3, int(q.repeats)))
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def fields(key, t):
        out = {"images_per_s": n / t.seconds, "per_core": True, "spread": t.spread, "interleaved": True,
               "mean_kb": files["kb"], "load_avg": [load, after]}
        versus = lines[key][2]
        if versus in timed:
            out["vs_reference"] = timed[versus].seconds / t.seconds
        return out
    _attempt_each(ctx, "loader", lines, timed, failure, fields)


def _train_loaders(ctx, cfg, plan, over, image: str) -> dict:
    """The DINO training loaders: ours (device path, data.decode=gpu) and the reference's."""
    from torch.utils.data import default_collate

    from resmlp.data import build_dataset
    from resmlp.data.crop_plan import build_views
    from resmlp.data.decode import SourceDecoder, source_side
    from resmlp.data.imagefolder import serve_encoded
    from resmlp.data.resumable import KeyedDataset
    lines = {}
    views = build_views(cfg, plan)
    ds = build_dataset(cfg.data, "train")
    serve_encoded(ds)  # as build_train_loader does for a transform that reads files
    lines["ours"] = ({"impl": f"ours, DINO device path: {views.transform!r} + collate", "crops": plan.label()},
                     over(KeyedDataset(ds, views.transform), views.collate), "reference")
    deferred = SourceDecoder(source_side(cfg.data), defer_jpeg=True)  # what data.decode=gpu's workers run
    lines["ours_gpu"] = ({"impl": f"ours, data.decode=gpu: {deferred!r} + collate (decoded on the GPU later)",
                          "crops": plan.label()}, over(KeyedDataset(ds, deferred), views.collate), "reference")
    try:
        dino = _lightly_dino(plan, cfg.data)
        lines["reference"] = ({"impl": "reference: PIL decode + DataAugmentationDINO (lightly DINOTransform) "
                                       "+ collate", "crops": plan.label()},
                              over(build_dataset(cfg.data, "train", transform=dino), default_collate), None)
    except Skip as e:
        _skipped(ctx, "loader", {"impl": "reference: lightly DINOTransform", "where": "cpu", "threads": 1,
                                 "image": image}, e)
    return lines


def _eval_loaders(cfg, over) -> dict:
    """The evaluation loaders: ours and DINO's eval transform."""
    from torch.utils.data import default_collate
    from torchvision import transforms as T

    from resmlp.data import build_dataset, build_eval_transform
    from resmlp.data.transforms import mean_std
    mean, std = mean_std(cfg.data)
    size = int(cfg.data.img_size)
    resize = int(round(size / float(cfg.data.crop_ratio)))
    ref_eval = T.Compose([T.Resize(resize, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size),
                          T.ToTensor(), T.Normalize(mean, std)])
    return {"eval": ({"impl": "ours, eval transform (fast decode, torchvision on uint8) + collate", "crops": "-"},
                     over(build_dataset(cfg.data, "train", transform=build_eval_transform(cfg.data)),
                          default_collate), "eval_reference"),
            "eval_reference": ({"impl": "reference: PIL decode + DINO's eval transform (Resize, CenterCrop, "
                                        "ToTensor, Normalize) + collate", "crops": "-"},
                               over(build_dataset(cfg.data, "train", transform=ref_eval), default_collate), None)}
