"""DINO pretraining of a ResMLP: `bash run.sh dino resmlp_s12 [key=value ...]`.

Read top to bottom: data and views -> the step (student, teacher, loss, optimizer) ->
schedules -> resume -> the loop -> k-NN of the teacher. The pieces have a file each in
this folder (networks, head, loss, ema, step, health); the crop plan is data's
(resmlp.data.crop_plan); what every trainer shares (process group, run dir, checkpoints,
logs, cadence) lives in resmlp.core.engine.
"""
from __future__ import annotations

import time

import torch

from resmlp.core import dist
from resmlp.core.config import as_list
from resmlp.core.engine import Cadence, Run, command, progress, run_dir
from resmlp.core.optim import scaled_lr
from resmlp.core.schedules import cosine_schedule, linear_warmup_then_constant
from resmlp.data import build_dataset, num_classes, train_split_for_ssl
from resmlp.data.crop_plan import build_views, crop_plan
from resmlp.data.datasets import eval_data, fit_demo_subset, no_labels_note, one_class_problem
from resmlp.data.folder import FileLists
from resmlp.data.resumable import build_train_loader
from resmlp.eval.knn import check_ks
from resmlp.eval.memory import pixel_baseline
from resmlp.ssl.health import CollapseWatch, collapse_kl, collapse_warning, drift_advice
from resmlp.ssl.init import continuing
from resmlp.ssl.networks import DinoHooks
from resmlp.ssl.step import build_dino_step


DEMO_TEXT = ("CPU demo: a small ResMLP (dim {c.model.dim}, depth {c.model.depth}, patch {c.model.patch_size}) on {n} "
             "{c.data.name} images at {c.data.img_size} px for {c.epochs} epochs, to show the pipeline learns. The real "
             "run needs a GPU: on one, `bash run.sh dino resmlp_s12` trains the full preset; demo=false forces it here.")
# A log line's values after "ep <epoch> it <iteration>", from the record run.log writes.
LOG_LINE = ("loss {loss:.4f} lr {lr:.2e} wd {wd:.3f} m {momentum:.4f} T_t {teacher_temp:.3f} H_t {teacher_entropy:.2f} "
            "KL {teacher_kl_mean:.3f} {images_per_s:.0f} img/s")


def knn_report(run, teacher_backbone, cfg, tag: str, linear: bool = False, cache: dict | None = None,
               picture_step: int | None = None, few_labels: bool = False) -> dict:
    """k-NN (knn.k, DINO's protocol) and optionally a linear probe of the teacher's features;
    with picture_step (and dino.tensorboard_neighbours) the neighbours grid goes to TensorBoard;
    with few_labels (and knn.n_per_class) the k-NN on knn.tries banks of n images per class too.
    cache: the run's dict of eval images kept between calls (eval.knn.online_knn). The images
    are eval_data's: the training set, or the labeled set eval.data names."""
    from resmlp.eval.knn import online_knn
    from resmlp.eval.low_shot import sizes
    temp = float(cfg.knn.temperature)
    picture = picture_step is not None and bool(cfg.dino.tensorboard_neighbours)
    data = eval_data(cfg)
    few = few_labels and bool(sizes(cfg.knn.n_per_class))
    res = online_knn(teacher_backbone, data, run.device, ks=as_list(cfg.knn.k), temperature=temp,
                     batch_size=cfg.features.batch_size, num_workers=cfg.num_workers,
                     backend=cfg.knn.backend, amp_dtype=run.amp_dtype or torch.float32,
                     keep_features=linear or picture or few, cache=cache, memory_gb=cfg.features.memory_gb)
    k = res["knn_k"]
    out = {"knn_top1": res["knn_top1"], "knn_top5": res["knn_top5"], "knn_k": k, "knn_T": temp}
    run.print(f"[{tag}] knn top1={out['knn_top1']:.2f} top5={out['knn_top5']:.2f} (k={k}, T={temp:g})")
    if picture and run.is_main:
        from resmlp.eval.neighbours import online_grid
        run.log_image("knn_neighbours", online_grid(res, data, f"teacher, {tag}: k-NN top-1 "
                                                    f"{out['knn_top1']:.2f}", seed=int(cfg.seed),
                                                    backend=cfg.knn.backend), picture_step)
    if few:
        out["knn_low_shot"] = dist.broadcast_object(knn_few_labels(run, res, cfg, tag) if run.is_main else None)
    if linear:
        lin = {}
        if run.is_main:
            from resmlp.eval.linear import train_linear_on_features
            (trf, trl), (tef, tel) = res["features"]["train"], res["features"]["test"]
            lin = train_linear_on_features(trf, trl, tef, tel, num_classes(data))
            run.print(f"[{tag}] linear top1={lin['top1']:.2f} top5={lin['top5']:.2f} "
                      f"(cached features, best lr {lin['lr']:g})")
        lin = dist.broadcast_object(lin)
        out.update(linear_top1=lin["top1"], linear_top5=lin["top5"], linear_lr=lin["lr"])
    return out


