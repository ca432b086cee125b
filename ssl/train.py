"""DINO pretraining of a ResMLP: `bash run.sh dino resmlp_s12 [key=value ...]`.

Read top to bottom: config -> data -> student/teacher -> schedules -> loop -> k-NN.
The shared pieces (process group, run dir, checkpoints, logs) live in resmlp.core.
"""
from __future__ import annotations

import os
import signal
import time

import torch
from omegaconf import OmegaConf

from resmlp.core import dist
from resmlp.core.checkpoint import rng_state, set_rng_state
from resmlp.core.engine import Run, command, progress
from resmlp.core.errors import UserError
from resmlp.core.optim import param_groups
from resmlp.core.schedules import cosine_schedule, linear_warmup_then_constant
from resmlp.data import build_dataset, build_multicrop_transform, num_classes, train_split_for_ssl
from resmlp.data.gpu_augment import GpuMultiCrop, default_fixed_size, uint8_fixed_size
from resmlp.data.resumable import build_train_loader
from resmlp.models.from_config import build_model
from resmlp.ssl.health import collapse_warning, teacher_stats
from resmlp.ssl.multicrop import MultiCropNet, build_head
from resmlp.ssl.step import DinoStep

STRATEGIES = ("resize", "interpolate", "subgrid", "none")
# Fault injection for the resume test: the process kills itself after this iteration.
KILL_AT_ENV = "RESMLP_KILL_AT_ITERATION"


def crop_plan(cfg) -> dict:
    """Sizes, counts and scales of the crops for the chosen local-crop strategy."""
    d = cfg.dino
    if d.augment not in ("device", "workers"):
        raise UserError(f"dino.augment={d.augment!r} is not one of device, workers")
    if d.local_crops not in STRATEGIES:
        raise UserError(f"dino.local_crops={d.local_crops!r} is not one of {', '.join(STRATEGIES)}")
    g = cfg.data.img_size
    plan = {"global_size": g, "local_size": d.local_size, "n_local": d.n_local_crops,
            "global_scale": tuple(d.global_crops_scale), "local_scale": tuple(d.local_crops_scale)}
    if d.local_crops == "resize":
        plan["local_size"] = g
    elif d.local_crops == "none":
        plan.update(n_local=0, global_scale=tuple(d.none_global_crops_scale))
    if plan["n_local"] and plan["local_size"] % cfg.model.patch_size:
        raise UserError(f"dino.local_size={plan['local_size']} is not a multiple of model.patch_size="
                        f"{cfg.model.patch_size}")
    return plan


def build_networks(cfg, device):
    """Student and teacher: same backbone + head; the teacher is a separate build that
    loads the student's weights (lightly's weight-normed head cannot be deep-copied)."""
    student_backbone = build_model(cfg.model, num_classes=0)
    teacher_cfg = OmegaConf.merge(cfg.model, {"drop_path_rate": 0.0})
    teacher_backbone = build_model(teacher_cfg, num_classes=0)
    if cfg.dino.local_crops in ("interpolate", "subgrid"):
        if not hasattr(student_backbone, "grid_adapt"):
            raise UserError(f"dino.local_crops={cfg.dino.local_crops} needs a ResMLP backbone; "
                            f"use resize or none for {cfg.model.name}")
        student_backbone.grid_adapt = cfg.dino.local_crops
    dim = student_backbone.num_features
    student = MultiCropNet(student_backbone, build_head(dim, cfg.dino)).to(device)
    teacher = MultiCropNet(teacher_backbone, build_head(dim, cfg.dino)).to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher


