"""One DINO optimization step, built once by `build_dino_step` for the trainer and the benchmark.

    teacher(2 global crops), student(all crops) -> teacher targets (mean or Sinkhorn-Knopp
    centering) -> loss (fp32; + KoLeo) -> backward -> per-parameter clipping -> frozen last
    layer in the first epoch(s) -> AdamW -> EMA of the teacher

Continuing from weights (dino.init, ssl/init.py): during the head warm-up's epochs the
student's backbone takes no gradient (so AdamW leaves it and its state alone: bitwise
unchanged) and the teacher's EMA moves its head only; after it, the backbone's parameter
groups learn at `lr_scale` times the schedule's rate.

The step never waits for the device: nothing in it reads a tensor's value on the host.
The loss, the teacher's health statistics and the non-finite flag accumulate on the
device (`DinoStep.tally`, a core.cadence.DeviceTally); the trainer reads them only when it
logs or saves, so the host can queue the next iterations while the device works. A
non-finite loss is therefore noticed at the next read, not at once: the weights may turn
non-finite in between, which is why every checkpoint is preceded by a read and the run
stops instead of saving (the last good checkpoint stays as it was).

With dino.cuda_graphs (auto: on a CUDA GPU) the same update runs as one captured CUDA graph
(ssl/graphed_step.py), its per-iteration values read from device tensors, the gradients reduced
over the process group there rather than by DDP; `path` says which way the step runs. In the
trainer a `guard` (ssl/fallback.py) watches the calls that compile or capture, and moves the
step to another path (`take_path`) where auto's fast one fails.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn

from resmlp.core.cadence import DeviceTally
from resmlp.core.compiling import StepPath, compile_as, compile_form
from resmlp.core.optim import scaled_lr
from resmlp.core.schedules import cosine_schedule, linear_warmup_then_constant
from resmlp.ssl.clip import clip_per_parameter
from resmlp.ssl.ema import update_teacher
from resmlp.ssl.graphed_step import GraphedStep, use_cuda_graphs
from resmlp.ssl.health import teacher_stats


class StepValues(NamedTuple):
    """The schedules' values of one iteration (DinoSchedules.at), which a step takes whole:
    the learning rate, the weight decay, the teacher's EMA momentum and temperature; the
    field names are the log record's."""
    lr: float
    wd: float
    momentum: float
    teacher_temp: float


