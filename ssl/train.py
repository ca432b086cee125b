"""DINO pretraining of a ResMLP: `bash run.sh dino resmlp_s12 [key=value ...]`.

Read top to bottom: data and views -> the step (student, teacher, loss, optimizer) ->
schedules -> resume -> the loop -> k-NN of the teacher. The pieces have a file each in
this folder (networks, head, loss, ema, step, health; init: continuing from weights); the
crop plan is data's (resmlp.data.crop_plan); the k-NN that judges the teacher, at init,
during and after training, is eval's (resmlp.eval.judge), called at the loop's sync points;
what every trainer shares lives in core/: the process group, run dir, checkpoints and logs
in resmlp.core.run, the loop's cadence in resmlp.core.cadence.
"""
from __future__ import annotations

import torch

from resmlp.core.checkpoint import atomic_write
from resmlp.core.compile_cache import open_compile_cache
from resmlp.core.cadence import Cadence
from resmlp.core.run import Run, command, progress
from resmlp.core.run_folder import run_dir
from resmlp.data import build_dataset, train_split_for_ssl
from resmlp.data.crop_plan import build_views, crop_plan
from resmlp.data.datasets import fit_demo_subset
from resmlp.data.folder import FileLists
from resmlp.data.resumable import build_train_loader
from resmlp.eval.judge import build_judge
from resmlp.ssl.fallback import augmentation_fallback
from resmlp.ssl.health import CollapseWatch, collapse_kl, collapse_warning, drift_advice
from resmlp.ssl.init import continuing, record_start
from resmlp.ssl.networks import DinoHooks
from resmlp.ssl.step import build_dino_step, dino_path, dino_schedules


DEMO_TEXT = ("CPU demo: a small ResMLP (dim {c.model.dim}, depth {c.model.depth}, patch {c.model.patch_size}) on {n} "
             "{c.data.name} images at {c.data.img_size} px for {c.epochs} epochs, to show the pipeline learns. The real "
             "run needs a GPU: on one, `bash run.sh dino resmlp_s12` trains the full preset; demo=false forces it here.")
# A log line's values after "ep <epoch> it <iteration>", from the record run.log writes.
LOG_LINE = ("loss {loss:.4f} lr {lr:.2e} wd {wd:.3f} m {momentum:.4f} T_t {teacher_temp:.3f} H_t {teacher_entropy:.2f} "
            "KL {teacher_kl_mean:.3f} {images_per_s:.0f} img/s")


def build_data(cfg, run, plan, path, lists: FileLists | None = None):
    """(the views of `plan`, the training split, its loader, its resumable sampler); `path`:
    the step's (ssl.step.dino_path: the views' augmentation compiles where the step does);
    `lists`: the run's folder scans (data=folder)."""
    views = build_views(cfg, plan, out_dtype=run.amp_dtype or torch.float32, device=run.device, path=path,
                        on_compile_error=augmentation_fallback(cfg, run.print))
    dataset = build_dataset(cfg.data, train_split_for_ssl(cfg.data), lists=lists)
    loader, sampler = build_train_loader(dataset, views.transform, run.batch_per_rank, cfg.seed, cfg.num_workers,
                                         pin_memory=run.device.type == "cuda", keyed=views.keyed,
                                         collate_fn=views.collate)
    return views, dataset, loader, sampler


