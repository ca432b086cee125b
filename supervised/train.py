"""Supervised training: from scratch, DeiT distillation, or fine-tuning a DINO backbone.

    bash run.sh supervised resmlp_s12 [key=value ...]     # any timm model too: supervised regnety_016
    bash run.sh distill resmlp_s12 teacher=<run dir | checkpoint | timm:<name>>
    bash run.sh finetune <DINO run dir | checkpoint>

One loop for the three commands (cfg.command), read top to bottom: data -> networks and
the step (supervised/step.py: mixup, loss, optimizer, EMA) -> schedule -> resume -> loop ->
test-split evaluation. The recipe is
the paper's (Sec. 3.1): LAMB, lr 5e-3 x batch/512, weight decay 0.2, and otherwise DeiT's
defaults, all from timm's parts: RandAugment, mixup / cutmix, random erasing, label
smoothing, stochastic depth, repeated augmentation, model EMA. The shared pieces (process
group, run dir, precision, checkpoints, logs) live in resmlp.core, as for DINO.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from timm.data import create_transform

from resmlp.core import dist
from resmlp.core.compile_cache import open_compile_cache
from resmlp.core.compiling import uncompiled
from resmlp.core.cadence import Cadence
from resmlp.core.run import Run, command, progress
from resmlp.core.errors import UserError
from resmlp.core.optim import scaled_lr
from resmlp.core.schedules import cosine_schedule
from resmlp.core.weights import FORMS, WeightsSpec
from resmlp.data import build_dataset, build_eval_transform, build_loader, mean_std
from resmlp.data.datasets import fit_demo_subset, require_classes
from resmlp.data.resumable import build_train_loader
from resmlp.models.from_config import build_model
from resmlp.supervised.distill import distillation_loss, load_teacher
from resmlp.supervised.repeat_aug import build_repeat_aug_loader
from resmlp.supervised.step import build_supervised_step, layer_decay

COMMANDS = ("supervised", "distill", "finetune")
__all__ = ["train", "run", "distillation_loss", "build_networks", "evaluate"]


# ---- data ----------------------------------------------------------------------------------

def posterize_keep_bits(img, bits_to_keep, **_):
    """timm's posterize, with 0 bits meaning a black image (what Pillow < 11 did).

    RandAugment 'inc1' at magnitude 10 (m9, mstd 0.5 reaches it ~2% of the time) asks
    PosterizeIncreasing for 0 bits, which current Pillow rejects with a ValueError that
    stops the run; older Pillow, under which DeiT's recipe was made, returned black."""
    from PIL import Image, ImageOps
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


def build_train_transform(cfg):
    """timm's DeiT training transform on RGB PIL images (RandomResizedCrop bicubic, flip,
    RandAugment, normalize, random erasing). Works at 32 px as at 224."""
    a = cfg.aug
    mean, std = mean_std(cfg.data)
    transform = create_transform(input_size=cfg.data.img_size, is_training=True, scale=tuple(a.scale),
                                 hflip=a.hflip, color_jitter=a.color_jitter, auto_augment=a.auto_augment or None,
                                 interpolation=a.interpolation, mean=mean, std=std, re_prob=a.re_prob,
                                 re_mode=a.re_mode, re_count=a.re_count)
    for t in getattr(transform, "transforms", []):
        for op in getattr(t, "ops", None) or getattr(t, "policy", None) or []:
            for o in (op if isinstance(op, (list, tuple)) else [op]):
                if str(getattr(o, "name", "")).startswith("Posterize"):
                    o.aug_fn = posterize_keep_bits
    return transform


def build_train_data(cfg, run):
    """(training split, its loader, its resumable sampler), with repeated augmentation
    when aug.repeats > 1."""
    dataset = build_dataset(cfg.data, "train")
    transform = build_train_transform(cfg)
    pin = run.device.type == "cuda"
    if cfg.aug.repeats > 1:
        loader, sampler = build_repeat_aug_loader(dataset, transform, run.batch_per_rank, cfg.aug.repeats,
                                                  cfg.seed, cfg.num_workers, pin_memory=pin)
    else:
        loader, sampler = build_train_loader(dataset, transform, run.batch_per_rank, cfg.seed, cfg.num_workers,
                                             pin_memory=pin)
    return dataset, loader, sampler