@dataclass
class DinoStep:
    student: nn.Module          # as trained: the MultiCropNet, possibly wrapped in DDP
    teacher: nn.Module
    loss_fn: nn.Module          # ssl.loss.DinoLoss (it keeps the center)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    n_crops: int
    clip_grad: float = 3.0
    autocast: object = contextlib.nullcontext
    koleo_weight: float = 0.0   # DINOv2's KoLeo on the student's pooled global-crop features
    tally: DeviceTally = field(default_factory=DeviceTally)   # device sums since the last read
    graphed: object = None           # ssl.graphed_step.GraphedStep, with dino.cuda_graphs
    head_warmup_epochs: int = 0      # dino.init: epochs of the head alone on the frozen backbone
    backbone_frozen: bool = False
    ddp: dict | None = None          # DistributedDataParallel's arguments, with more than one process and no graph
    path: object = None              # core.compiling.StepPath: compiled how, graphed or not, and why
    world_size: int = 1
    guard: object = None             # ssl.fallback.PathGuard (the trainer's): the calls that compile or capture

    @property
    def raw_student(self) -> nn.Module:
        return getattr(self.student, "module", self.student)

    def __call__(self, crops: list[torch.Tensor], values: StepValues, epoch: int):
        """One update with the schedules' `values` of this iteration. Returns (loss, teacher
        output, center used), all on the device (with dino.cuda_graphs: buffers the next call
        overwrites)."""
        if self.guard is not None and self.guard.due(epoch):   # a call that compiles or captures
            return self.guard(crops, values, epoch)
        return self.update(crops, values, epoch)

    def update(self, crops: list[torch.Tensor], values: StepValues, epoch: int):
        """The update on the step's path as it is (__call__ without the guard)."""
        if self.graphed is not None:
            return self.graphed(crops, values, epoch)
        self.freeze_backbone(epoch < self.head_warmup_epochs)
        for g in self.optimizer.param_groups:
            g["lr"] = values.lr * g.get("lr_scale", 1.0)
            if g.get("name") == "decay":
                g["weight_decay"] = values.wd
        loss, t_out, center, stats = self.forward_loss(crops, values.teacher_temp)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        clip_per_parameter(self.raw_student.parameters(), self.clip_grad)
        self.raw_student.head.cancel_last_layer_gradients(epoch)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.backbone_frozen:  # the teacher's backbone is the student's, unchanged
            update_teacher(self.teacher.head, self.raw_student.head, values.momentum)
        else:
            update_teacher(self.teacher, self.raw_student, values.momentum)
        loss, t_out = loss.detach(), t_out.detach()
        self.tally.add(loss, **stats)
        return loss, t_out, center

    def forward_loss(self, crops: list[torch.Tensor], teacher_temp) -> tuple:
        """Teacher and student forward, the targets and the loss (+ KoLeo), which also moves
        the center: (loss, teacher output, the center before the move, the statistics the
        tally sums: the targets' health and the KoLeo term). teacher_temp: a float, or a
        0-dim tensor on the device (the graphed step's)."""
        with self.autocast():
            t_out = self.teacher(crops[:2])
            if self.koleo_weight:
                s_out, s_features = self.student(crops, global_features=True)
            else:
                s_out = self.student(crops)
        # The head's last layer already ran in fp32 (head.head_forward); so does the
        # loss: a softmax over tens of thousands of prototypes is not for bf16.
        center = self.loss_fn.center.detach().clone()
        t_out = t_out.float()
        targets = self.loss_fn.targets(t_out, teacher_temp)  # with the center before this step moves it
        loss = self.loss_fn(list(t_out.chunk(2)), list(s_out.float().chunk(self.n_crops)),
                            teacher_temp=teacher_temp, targets=targets)
        stats = teacher_stats(targets)
        if self.koleo_weight:
            stats["koleo"] = self.loss_fn.koleo(s_features)
            loss = loss + self.koleo_weight * stats["koleo"]
        return loss, t_out, center, stats

    def read(self) -> dict:
        """What accumulated since the last read (DeviceTally.read: the sync point)."""
        return self.tally.read()

    def check(self) -> None:
        """At a log line: graphed under a process group, every gradient still views the
        buffer the step all-reduces (ssl.graphed_step.FlatGradients.check)."""
        if self.graphed is not None:
            self.graphed.check()

    def take_path(self, path) -> None:
        """Run from now on as `path` says (a core.compiling.StepPath; ssl/fallback.py's next
        path): the networks compiled in its form or eager again, graphed anew or reduced by DDP
        again with more than one process. The weights and optimizer state stay as they are."""
        captured = self.graphed is not None and self.graphed.capture
        self.graphed, self.student, self.ddp = None, self.raw_student, None
        self.optimizer.zero_grad(set_to_none=True)   # the flat buffer's views (or DDP's) go with their path
        if captured:
            torch.cuda.empty_cache()   # a graph's pool (a failed capture's too) back to the device for what runs now
        compile_networks(self.raw_student, self.teacher, self.loss_fn, path.compile)
        self.path = path
        if path.cuda_graphs:
            self.graphed = GraphedStep(self)
        elif self.world_size > 1:
            self.ddp = ddp_arguments(self.optimizer.param_groups[0]["params"][0].device)
            self.student = torch.nn.parallel.DistributedDataParallel(self.raw_student, **self.ddp)

    def freeze_backbone(self, frozen: bool) -> None:
        """The student's backbone out of (or back into) training: without requires_grad it
        gets no gradient, so the optimizer skips it and the backward stops at the head.
        DDP is wrapped anew, since it reduces the gradients of the parameters that required
        one when it was made (the same weights on every rank: nothing changes)."""
        if frozen == self.backbone_frozen:
            return
        self.raw_student.backbone.requires_grad_(not frozen)
        self.backbone_frozen = frozen
        if self.ddp is not None:
            self.student = torch.nn.parallel.DistributedDataParallel(self.raw_student, **self.ddp)


def build_optimizer(model: nn.Module, device: torch.device, capturable: bool = False,
                    backbone_lr_scale: float | None = None) -> torch.optim.Optimizer:
    """AdamW over our parameter groups; fused into one kernel per group on CUDA (the
    same update, without a launch per parameter); capturable for a CUDA graph. With
    backbone_lr_scale (dino.init) each group is split into the backbone's part, which
    learns at that scale of the rate (its `lr_scale`), and the head's."""
    from resmlp.core.optim import param_groups
    groups = param_groups(model)
    if backbone_lr_scale is not None:
        backbone = {id(p) for p in model.backbone.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if (id(p) in backbone) == inside],
                   **({"lr_scale": float(backbone_lr_scale)} if inside else {})}
                  for inside in (True, False) for g in groups]
    return torch.optim.AdamW(groups, lr=0.0, weight_decay=0.0, fused=device.type == "cuda",
                             capturable=capturable)


def ddp_arguments(device: torch.device) -> dict:
    """DistributedDataParallel's arguments for a network on `device`."""
    return {"device_ids": [device.index] if device.type == "cuda" else None}


def compile_networks(student: nn.Module, teacher: nn.Module, loss_fn: nn.Module, form: str | None) -> None:
    """Student and teacher compiled in place in `form` (core/compiling.py; None: eager, undoing
    any earlier form), their heads as regions of their own when by region (whole, each is in
    its network's graph), the loss's functions compiled whenever anything is."""
    for net in (student, teacher):
        compile_as(net, form)
        net.compile_head(form == "regions")
    loss_fn.compile_regions(form is not None)