def knn_few_labels(run, res: dict, cfg, tag: str) -> dict:
    """knn_report's few-label k-NN (rank 0) on the features online_knn kept: printed as a
    table, returned for results.json."""
    from resmlp.eval.knn import format_low_shot, knn_low_shot
    (trf, trl), (tef, tel) = res["features"]["train"], res["features"]["test"]
    few = knn_low_shot(trf, trl, tef, tel, res["num_classes"], as_list(cfg.knn.k), float(cfg.knn.temperature),
                       cfg.knn.n_per_class, int(cfg.knn.tries), int(cfg.seed), cfg.knn.backend, device=run.device,
                       class_names=getattr(res["datasets"]["train"], "classes", None))
    run.print(f"[{tag}] " + format_low_shot(few, res["knn"], res["n_train"]))
    return few


def build_data(cfg, run, plan, lists: FileLists | None = None):
    """(the views of `plan`, the training split, its loader, its resumable sampler); `lists`:
    the run's folder scans (data=folder)."""
    views = build_views(cfg, plan, out_dtype=run.amp_dtype or torch.float32, device=run.device)
    dataset = build_dataset(cfg.data, train_split_for_ssl(cfg.data), lists=lists)
    loader, sampler = build_train_loader(dataset, views.transform, run.batch_per_rank, cfg.seed, cfg.num_workers,
                                         pin_memory=run.device.type == "cuda", keyed=views.keyed,
                                         collate_fn=views.collate)
    return views, dataset, loader, sampler


