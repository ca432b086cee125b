"""One DINO optimization step, built once by `build_dino_step` for the trainer and the benchmark.

The step never waits for the device: nothing in it reads a tensor's value on the host.
The loss, the teacher's health statistics and the non-finite flag stay on the device and
accumulate there (`DinoStep.tally`); the trainer reads them only when it logs or saves
(`DinoStep.read`), so the host can queue the next iterations while the device works.
A non-finite loss is therefore noticed at the next read, not at once: the weights may
turn non-finite in between, which is why every checkpoint is preceded by a read and the
run stops instead of saving (the last good checkpoint stays as it was).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from resmlp.core import dist
from resmlp.ssl.ema import clip_per_parameter, update_teacher
from resmlp.ssl.health import teacher_stats


@dataclass
class DinoStep:
    student: nn.Module          # as trained: the MultiCropNet, possibly wrapped in DDP
    teacher: nn.Module
    loss_fn: nn.Module          # lightly's DINOLoss (it keeps the center)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    n_crops: int
    clip_grad: float = 3.0
    autocast: object = contextlib.nullcontext
    forward_student: object = None   # torch.compile'd versions, when compiling
    forward_teacher: object = None
    tally: dict = field(default_factory=dict)   # device sums since the last read()

    @property
    def raw_student(self) -> nn.Module:
        return getattr(self.student, "module", self.student)

    def __call__(self, crops: list[torch.Tensor], lr: float, weight_decay: float, momentum: float,
                 teacher_temp: float, epoch: int):
        """One update. Returns (loss, teacher output, center used), all on the device."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            if g.get("name") == "decay":
                g["weight_decay"] = weight_decay
        with self.autocast():
            teacher = self.teacher if self.forward_teacher is None else self.forward_teacher
            student = self.student if self.forward_student is None else self.forward_student
            t_out = teacher(crops[:2])
            s_out = student(crops)
        # The head's last layer already ran in fp32 (multicrop.head_forward); so does the
        # loss: a softmax over tens of thousands of prototypes is not for bf16.
        center = self.loss_fn.center.detach().clone()
        loss = self.loss_fn(list(t_out.float().chunk(2)), list(s_out.float().chunk(self.n_crops)),
                            teacher_temp=teacher_temp)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        clip_per_parameter(self.raw_student.parameters(), self.clip_grad)
        self.raw_student.head.cancel_last_layer_gradients(epoch)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        update_teacher(self.teacher, self.raw_student, momentum)
        loss = loss.detach()
        self._accumulate(loss, t_out.detach(), center, teacher_temp)
        return loss, t_out.detach(), center

    # ---- device-side bookkeeping, read on demand ------------------------------------------
    @torch.no_grad()
    def _accumulate(self, loss, t_out, center, teacher_temp) -> None:
        stats = teacher_stats(t_out, center, teacher_temp)
        values = {"loss": loss.float(), "nonfinite": (~torch.isfinite(loss)).float(), **stats}
        for k, v in values.items():
            if k in self.tally:
                self.tally[k].add_(v)
            else:
                self.tally[k] = v.clone()
        self.tally["steps"] = self.tally.get("steps", 0) + 1
        self.tally["last_loss"] = loss

    def read(self) -> dict:
        """Host values of what accumulated since the last read, and reset.

        One device-to-host copy (the sync point). Means over the steps since the last
        read, plus `last_loss` and `nonfinite`: how many of those steps, summed over all
        processes, had a non-finite loss (every rank reads at the same iteration, so all
        agree to stop)."""
        steps = self.tally.pop("steps", 0)
        if not steps:
            return {"steps": 0, "nonfinite": 0}
        names = [k for k in self.tally]
        packed = torch.stack([self.tally[k].float().reshape(()) for k in names])
        self.tally = {}
        packed[names.index("nonfinite")] = dist.all_reduce_sum(packed[names.index("nonfinite")].clone())
        values = dict(zip(names, packed.tolist()))  # <- sync
        out = {k: v / steps for k, v in values.items() if k not in ("nonfinite", "last_loss")}
        return {**out, "last_loss": values["last_loss"], "nonfinite": int(values["nonfinite"]), "steps": steps}


def build_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over our parameter groups; fused into one kernel per group on CUDA (the
    same update, without a launch per parameter)."""
    from resmlp.core.optim import param_groups
    return torch.optim.AdamW(param_groups(model), lr=0.0, weight_decay=0.0, fused=device.type == "cuda")


def build_dino_step(cfg, device: torch.device, scaler: torch.amp.GradScaler | None = None,
                    autocast=contextlib.nullcontext, world_size: int = 1) -> DinoStep:
    """Student, teacher, lightly's loss, AdamW, DDP and torch.compile as `cfg` says:
    the step the trainer runs and the benchmark times."""
    from lightly.loss import DINOLoss

    from resmlp.ssl.multicrop import build_networks
    from resmlp.ssl.train import crop_plan
    plan = crop_plan(cfg)
    student, teacher = build_networks(cfg, device)
    loss_fn = DINOLoss(cfg.dino.out_dim, student_temp=cfg.dino.student_temp,
                       center_momentum=cfg.dino.center_momentum, warmup_teacher_temp_epochs=0).to(device)
    optimizer = build_optimizer(student, device)
    trained = student
    if world_size > 1:
        trained = torch.nn.parallel.DistributedDataParallel(
            student, device_ids=[device.index] if device.type == "cuda" else None)
    step = DinoStep(trained, teacher, loss_fn, optimizer,
                    scaler if scaler is not None else torch.amp.GradScaler(device.type, enabled=False),
                    2 + plan["n_local"], float(cfg.optim.clip_grad), autocast)
    if cfg.compile:
        step.forward_student, step.forward_teacher = torch.compile(trained), torch.compile(teacher)
    return step