def dino_path(cfg, device: torch.device, scaler_enabled: bool) -> StepPath:
    """The DINO step's path for `cfg` on `device`, decided once per run: graphed or not
    (ssl.graphed_step.use_cuda_graphs), then compiled as `compile` says for a step graphed or
    not (core.compiling.compile_form). The trainer hands it to the views (their augmentation
    compiles when the step does) and to build_dino_step; only a fallback changes it after
    (ssl/fallback.py, DinoStep.take_path)."""
    graphed, graphs_off = use_cuda_graphs(cfg.dino.cuda_graphs, device, scaler_enabled,
                                          bool(cfg.model.grad_checkpointing))
    form, compile_off = compile_form(cfg.compile, device, "dino", graphed)
    return StepPath(form, graphed, tuple(line for line in (compile_off, graphs_off) if line))


def build_dino_step(cfg, plan, device: torch.device, scaler: torch.amp.GradScaler | None = None,
                    autocast=contextlib.nullcontext, world_size: int = 1, hooks=None, start=None,
                    report=None, path: StepPath | None = None) -> DinoStep:
    """Student, teacher, lightly's loss, AdamW, DDP, torch.compile and CUDA graphs as
    `cfg` says, for the crops of `plan` (resmlp.data.crop_plan): the step the trainer runs
    and the benchmark times. `hooks`: ssl.networks.DinoHooks (studies; its `step` is called
    on the step built here). `start` (ssl.init.Start): the weights dino.init gives, the head
    warm-up and the backbone's learning-rate scale. `path`: how it runs, compiled by region or
    whole, graphed or not (`dino_path`, which the trainer decides before its views; None:
    decided here, for the step alone); `step.path` keeps it. `report(line, record)`: the
    trainer's, given where the step is to fall back from a failing fast path (ssl/fallback.py)
    rather than stop; the benchmark times a path as asked."""
    from resmlp.ssl.fallback import PathGuard
    from resmlp.ssl.loss import build_dino_loss
    from resmlp.ssl.networks import build_networks
    scaler = scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False)
    path = path if path is not None else dino_path(cfg, device, scaler.is_enabled())
    student, teacher = build_networks(cfg, plan, device, hooks, start)
    loss_fn = build_dino_loss(cfg.dino).to(device)
    if start is not None and start.center is not None and start.center.shape == loss_fn.center.shape:
        loss_fn.center.copy_(start.center)   # the loaded head's outputs, centered as they were
    optimizer = build_optimizer(student, device, capturable=path.cuda_graphs,
                                backbone_lr_scale=start.lr_scale if start is not None else None)
    warmup = start.warmup_epochs if start is not None else 0
    trained = student
    # graphed, the step reduces the gradients itself (ssl/graphed_step.py), under any process group
    ddp = ddp_arguments(device) if world_size > 1 and not path.cuda_graphs else None
    if ddp is not None:
        trained = torch.nn.parallel.DistributedDataParallel(student, **ddp)
    step = DinoStep(trained, teacher, loss_fn, optimizer, scaler, plan.n_crops, float(cfg.optim.clip_grad), autocast,
                    koleo_weight=float(cfg.dino.koleo_weight), head_warmup_epochs=warmup, ddp=ddp,
                    path=path, world_size=world_size)
    compile_networks(student, teacher, loss_fn, path.compile)   # in place (core/compiling.py)
    if path.cuda_graphs:
        step.graphed = GraphedStep(step)
    if hooks is not None and hooks.step:
        hooks.step(step, cfg)
    if report is not None and (path.compile is not None or path.cuda_graphs):   # something to fall back from
        step.guard = PathGuard(step, cfg, report)
    return step


@dataclass(frozen=True)
class DinoSchedules:
    """The step's values at every iteration, DINO's: the learning rate (scaled by the batch,
    a linear warm-up, then cosine), the weight decay and the teacher's momentum (cosine to
    their end values) and the teacher's temperature (a linear warm-up, then constant)."""
    lr: np.ndarray
    wd: np.ndarray
    momentum: np.ndarray
    teacher_temp: np.ndarray

    def at(self, it: int) -> StepValues:
        """What DinoStep takes at iteration `it`."""
        return StepValues(*(float(getattr(self, name)[it]) for name in StepValues._fields))

    def record(self, it: int) -> dict:
        """Iteration `it`'s values, as a log record's fields."""
        return self.at(it)._asdict()


def dino_schedules(cfg, iterations_per_epoch: int) -> DinoSchedules:
    E, o, d, ipe = cfg.epochs, cfg.optim, cfg.dino, iterations_per_epoch
    return DinoSchedules(cosine_schedule(scaled_lr(o, cfg.batch_size), o.min_lr, E, ipe, o.warmup_epochs),
                         cosine_schedule(o.weight_decay, o.weight_decay_end, E, ipe),
                         cosine_schedule(d.momentum_teacher, 1.0, E, ipe),
                         linear_warmup_then_constant(d.warmup_teacher_temp, d.teacher_temp,
                                                     d.warmup_teacher_temp_epochs, E, ipe))