def train(cfg, hooks: DinoHooks | None = None):
    """Run DINO and return (run, student, teacher, results). `run(cfg)` is the CLI entry;
    `hooks` are a study's extension points (ssl.networks.DinoHooks)."""
    hooks = hooks or DinoHooks()
    demo = bool(cfg.demo)
    judge = eval_data(cfg)  # the labeled set the k-NN and linear probe read (None: no labels)
    lists = FileLists(run_dir(cfg))  # a folder is scanned once per run dir: a resumed run reads its list
    fitted = fit_demo_subset(cfg, lists)
    run = Run(cfg)
    device = run.device
    start = continuing(cfg, run, hooks)  # dino.init: where the weights start (ssl/init.py), checked first

    # ---- data: the multi-crop views of the training split ----------------------------------
    plan = crop_plan(cfg)
    views, dataset, loader, sampler = build_data(cfg, run, plan, lists)
    if hooks.views:
        hooks.views(views, cfg)
    ipe = sampler.batches_per_epoch
    # the k-NN's bank is the train split of the labeled set (eval_data): its k must fit before
    # any work; without one the run reports its health only
    if judge is not None:
        check_ks(cfg.knn.k, len(dataset) if judge is cfg.data and train_split_for_ssl(cfg.data) == "train" else
                 len(build_dataset(judge, "train")))
    if demo:
        run.print(DEMO_TEXT.format(c=cfg, n=len(dataset)) + (f" ({fitted})" if fitted else ""))
    no_labels = no_labels_note(cfg) if judge is None else None
    # DINO needs no labels, so one class is a valid training set; only its k-NN says nothing
    one_class = one_class_problem(judge, "the teacher's k-NN (and linear) accuracy") if judge is not None else None
    for note in (no_labels, one_class):
        if note:
            run.print(f"warning: {note}")

    # ---- the step: student, teacher, loss, optimizer (what the benchmark times too) --------
    step = build_dino_step(cfg, plan, device, run.scaler, run.autocast, run.world_size, hooks, start)
    if hooks.step:
        hooks.step(step, cfg)
    student, teacher = step.student, step.teacher

    # ---- schedules, per iteration ---------------------------------------------------------
    E, o = cfg.epochs, cfg.optim
    lr_sched = cosine_schedule(scaled_lr(o, cfg.batch_size), o.min_lr, E, ipe, o.warmup_epochs)
    wd_sched = cosine_schedule(o.weight_decay, o.weight_decay_end, E, ipe)
    m_sched = cosine_schedule(cfg.dino.momentum_teacher, 1.0, E, ipe)
    t_sched = linear_warmup_then_constant(cfg.dino.warmup_teacher_temp, cfg.dino.teacher_temp,
                                          cfg.dino.warmup_teacher_temp_epochs, E, ipe)

    # ---- resume, or the k-NN at init ----------------------------------------------------------
    collapse = CollapseWatch(collapse_kl(cfg.dino), cfg.dino.collapse_patience, drift_advice(cfg.dino))
    state = {"student": step.raw_student, "teacher": teacher, "optimizer": step.optimizer,
             "center": step.loss_fn.center, "scaler": run.scaler, "collapse": collapse}
    start_it, results = run.restore(**state)
    if start is not None and not start_it:
        results["init_from"] = start.record()
        run.print(describe_start(start))
    lists.save()  # the folder's list, into the run dir that exists now
    knn_images = {}  # the eval images, loaded and transformed once for every k-NN of the run
    cadence = Cadence(run, ipe, start_it, results, state, tally=step.tally)
    with cadence.evaluating():
        if judge is not None and not start_it and (demo or cfg.eval_every or start is not None):
            results["init"] = knn_report(run, teacher.backbone, cfg, "teacher at init", cache=knn_images,
                                         picture_step=0 if cfg.eval_every else None)
            run.log({"epoch": 0, **results["init"]}, step=0)  # the k-NN curve in log.jsonl starts here
        if judge is not None and demo and "pixels" not in results:  # the bar features must clear: the same k-NN on raw pixels
            pixels = pixel_baseline(judge, cfg.data.img_size, cfg.features.memory_gb, device)  # sized to the memory
            if pixels.line:
                run.print(pixels.line)
            if pixels.side is not None:
                results["pixels"] = {**knn_report(run, pixels.model(), cfg, "raw pixels", cache=knn_images),
                                     "side": pixels.side}
    run.reset_peak_memory()  # the peak of training, not of the k-NN's feature extraction

    judged = "" if judge is None or judge is cfg.data else f", judged on {judge.name} ({judge.root or 'found'})"
    run.print(f"DINO {cfg.model.name} on {cfg.data.name}{judged}: {len(dataset)} images, {E} epochs x {ipe} iterations, global "
              f"batch {cfg.batch_size} on {run.world_size} x {device.type}, crops {plan.label()} px "
              f"({plan.strategy}, made on the {cfg.dino.augment}), run dir {run.dir}")

    # ---- the loop -------------------------------------------------------------------------
    it = start_it
    for epoch in range(start_it // ipe, E):
        sampler.set_epoch(epoch, start_batch=it - epoch * ipe)
        student.train()
        bar = progress(loader, total=len(sampler) // run.batch_per_rank, desc=f"epoch {epoch + 1}/{E}",
                       enabled=run.interactive)
        for batch in bar:
            crops = views.to_device(batch, device)
            step(crops, lr_sched[it], wd_sched[it], m_sched[it], t_sched[it], epoch)
            it += 1
            cadence.count(cfg.batch_size)

            if cadence.log_due(it):  # <- sync point: the device tally comes to the host
                record = cadence.log_record(it)
                record.update(lr=lr_sched[it - 1], wd=wd_sched[it - 1], momentum=m_sched[it - 1],
                              teacher_temp=t_sched[it - 1])
                run.log(record, step=it)
                if run.interactive:
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
                else:
                    koleo = f" KoLeo {record['koleo']:.3f}" if "koleo" in record else ""
                    run.print(f"ep {epoch + 1}/{E} it {it}/{E * ipe} " + LOG_LINE.format(**record) + koleo)
                warning = collapse.update(record["teacher_kl_mean"])
                if warning:
                    run.print(f"warning: {warning}")
            if cadence.checkpoint_due(it):  # <- sync point
                cadence.checkpoint(it)
            cadence.after_iteration(it)

        cadence.read(it)  # <- sync point: the epoch's remaining steps
        entropy = cadence.epoch.take().get("teacher_entropy")
        warning = collapse_warning(entropy, cfg.dino.out_dim) if entropy is not None else None
        if warning:
            run.print(f"warning: {warning}")
        warmed = start is not None and epoch + 1 == start.warmup_epochs  # the head warm-up ends here
        if judge is not None and (cadence.eval_due(epoch + 1) or warmed):  # <- sync point: the k-NN
            with cadence.evaluating():
                res = knn_report(run, teacher.backbone, cfg, f"epoch {epoch + 1}", cache=knn_images,
                                 picture_step=it)
            run.log({"epoch": epoch + 1, **res, "elapsed_s": round(time.time() - run.started, 1)}, step=it)
            if warmed:
                results["after_warmup"] = res
        cadence.checkpoint(it)

    # ---- the end: the teacher's k-NN (and linear probe) on the test split ---------------------
    if cfg.save_rank_weights:  # to check that DDP kept the ranks in step
        torch.save({"student": step.raw_student.state_dict(), "teacher": teacher.state_dict()},
                   run.dir / f"weights_rank{run.rank}.pth")
    final = {}
    if judge is not None:
        with cadence.evaluating(final=True):
            final = knn_report(run, teacher.backbone, cfg, "teacher after training", linear=cfg.dino.final_linear,
                               cache=knn_images,
                               picture_step=it if cfg.eval_every else None, few_labels=True)
        run.log({"epoch": E, **final}, step=it)
    results["final"], results["eval_data"] = final, judge.name if judge is not None else None
    for note in (no_labels, one_class):
        if note:
            results["warning"] = note
            run.print(f"warning: {note}")
    # summed over every start: a finished run resumed again keeps its rate
    summary = run.finish(summarize(run, cfg, results, teacher, cadence.timing_report()["train_images_per_s"]))
    return run, step.raw_student, teacher, summary


def summarize(run, cfg, results: dict, teacher, images_per_s: float) -> dict:
    """Print the k-NN from init to the end (and raw pixels' beside it); results.json's
    fields (run.finish adds the wall time and the device)."""
    init, final = results.get("init"), results["final"]
    if init and final and run.is_main:
        side = results.get("pixels", {}).get("side", cfg.data.img_size)
        pixels = (f"; raw pixels on the same bank: {results['pixels']['knn_top1']:.2f}"
                  + (f" (at {side} px)" if side != cfg.data.img_size else "") if "pixels" in results else "")
        warm = results.get("after_warmup")
        warm = f"{warm['knn_top1']:.2f} after the head warm-up -> " if warm else ""
        run.print(f"k-NN top-1: {init['knn_top1']:.2f} at init -> {warm}{final['knn_top1']:.2f} after {cfg.epochs} "
                  f"epochs ({final['knn_top1'] - init['knn_top1']:+.2f}){pixels}")
    if final and run.is_main:
        print(f"knn top1={final['knn_top1']:.2f} top5={final['knn_top5']:.2f} "
              f"(k={final['knn_k']}, T={float(cfg.knn.temperature):g})")
    return {"command": "dino", "model": cfg.model.name, "data": cfg.data.name, "epochs": cfg.epochs,
            "demo": bool(cfg.demo), "local_crops": cfg.dino.local_crops,
            **({"init_from": results["init_from"]} if "init_from" in results else {}),
            **{f"after_warmup_{k}": v for k, v in results.get("after_warmup", {}).items()},
            "params": sum(p.numel() for p in teacher.backbone.parameters()),
            "train_images_per_s": round(images_per_s, 1), **run.memory_mb(),
            **{f"init_{k}": v for k, v in results.get("init", {}).items()},
            **{f"pixels_{k}": v for k, v in results.get("pixels", {}).items()}, **final,
            "eval_data": results.get("eval_data"),
            **({"warning": results["warning"]} if "warning" in results else {})}


def describe_start(start) -> str:
    """One line: where the weights came from and how the run continues them."""
    info = start.info or {}
    grid = info.get("grid")
    where = f"{info.get('source')}" + (f", epoch {info['epoch']}" if info.get("epoch") is not None else "") + \
        (f", patch grid {grid[0][0]}x{grid[0][1]} adapted to {grid[1][0]}x{grid[1][1]}" if grid else "")
    head = ("its DINO head" if start.head_loaded else
            f"a new head, first {start.warmup_epochs} epoch(s) alone on the frozen backbone" if start.warmup_epochs
            else "a new head (no warm-up)")
    return (f"continuing from {start.spec} ({where}; weights {info.get('weights_hash')}): {head}; the backbone at "
            f"{start.lr_scale:g} x the learning rate")


run = command(train)  # the CLI's entry: resmlp.core.cli calls run(cfg)
