"""One DINO optimization step, shared by the trainer and the benchmark."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from resmlp.core import dist
from resmlp.ssl.ema import clip_per_parameter, update_teacher


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
    forward_student: nn.Module | None = None   # torch.compile'd versions, when compiling
    forward_teacher: nn.Module | None = None

    @property
    def raw_student(self) -> nn.Module:
        return getattr(self.student, "module", self.student)

    def __call__(self, crops: list[torch.Tensor], lr: float, weight_decay: float, momentum: float,
                 teacher_temp: float, epoch: int):
        """Returns (loss, teacher output, center used) for logging."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
            if g.get("name") == "decay":
                g["weight_decay"] = weight_decay
        with self.autocast():
            teacher = self.teacher if self.forward_teacher is None else self.forward_teacher
            student = self.student if self.forward_student is None else self.forward_student
            t_out = teacher(crops[:2])
            s_out = student(crops)
        # The loss in fp32: a softmax over 65536 prototypes is not for bf16.
        center = self.loss_fn.center.detach().clone()
        loss = self.loss_fn(list(t_out.float().chunk(2)), list(s_out.float().chunk(self.n_crops)),
                            teacher_temp=teacher_temp)
        # Every rank must agree to stop, or the others would wait forever in DDP's all-reduce.
        bad = dist.all_reduce_sum((~torch.isfinite(loss.detach())).float())
        if bad.item():
            return torch.tensor(float("nan")), t_out.detach(), center  # the caller stops; weights untouched
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        clip_per_parameter(self.raw_student.parameters(), self.clip_grad)
        self.raw_student.head.cancel_last_layer_gradients(epoch)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        update_teacher(self.teacher, self.raw_student, momentum)
        return loss.detach(), t_out.detach(), center
