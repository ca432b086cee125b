"""The bench's e2e row: the trainer's data path feeding the trainer's step, from a folder of
photo-like JPEGs written here, for each place the views can be made (the CPU multi-crop in
the loader's workers; whole decoded images cropped on the device; on a GPU also decoded
there), against the same step on synthetic crops.
"""
from __future__ import annotations

import shutil
import tempfile
import time

import torch
from omegaconf import OmegaConf

from bench.jpegs import make_jpeg_folder
from bench.step import build_our_step, call_step, compile_cleanup, dino_config, ours, synthetic_crops, time_step
from bench.timing import peak_memory_gb, reset_memory, sync
from resmlp.core.dist import AMP_DTYPES, cpu_cores

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
    e = ctx.p.e2e
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
        compile_cleanup(bool(e.compile))


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
    from resmlp.data import build_dataset
    from resmlp.data.resumable import build_train_loader
    from resmlp.data.crop_plan import build_views, crop_plan
    p, e, dev, step = ctx.p, ctx.p.e2e, ctx.device, state["step"]
    cfg = OmegaConf.merge(state["cfg"], {"dino": {"augment": where}, "data": {"decode": decode}})
    batch = int(p.batch_size)
    views = build_views(cfg, crop_plan(cfg), out_dtype=AMP_DTYPES[p.precision] if dev.type == "cuda" else torch.float32,
                        device=dev, path=step.path)
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