# ---- networks -------------------------------------------------------------------------------

def init_from_checkpoint(model: nn.Module, cfg) -> dict:
    """Fine-tuning: copy the checkpoint's backbone (DINO: the `teacher` network's backbone.*)
    into `model`; the head stays new. A backbone that does not fit is a UserError."""
    from resmlp.models.load import describe, load_backbone, load_into
    spec = WeightsSpec.parse(cfg.checkpoint)
    backbone, info = load_backbone(spec, key=cfg.finetune.key, device="cpu", img_size=cfg.data.img_size)
    load_into(model, backbone.state_dict(), f"{spec} ({describe(info)}) is not a backbone {cfg.model.name} "
              "can take", ignore_head=True)
    return {"checkpoint": spec.text, "source": info.get("source"), "key": info.get("key"),
            "checkpoint_epoch": info.get("epoch"), "weights_hash": info.get("weights_hash")}


def build_networks(cfg, n_classes: int, device):
    """(classifier, teacher or None, info): what the command trains, on `device`.

    supervised: a new model; distill: a new model and the frozen teacher; finetune: the
    model with its backbone from cfg.checkpoint and a new head for the data's classes.
    """
    model = build_model(cfg.model, num_classes=n_classes)
    teacher, info = None, {}
    if cfg.command == "finetune":
        info["init"] = init_from_checkpoint(model, cfg)
    if cfg.command == "distill":
        d = cfg.distill
        teacher, info["teacher"] = load_teacher(WeightsSpec.parse(d.teacher), n_classes, cfg.data.name,
                                                cfg.data.img_size, device, teacher_model=d.teacher_model)
    return model.to(device), teacher, info


