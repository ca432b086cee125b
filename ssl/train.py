"""DINO pretraining of a ResMLP: `bash run.sh dino resmlp_s12 [key=value ...]`.

Read top to bottom: config -> data -> student/teacher -> schedules -> loop -> k-NN.
The shared pieces (process group, run dir, checkpoints, logs) live in resmlp.core.
"""
from __future__ import annotations

import os
import signal
import time

import torch

from resmlp.core import dist
from resmlp.core.checkpoint import rng_state, set_rng_state
from resmlp.core.engine import Run, command, progress
from resmlp.core.errors import UserError
from resmlp.core.schedules import cosine_schedule, linear_warmup_then_constant
from resmlp.data import build_dataset, build_multicrop_transform, num_classes, train_split_for_ssl
from resmlp.data.gpu_augment import GpuMultiCrop, default_fixed_size, uint8_fixed_size
from resmlp.data.resumable import build_train_loader
from resmlp.ssl.health import collapse_warning
from resmlp.ssl.step import build_dino_step

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


def knn_report(run, teacher_backbone, cfg, tag: str, linear: bool = False) -> dict:
    """k-NN (k=20, DINO's protocol) and optionally a linear probe of the teacher's features."""
    from resmlp.eval.knn import online_knn
    k, temp = 20, float(cfg.knn.temperature)
    res = online_knn(teacher_backbone, cfg.data, run.device, ks=(k,), temperature=temp,
                     batch_size=max(1, cfg.knn.batch_size // run.world_size), num_workers=cfg.num_workers,
                     backend=cfg.knn.backend, amp_dtype=run.amp_dtype or torch.float32, keep_features=linear)
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
        # Crops in the step's autocast dtype: the first layer would cast them anyway.
        batch_augment = GpuMultiCrop.from_plan(plan, cfg.data, compile=bool(cfg.compile),
                                               out_dtype=run.amp_dtype or torch.float32)
        transform = uint8_fixed_size(default_fixed_size(plan["global_size"]))
    else:
        transform = build_multicrop_transform(cfg.data, plan["global_size"], plan["local_size"], plan["n_local"],
                                              plan["global_scale"], plan["local_scale"])
    dataset = build_dataset(cfg.data, train_split_for_ssl(cfg.data))
    loader, sampler = build_train_loader(dataset, transform, run.batch_per_rank, cfg.seed, cfg.num_workers,
                                         pin_memory=device.type == "cuda", keyed=on_device)
    ipe = sampler.batches_per_epoch

    # ---- networks, loss, optimizer: the step the benchmark times ---------------------------
    step = build_dino_step(cfg, device, run.scaler, run.autocast, run.world_size)
    student, raw_student, teacher = step.student, step.raw_student, step.teacher
    loss_fn, optimizer = step.loss_fn, step.optimizer

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
    run.reset_peak_memory()  # the peak of training, not of the k-NN's feature extraction

    # Device-side tallies (loss, teacher health, non-finite flag) are read only here: at log
    # lines, checkpoints and epoch ends. These are the loop's only host-device syncs.
    since_log, epoch_tally = Tally(), Tally()
    last_read = {"iteration": start_it}

    def read(iteration: int) -> None:
        values = step.read()  # <- sync
        if values["nonfinite"]:
            run.stop_nonfinite(values["last_loss"], f"an iteration in {last_read['iteration'] + 1}.."
                                                    f"{iteration} (epoch {iteration // ipe + 1})")
        last_read["iteration"] = iteration
        since_log.add(values)
        epoch_tally.add(values)

    def checkpoint(iteration: int):
        read(iteration)  # never save weights that a non-finite loss may have reached
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
        epoch_tally.reset()
        t0, seen_since = time.time(), 0
        bar = progress(loader, total=len(sampler) // run.batch_per_rank, desc=f"epoch {epoch + 1}/{E}",
                       enabled=run.interactive)
        for batch in bar:
            if on_device:
                images, _, keys = batch
                crops = batch_augment(images.to(device, non_blocking=True), seed=cfg.seed,
                                      keys=keys.to(device, non_blocking=True))
            else:
                crops = [c.to(device, non_blocking=True) for c in batch[0]]
            step(crops, lr_sched[it], wd_sched[it], m_sched[it], t_sched[it], epoch)
            it += 1
            seen_since += cfg.batch_size

            if it % cfg.log_every == 0 or it == E * ipe:
                read(it)
                dt = time.time() - t0
                stats = since_log.means()
                record = {"epoch": it / ipe, "iteration": it, **stats,
                          "lr": lr_sched[it - 1], "wd": wd_sched[it - 1], "momentum": m_sched[it - 1],
                          "teacher_temp": t_sched[it - 1], "images_per_s": seen_since / max(dt, 1e-9),
                          "elapsed_s": round(time.time() - run.started, 1), **run.memory_mb()}
                run.log(record, step=it)
                since_log.reset()
                if run.interactive:
                    bar.set_postfix(loss=f"{stats['loss']:.3f}")
                else:
                    run.print(f"ep {epoch + 1}/{E} it {it}/{E * ipe} loss {stats['loss']:.4f} "
                              f"lr {record['lr']:.2e} wd {record['wd']:.3f} m {record['momentum']:.4f} "
                              f"T_t {record['teacher_temp']:.3f} H_t {stats['teacher_entropy']:.2f} "
                              f"KL {stats['teacher_kl_mean']:.3f} {record['images_per_s']:.0f} img/s")
                t0, seen_since = time.time(), 0
            if cfg.ckpt_every and it % cfg.ckpt_every == 0 and it % ipe:
                checkpoint(it)
            if kill_at and it == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        read(it)
        entropy = epoch_tally.means().get("teacher_entropy")
        warning = collapse_warning(entropy, cfg.dino.out_dim) if entropy is not None else None
        if warning:
            run.print(f"warning: {warning}")
        last = epoch + 1 == E
        if cfg.eval_every and (epoch + 1) % cfg.eval_every == 0 and not last:
            eval_started = time.time()
            res = knn_report(run, teacher.backbone, cfg, f"epoch {epoch + 1}")
            eval_seconds += time.time() - eval_started
            run.log({"epoch": epoch + 1, **res, "elapsed_s": round(time.time() - run.started, 1)}, step=it)
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
                          "train_images_per_s": round(images_per_s, 1), **run.memory_mb(),
                          **{f"init_{k}": v for k, v in results.get("init", {}).items()}, **final})
    return run, raw_student, teacher, summary


class Tally:
    """Host-side sums of what DinoStep.read() returned, weighted by its steps."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums, self.steps = {}, 0

    def add(self, values: dict) -> None:
        n = values["steps"]
        for k, v in values.items():
            if k not in ("steps", "nonfinite", "last_loss"):
                self.sums[k] = self.sums.get(k, 0.0) + v * n
        self.steps += n

    def means(self) -> dict:
        return {k: v / self.steps for k, v in self.sums.items()} if self.steps else {}


run = command(train)  # the CLI's entry: resmlp.core.cli calls run(cfg)
