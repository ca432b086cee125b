"""The bench's data rows: `aug`, DINO's multi-crop augmentation (ours, lightly's and the GPU
path's on the same images, per CPU core, then the GPU path on the device), and `loader`, what
one loader worker does per image on one core (read, decode, per-image work, collate) on
ImageNet-like JPEG files: the DINO device path's and the eval transform's, against the
reference DINO transform and eval transform on the same files, timed in alternating repeats.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import torch

from bench.jpegs import synthetic_image
from bench.step import Skip, compile_cleanup, dino_config, need_lightly
from bench.timing import measure, measure_interleaved, peak_memory_gb, reset_memory, threads

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
        compile_cleanup(comp)
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