def train(cfg, hooks: DinoHooks | None = None):
    """Run DINO and return (run, student, teacher, results). `run(cfg)` is the CLI entry;
    `hooks` are a study's extension points (ssl.networks.DinoHooks)."""
    hooks = hooks or DinoHooks()
    judge = build_judge(cfg)  # the k-NN on the labeled set eval.data names (eval/judge.py), checked first
    lists = FileLists(run_dir(cfg))  # a folder is scanned once per run dir: a resumed run reads its list
    fitted = fit_demo_subset(cfg, lists)
    run = Run(cfg)
    start = continuing(cfg, run, hooks)  # dino.init: where the weights start (ssl/init.py), checked first

    # ---- data: the multi-crop views of the training split, made as the step runs -------------
    plan, path = crop_plan(cfg), dino_path(cfg, run.device, run.scaler.is_enabled())
    views, dataset, loader, sampler = build_data(cfg, run, plan, path, lists)
    if hooks.views:
        hooks.views(views, cfg)
    ipe = sampler.batches_per_epoch
    judge.check(dataset)  # the k-NN's k fits its bank, before any work
    if cfg.demo:
        run.print(DEMO_TEXT.format(c=cfg, n=len(dataset)) + (f" ({fitted})" if fitted else ""))
    judge.warn(run)

    # ---- the step: student, teacher, loss, optimizer (what the benchmark times too) --------
    step = build_dino_step(cfg, plan, run.device, run.scaler, run.autocast, run.world_size, hooks, start, path=path,
                           report=lambda line, taken: fell_back(run, line, taken, it + 1))  # `it`: the loop's
    run.print("\n".join(run.start_lines(step.path)))  # the device, precision; compiled how, graphed or not, and why
    student, teacher = step.student, step.teacher

    # ---- schedules, per iteration: lr, weight decay, teacher momentum and temperature ----
    E, sched = cfg.epochs, dino_schedules(cfg, ipe)

    # ---- resume, or the k-NN at init ----------------------------------------------------------
    collapse = CollapseWatch(collapse_kl(cfg.dino), cfg.dino.collapse_patience, drift_advice(cfg.dino))
    state = {"student": step.raw_student, "teacher": teacher, "optimizer": step.optimizer,
             "center": step.loss_fn.center, "scaler": run.scaler, "collapse": collapse}
    start_it, results = run.restore(**state)
    record_start(start, run, results, start_it)  # a fresh start from weights says where they came from
    lists.save()  # the folder's list, into the run dir that exists now
    cadence = Cadence(run, ipe, start_it, results, state, tally=step.tally)
    judge.begin(run, cadence, teacher.backbone, results, start, start_it)
    run.reset_peak_memory()  # the peak of training, not of the k-NN's feature extraction
    run.print(describe_run(cfg, run, plan, len(dataset), ipe, judge))
    compile_cache = open_compile_cache(cfg, run, (student, teacher), step.graphed is not None, plan.label())

    # ---- the loop -------------------------------------------------------------------------
    it = start_it
    for epoch in range(start_it // ipe, E):
        sampler.set_epoch(epoch, start_batch=it - epoch * ipe)
        student.train()
        bar = progress(loader, total=len(sampler) // run.batch_per_rank, desc=f"epoch {epoch + 1}/{E}",
                       enabled=run.interactive)
        for batch in bar:
            crops = views.to_device(batch, run.device)
            step(crops, sched.at(it), epoch)
            it += 1
            cadence.count(cfg.batch_size)

            # <- sync point across ranks, on the host, once per iteration (Cadence.agree): log_due asks
            #    when its clock decides, else after_iteration; a stop signal on any rank stops all there
            if cadence.log_due(it):  # <- sync point: the device tally comes to the host
                record = {**cadence.log_record(it), **sched.record(it - 1)}
                log_line(run, record, bar, f"ep {epoch + 1}/{E} it {it}/{E * ipe} ", collapse, step)
                compile_cache.save()  # what the step compiled since the last save (core/compile_cache.py)
            if cadence.checkpoint_due(it):  # <- sync point
                cadence.checkpoint(it)
            cadence.after_iteration(it)

        cadence.read(it)  # <- sync point: the epoch's remaining steps
        entropy = cadence.epoch.take().get("teacher_entropy")
        warning = collapse_warning(entropy, cfg.dino.out_dim) if entropy is not None else None
        if warning:
            run.print(f"warning: {warning}")
        judge.after_epoch(epoch + 1, it)  # <- sync point: the k-NN every eval_every epochs, after the head warm-up
        cadence.checkpoint(it)

    # ---- the end: the teacher's k-NN (and linear probe) on the test split ---------------------
    save_rank_weights(run, step)  # with save_rank_weights=true: to check that the ranks stayed in step
    judge.end(it)  # <- sync point
    # summed over every start: a finished run resumed again keeps its rate
    summary = run.finish(summarize(run, cfg, results, step, cadence.timing_report()["train_images_per_s"], judge))
    return run, step.raw_student, teacher, summary


def fell_back(run, line: str, path, iteration: int) -> None:
    """The step left its fast path (ssl/fallback.py): the `path:` line that says why, and the
    path it takes from this iteration on in log.jsonl (results.json's `path` keeps it too)."""
    run.print(line)
    run.log({"iteration": iteration, "path": path.record()})


def save_rank_weights(run, step) -> None:
    if not run.cfg.save_rank_weights:
        return
    with atomic_write(run.dir / f"weights_rank{run.rank}.pth", what="the rank's weights") as f:
        torch.save({"student": step.raw_student.state_dict(), "teacher": step.teacher.state_dict()}, f)


def describe_run(cfg, run, plan, n_images: int, ipe: int, judge) -> str:
    """The run's first line: what trains on what, how long, where."""
    return (f"DINO {cfg.model.name} on {cfg.data.name}{judge.describe()}: {n_images} images, {cfg.epochs} epochs x "
            f"{ipe} iterations, global batch {cfg.batch_size} on {run.world_size} x {run.device.type}, crops "
            f"{plan.label()} px ({plan.strategy}, made on the {cfg.dino.augment}), run dir {run.dir}")


def log_line(run, record: dict, bar, where: str, collapse: CollapseWatch, step) -> None:
    """A log record into log.jsonl and TensorBoard, shown as the progress bar's loss or as a
    printed line after `where`; the collapse watch reads its KL. First the step's own check
    (DinoStep.check: graphed under torchrun, every gradient still in the buffer it all-reduces)."""
    step.check()
    run.log(record, step=record["iteration"])
    if run.interactive:
        bar.set_postfix(loss=f"{record['loss']:.3f}")
    else:
        koleo = f" KoLeo {record['koleo']:.3f}" if "koleo" in record else ""
        run.print(where + LOG_LINE.format(**record) + koleo)
    warning = collapse.update(record["teacher_kl_mean"])
    if warning:
        run.print(f"warning: {warning}")


def summarize(run, cfg, results: dict, step, images_per_s: float, judge) -> dict:
    """results.json's fields: the run's, then the judge's (which prints the k-NN from init
    to the end); run.finish adds the wall time and the device. `path`: how this start ran
    the step (core.compiling.StepPath), where config.yaml keeps what was asked."""
    return {"command": "dino", "model": cfg.model.name, "data": cfg.data.name, "epochs": cfg.epochs,
            "demo": bool(cfg.demo), "local_crops": cfg.dino.local_crops, "path": step.path.record(),
            **({"init_from": results["init_from"]} if "init_from" in results else {}),
            "params": sum(p.numel() for p in step.teacher.backbone.parameters()),
            "train_images_per_s": round(images_per_s, 1), **run.memory_mb(), **judge.summary()}


run = command(train)  # the CLI's entry: resmlp.core.cli calls run(cfg)