# ---- evaluation ------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, loader, device, autocast) -> dict:
    """Top-1 / top-5 (%) on the loader's images, summed over every process's shard."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # top-1 hits, top-5 hits, images
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast(), uncompiled():  # `compile` compiles the training step only
            logits = model(images)
        k = min(5, logits.shape[-1])
        top = logits.float().topk(k, dim=-1).indices
        hit = top == labels[:, None]
        counts += torch.stack([hit[:, 0].sum(), hit.any(dim=1).sum(), torch.tensor(len(labels), device=device)])
    dist.all_reduce_sum(counts)
    model.train(was_training)
    n = max(1.0, counts[2].item())
    return {"top1": 100.0 * counts[0].item() / n, "top5": 100.0 * counts[1].item() / n, "n_test": int(counts[2])}


def build_test_loader(cfg, run):
    ds = build_dataset(cfg.data, "test", build_eval_transform(cfg.data))
    if cfg.eval_limit and cfg.eval_limit < len(ds):
        step = len(ds) / cfg.eval_limit  # evenly spaced: every class when the split is ordered by class
        ds = torch.utils.data.Subset(ds, [int(i * step) for i in range(cfg.eval_limit)])
    return build_loader(ds, dist.share(cfg.eval_batch_size), train=False, num_workers=cfg.num_workers, seed=cfg.seed)


# ---- the command -----------------------------------------------------------------------------

DEMO_TEXT = {
    "supervised": "a small {m} on {n} training images at {px} px for {e} epochs",
    "distill": "a small {m} distilled on {n} training images at {px} px for {e} epochs",
    "finetune": "fine-tuning {m} on {n} training images at {px} px for {e} epochs",
}


def check_inputs(cfg) -> None:
    if cfg.command not in COMMANDS:
        raise UserError(f"resmlp.supervised.train serves {', '.join(COMMANDS)}, not {cfg.command!r}")
    if cfg.command == "distill" and not cfg.distill.teacher:
        raise UserError(f"distill needs a teacher: teacher={FORMS}")
    if cfg.command == "finetune" and not cfg.checkpoint:
        raise UserError("finetune needs a checkpoint: bash run.sh finetune <DINO run dir | checkpoint>")


def step_budget(cfg, n_images: int, ipe: int) -> tuple[dict, str | None]:
    """The loop's epochs, warm-up, evaluation and checkpoint cadence (in epochs), and the
    line that says why they differ from cfg's, or None.

    Fine-tuning a set so small that cfg.epochs make fewer than finetune.min_steps optimizer
    steps trains that many steps instead: the epochs grow, and the warm-up, evaluations and
    checkpoints with them, so the schedule keeps its shape. The config stays as asked (its
    config.yaml, what a rerun compares); results.json says what ran."""
    plan = {"epochs": int(cfg.epochs), "warmup_epochs": float(cfg.optim.warmup_epochs),
            "eval_every": int(cfg.eval_every), "ckpt_epochs": int(cfg.ckpt_epochs)}
    least = int(cfg.finetune.min_steps) if cfg.command == "finetune" else 0
    asked = plan["epochs"] * ipe
    if asked >= least:
        return plan, None
    epochs = -(-least // ipe)
    stretch = epochs / plan["epochs"]
    plan.update(epochs=epochs, warmup_epochs=plan["warmup_epochs"] * stretch,
                eval_every=max(1, round(plan["eval_every"] * stretch)) if plan["eval_every"] else 0,
                ckpt_epochs=max(1, round(plan["ckpt_epochs"] * stretch)))
    return plan, (f"{n_images} training images make {ipe} steps of batch {cfg.batch_size} an epoch: {cfg.epochs} "
                  f"epochs would be {asked} optimizer steps, under finetune.min_steps={least}; training {epochs} "
                  f"epochs ({epochs * ipe} steps, warm-up and evaluations stretched alike; finetune.min_steps=0 keeps "
                  f"{cfg.epochs})")


def demo_text(cfg, n_images: int, epochs: int) -> str:
    from resmlp.models import list_models
    size = (f" (dim {cfg.model.dim}, depth {cfg.model.depth})"
            if cfg.model.name in list_models() and cfg.model.dim else "")
    what = DEMO_TEXT[cfg.command].format(m=cfg.model.name + size, n=n_images, e=epochs, px=cfg.data.img_size)
    a = cfg.aug
    light = not a.auto_augment and not (a.mixup or a.cutmix)
    return (f"CPU demo: {what}, to show the pipeline learns"
            + (f"; the recipe is lightened for so few epochs (lr {cfg.optim.lr:g} for batch "
               f"{cfg.optim.lr_batch}, weight decay {cfg.optim.weight_decay:g}, no RandAugment / mixup / "
               f"cutmix: they pay off only over long schedules; see configs/method/{cfg.command}.yaml)"
               if light else "")
            + f". The real run needs a GPU: on one, `bash run.sh {cfg.command} ...` trains the full preset; "
            "demo=false forces it here.")


def describe_run(cfg, run, n_params: int, n_images: int, n_classes: int, epochs: int, ipe: int, base_lr: float) -> str:
    what = ("from scratch" if cfg.command == "supervised" else f"fine-tuned from {cfg.checkpoint}"
            if cfg.command == "finetune" else f"distilled ({cfg.distill.type}) from {cfg.distill.teacher}")
    decay = layer_decay(cfg)
    return (f"{cfg.command} {cfg.model.name} ({n_params / 1e6:.2f}M params) {what} on {cfg.data.name}: "
            f"{n_images} images, {n_classes} classes, {epochs} epochs x {ipe} iterations, global batch "
            f"{cfg.batch_size} on {run.world_size} x {run.device.type}, {cfg.optim.opt} lr {base_lr:.2e}"
            + (f", layer decay {decay}" if decay else "") + f", run dir {run.dir}")


def report_test_split(run, step, test_loader, epoch: int) -> dict:
    """Top-1 / top-5 on the test split of the model (and of its EMA), printed."""
    res = evaluate(step.raw_model, test_loader, run.device, run.autocast)
    if step.ema is not None:
        e = evaluate(step.ema.module, test_loader, run.device, run.autocast)
        res.update(ema_top1=e["top1"], ema_top5=e["top5"])
    res["epoch"] = epoch
    run.print(f"[epoch {epoch}] test top1={res['top1']:.2f} top5={res['top5']:.2f}"
              + (f" (EMA top1={res['ema_top1']:.2f})" if step.ema is not None else "") + f" on {res['n_test']} images")
    return res


def train(cfg):
    """Train as cfg.command says; return (run, model, results). `run(cfg)` is the CLI entry."""
    check_inputs(cfg)
    fitted = fit_demo_subset(cfg)
    run = Run(cfg)
    device = run.device

    # ---- data: augmented training split, plain test split ---------------------------------
    n_classes = require_classes(cfg.data, f"{cfg.command}'s top-1")
    dataset, loader, sampler = build_train_data(cfg, run)
    ipe = sampler.batches_per_epoch
    plan, stretched = step_budget(cfg, len(dataset), ipe)
    E = plan["epochs"]
    if cfg.demo:
        run.print(demo_text(cfg, len(dataset), E) + (f" ({fitted})" if fitted else ""))
    if stretched:
        run.print(stretched)
    test_loader = build_test_loader(cfg, run)

    # ---- the step: networks, mixup, loss, EMA, optimizer; the lr schedule per iteration ----
    model, teacher, info = build_networks(cfg, n_classes, device)
    n_params = sum(p.numel() for p in model.parameters())
    step = build_supervised_step(cfg, model, teacher, n_classes, run)
    for line in run.start_lines(step.path):  # the device, precision; compiled how, and why not
        run.print(line)
    o = cfg.optim
    base_lr = scaled_lr(o, cfg.batch_size)
    lr_sched = cosine_schedule(base_lr, o.min_lr, E, ipe, plan["warmup_epochs"], o.warmup_lr)

    # ---- resume ---------------------------------------------------------------------------------
    state = {"model": model, "optimizer": step.optimizer, "ema": step.ema, "scaler": run.scaler}
    start_it, results = run.restore(**state)
    results.setdefault("history", [])
    cadence = Cadence(run, ipe, start_it, results, {**state, "num_classes": n_classes}, tally=step.tally, plan=plan)
    run.print(describe_run(cfg, run, n_params, len(dataset), n_classes, E, ipe, base_lr))
    compile_cache = open_compile_cache(cfg, run, (step.model,))

    # ---- the loop ---------------------------------------------------------------------------------
    it = start_it
    for epoch in range(start_it // ipe, E):
        sampler.set_epoch(epoch, start_batch=it - epoch * ipe)
        step.model.train()
        bar = progress(loader, total=len(sampler) // run.batch_per_rank, desc=f"epoch {epoch + 1}/{E}",
                       enabled=run.interactive)
        for images, labels in bar:
            step(images.to(device, non_blocking=True), labels.to(device, non_blocking=True), lr_sched[it], it)
            it += 1
            cadence.count(cfg.batch_size)
            # <- sync point across ranks, on the host, once per iteration (Cadence.agree): log_due asks
            #    when its clock decides, else after_iteration; a stop signal on any rank stops all there
            if cadence.log_due(it):  # <- sync point: the device tally comes to the host
                log_line(run, {**cadence.log_record(it), "lr": lr_sched[it - 1]}, bar,
                         f"ep {epoch + 1}/{E} it {it}/{E * ipe}")
                compile_cache.save()  # what the step compiled since the last save (core/compile_cache.py)
            if cadence.checkpoint_due(it):  # <- sync point
                cadence.checkpoint(it)
            cadence.after_iteration(it)

        cadence.read(it)  # <- sync point: the epoch's remaining steps
        end_epoch(run, cadence, step, test_loader, results, epoch + 1, E, it, lr_sched[it - 1])  # <- sync point
        cadence.checkpoint(it)

    # ---- the end: test split, results --------------------------------------------------------
    final = final_test(run, step, test_loader, results, E, it)
    summary = run.finish(summarize(cfg, E, ipe, results["history"], final, bool(cfg.demo), n_params, n_classes, len(dataset),
                                   cadence.timing_report()["train_images_per_s"], run, info, step.ema)
                         | {"path": step.path.record()})
    if run.is_main:
        print(result_line(cfg, summary), flush=True)
    return run, model, summary


def log_line(run, record: dict, bar, where: str) -> None:
    """A log record into log.jsonl and TensorBoard, shown as the progress bar's loss or as a
    printed line after `where`."""
    run.log(record, step=record["iteration"])
    if run.interactive:
        bar.set_postfix(loss=f"{record['loss']:.3f}")
    else:
        run.print(f"{where} loss {record['loss']:.4f} lr {record['lr']:.2e} {record['images_per_s']:.0f} img/s")


def end_epoch(run, cadence, step, test_loader, results: dict, epoch: int, epochs: int, it: int, lr: float) -> None:
    """An epoch's record: its mean training loss and, every eval_every epochs, top-1 on the
    test split (kept in results' history), logged and printed."""
    mean_loss = cadence.epoch.take().get("loss", float("nan"))
    record = {"epoch": epoch, "iteration": it, "train_loss": mean_loss, "lr": lr}
    if cadence.eval_due(epoch):  # <- sync point: the test split
        res = report_test_split(run, step, test_loader, epoch)
        results["history"].append(res)
        record.update({k: v for k, v in res.items() if k != "epoch"})
    run.log(record, step=it)
    run.print(f"epoch {epoch}/{epochs}: train loss {mean_loss:.4f}")


def final_test(run, step, test_loader, results: dict, epochs: int, it: int) -> dict:
    """Top-1 on the test split after the last epoch, the last entry of results' history
    (in place of an evaluation of that epoch a resumed run may already hold), logged."""
    final = report_test_split(run, step, test_loader, epochs)
    results["history"] = [h for h in results["history"] if h["epoch"] != epochs] + [final]
    run.log({k: v for k, v in final.items()}, step=it)
    return final


def result_line(cfg, summary: dict) -> str:
    """The command's result on one line of stdout (what a script greps)."""
    return (f"{cfg.command} top1={summary['top1']:.2f} top5={summary['top5']:.2f} "
            f"(best top1={summary['best_top1']:.2f} at epoch {summary['best_epoch']}; {cfg.model.name}, "
            f"{summary['epochs']} epochs, {cfg.data.name} test split, {summary['wall_time_s']:.0f} s)")


def summarize(cfg, epochs: int, ipe: int, history: list[dict], final: dict, demo: bool, n_params: int, n_classes: int,
              n_images: int, images_per_s: float | None, run, info: dict, ema) -> dict:
    """results.json of a finished run (run.finish adds the wall time and the device):
    `epochs` and `steps` as trained (step_budget)."""
    best = max(history, key=lambda h: h["top1"])
    return {"command": cfg.command, "model": cfg.model.name, "data": cfg.data.name, "epochs": epochs,
            "steps": epochs * ipe,
            "demo": demo, "params": n_params, "num_classes": n_classes, "train_images": n_images,
            "batch_size": cfg.batch_size, "top1": final["top1"], "top5": final["top5"], "n_test": final["n_test"],
            "best_top1": best["top1"], "best_epoch": best["epoch"], "last_epoch": epochs,
            "images_per_s": round(images_per_s, 1) if images_per_s else None,
            **run.memory_mb(), **info,
            **({"ema_top1": final["ema_top1"], "ema_top5": final["ema_top5"]} if ema is not None else {}),
            **({"layer_decay": cfg.finetune.layer_decay, "min_steps": cfg.finetune.min_steps}
               if cfg.command == "finetune" else {}),
            **({"distill_type": cfg.distill.type} if cfg.command == "distill" else {})}


run = command(train)  # the CLI's entry: resmlp.core.cli calls run(cfg)