def knn_report(run, teacher_backbone, cfg, tag: str, linear: bool = False) -> dict:
    """k-NN (k=20, DINO's protocol) and optionally a linear probe of the teacher's features."""
    from resmlp.eval.knn import online_knn
    k, temp = 20, float(cfg.knn.temperature)
    res = online_knn(teacher_backbone, cfg.data, run.device, ks=(k,), temperature=temp,
                     batch_size=max(1, cfg.knn.batch_size // run.world_size), num_workers=cfg.num_workers,
                     backend=cfg.knn.backend, amp_dtype=run.amp_dtype, keep_features=linear)
    out = {"knn_top1": res["knn_top1"], "knn_top5": res["knn_top5"], "knn_k": k, "knn_T": temp}
    run.print(f"[{tag}] knn top1={out['knn_top1']:.2f} top5={out['knn_top5']:.2f} (k={k}, T={temp:g})")
    if linear:
        lin = {}
        if run.is_main:
            from resmlp.eval.linear import train_linear_on_features
            (trf, trl), (tef, tel) = res["features"]["train"], res["features"]["test"]
            lin = train_linear_on_features(trf, trl, tef, tel, num_classes(cfg.data))
            run.print(f"[{tag}] linear top1={lin['top1']:.2f} top5={lin['top5']:.2f} "
                      f"(cached features, best lr {lin['lr']:g})")
        lin = dist.broadcast_object(lin)
        out.update(linear_top1=lin["top1"], linear_top5=lin["top5"], linear_lr=lin["lr"])
    return out


def train(cfg):
    """Run DINO and return (run, student, teacher, results). `run(cfg)` is the CLI entry."""
    demo = bool(cfg.demo)
    run = Run(cfg)
    if demo:
        run.print(f"CPU demo: a small ResMLP (dim {cfg.model.dim}, depth {cfg.model.depth}) on {cfg.data.subset} "
                  f"{cfg.data.name} images for {cfg.epochs} epochs, "
                  "to show the pipeline learns. The real run needs a GPU: on one, `bash run.sh dino "
                  "resmlp_s12` trains the full preset; demo=false forces it here.")
    device = run.device

    # ---- data: multi-crop views of the training split -----------------------------------
    # augment=device: workers only decode to a uint8 square; the crops and the photometric
    # augmentations run on whole batches on the device (the CPU cannot keep up with a GPU).
    plan = crop_plan(cfg)
    on_device = cfg.dino.augment == "device"
    if on_device:
        batch_augment = GpuMultiCrop.from_plan(plan, cfg.data)
        transform = uint8_fixed_size(default_fixed_size(plan["global_size"]))
    else:
        transform = build_multicrop_transform(cfg.data, plan["global_size"], plan["local_size"], plan["n_local"],
                                              plan["global_scale"], plan["local_scale"])
    dataset = build_dataset(cfg.data, train_split_for_ssl(cfg.data))
    loader, sampler = build_train_loader(dataset, transform, run.batch_per_rank, cfg.seed, cfg.num_workers,
                                         pin_memory=device.type == "cuda", keyed=on_device)
    ipe = sampler.batches_per_epoch
    n_crops = 2 + plan["n_local"]

    # ---- networks, loss, optimizer -------------------------------------------------------
    from lightly.loss import DINOLoss
    student, teacher = build_networks(cfg, device)
    loss_fn = DINOLoss(cfg.dino.out_dim, student_temp=cfg.dino.student_temp,
                       center_momentum=cfg.dino.center_momentum,
                       warmup_teacher_temp_epochs=0).to(device)
    optimizer = torch.optim.AdamW(param_groups(student), lr=0.0, weight_decay=0.0)
    raw_student = student
    if run.world_size > 1:
        student = torch.nn.parallel.DistributedDataParallel(
            student, device_ids=[device.index] if device.type == "cuda" else None)
    step = DinoStep(student, teacher, loss_fn, optimizer, run.scaler, n_crops, cfg.optim.clip_grad,
                    run.autocast)
    if cfg.compile:
        step.forward_student, step.forward_teacher = torch.compile(student), torch.compile(teacher)

    # ---- schedules, per iteration ---------------------------------------------------------
    E, o = cfg.epochs, cfg.optim
    lr_sched = cosine_schedule(o.lr * cfg.batch_size / 256, o.min_lr, E, ipe, o.warmup_epochs)
    wd_sched = cosine_schedule(o.weight_decay, o.weight_decay_end, E, ipe)
    m_sched = cosine_schedule(cfg.dino.momentum_teacher, 1.0, E, ipe)
    t_sched = linear_warmup_then_constant(cfg.dino.warmup_teacher_temp, cfg.dino.teacher_temp,
                                          cfg.dino.warmup_teacher_temp_epochs, E, ipe)

    # ---- resume ---------------------------------------------------------------------------
    start_it, results = 0, {}
    state = run.resume_state()
    if state is not None:
        raw_student.load_state_dict(state["student"])
        teacher.load_state_dict(state["teacher"])
        optimizer.load_state_dict(state["optimizer"])
        loss_fn.center.copy_(state["center"].to(device))
        run.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        start_it = state["iteration"]
        results = state.get("results", {})
    elif demo or cfg.eval_every:
        results["init"] = knn_report(run, teacher.backbone, cfg, "teacher at init")

    def checkpoint(iteration: int):
        run.save({"student": raw_student.state_dict(), "teacher": teacher.state_dict(),
                  "optimizer": optimizer.state_dict(), "center": loss_fn.center.detach().cpu(),
                  "scaler": run.scaler.state_dict(), "epoch": iteration // ipe, "iteration": iteration,
                  "rng": rng_state(), "results": results})

    kill_at = int(os.environ.get(KILL_AT_ENV, "0"))
    run.print(f"DINO {cfg.model.name} on {cfg.data.name}: {len(dataset)} images, {E} epochs x {ipe} "
              f"iterations, global batch {cfg.batch_size} on {run.world_size} x {device.type}, crops "
              f"2x{plan['global_size']}px + {plan['n_local']}x{plan['local_size']}px ({cfg.dino.local_crops}), "
              f"run dir {run.dir}")

    # ---- the loop -------------------------------------------------------------------------
    it = start_it
    train_started, eval_seconds = time.time(), 0.0
    for epoch in range(start_it // ipe, E):
        sampler.set_epoch(epoch, start_batch=it - epoch * ipe)
        student.train()
        epoch_entropy, t0, seen_since = [], time.time(), 0
        bar = progress(loader, total=len(sampler) // run.batch_per_rank, desc=f"epoch {epoch + 1}/{E}",
                       enabled=run.interactive)
        for batch in bar:
            if on_device:
                images, _, keys = batch
                crops = batch_augment(images.to(device, non_blocking=True), seed=cfg.seed, keys=keys.to(device))
            else:
                crops = [c.to(device, non_blocking=True) for c in batch[0]]
            loss, t_out, center = step(crops, lr_sched[it], wd_sched[it], m_sched[it], t_sched[it], epoch)
            run.check_finite(loss, f"epoch {epoch + 1}, iteration {it + 1}")
            it += 1
            seen_since += cfg.batch_size

            stats = teacher_stats(t_out, center, float(t_sched[it - 1]))
            epoch_entropy.append(stats["teacher_entropy"])
            if run.interactive:
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if it % cfg.log_every == 0 or it == E * ipe:
                dt = time.time() - t0
                record = {"epoch": it / ipe, "iteration": it, "loss": loss.item(),
                          "lr": lr_sched[it - 1], "wd": wd_sched[it - 1], "momentum": m_sched[it - 1],
                          "teacher_temp": t_sched[it - 1], **stats, "images_per_s": seen_since / max(dt, 1e-9),
                          "peak_mem_mb": run.peak_memory_mb()}
                run.log(record, step=it)
                if not run.interactive:
                    run.print(f"ep {epoch + 1}/{E} it {it}/{E * ipe} loss {record['loss']:.4f} "
                              f"lr {record['lr']:.2e} wd {record['wd']:.3f} m {record['momentum']:.4f} "
                              f"T_t {record['teacher_temp']:.3f} H_t {stats['teacher_entropy']:.2f} "
                              f"KL {stats['teacher_kl_mean']:.3f} {record['images_per_s']:.0f} img/s")
                t0, seen_since = time.time(), 0
            if cfg.ckpt_every and it % cfg.ckpt_every == 0 and it % ipe:
                checkpoint(it)
            if kill_at and it == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        warning = collapse_warning(sum(epoch_entropy) / max(1, len(epoch_entropy)), cfg.dino.out_dim)
        if warning and epoch_entropy:
            run.print(f"warning: {warning}")
        last = epoch + 1 == E
        if cfg.eval_every and (epoch + 1) % cfg.eval_every == 0 and not last:
            eval_started = time.time()
            res = knn_report(run, teacher.backbone, cfg, f"epoch {epoch + 1}")
            eval_seconds += time.time() - eval_started
            run.log({"epoch": epoch + 1, **res}, step=it)
        checkpoint(it)

    if cfg.save_rank_weights:  # to check that DDP kept the ranks in step
        torch.save({"student": raw_student.state_dict(), "teacher": teacher.state_dict()},
                   run.dir / f"weights_rank{run.rank}.pth")
    train_seconds = time.time() - train_started - eval_seconds
    images_per_s = (it - start_it) * cfg.batch_size / max(train_seconds, 1e-9)
    final = knn_report(run, teacher.backbone, cfg, "teacher after training", linear=cfg.dino.final_linear)
    run.log({"epoch": E, **final}, step=it)
    results["final"] = final
    if "init" in results and run.is_main:
        gain = final["knn_top1"] - results["init"]["knn_top1"]
        run.print(f"k-NN top-1: {results['init']['knn_top1']:.2f} at init -> {final['knn_top1']:.2f} "
                  f"after {E} epochs ({gain:+.2f})")
    if run.is_main:
        top1, top5 = final["knn_top1"], final["knn_top5"]
        print(f"knn top1={top1:.2f} top5={top5:.2f} (k=20, T={float(cfg.knn.temperature):g})")
    summary = run.finish({"command": "dino", "model": cfg.model.name, "data": cfg.data.name,
                          "epochs": E, "demo": demo, "local_crops": cfg.dino.local_crops,
                          "params": sum(p.numel() for p in teacher.backbone.parameters()),
                          "train_images_per_s": round(images_per_s, 1), "peak_mem_mb": run.peak_memory_mb(),
                          **{f"init_{k}": v for k, v in results.get("init", {}).items()}, **final})
    return run, raw_student, teacher, summary


run = command(train)  # the CLI's entry: resmlp.core.cli calls run(cfg)
