"""One supervised optimization step, built once by `build_supervised_step` (as DINO's is by
resmlp.ssl.step.build_dino_step):

    mixup / cutmix -> model (compiled as `compile` says) -> loss (fp32; with distillation, the
    frozen teacher's logits too) -> backward -> global-norm clipping -> optimizer -> model EMA

The step never waits for the device: the loss accumulates on the device
(`SupervisedStep.tally`, a core.cadence.DeviceTally) and the trainer reads it only when it
logs or saves. The recipe's parts are timm's (Mixup, the soft-target and label-smoothing
losses, create_optimizer_v2, ModelEmaV3); the parameter groups are core.optim's, split
per layer for fine-tuning's layer-wise lr decay.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import ModelEmaV3

from resmlp.core.compiling import StepPath, compile_as, compile_form
from resmlp.core.cadence import DeviceTally
from resmlp.core.errors import UserError
from resmlp.core.optim import no_weight_decay, param_groups
from resmlp.supervised.distill import distillation_loss


@dataclass
class SupervisedStep:
    model: nn.Module                 # as trained: the classifier, possibly wrapped in DDP
    raw_model: nn.Module             # the classifier itself (what is saved, evaluated, averaged)
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    mixup: Mixup | None = None
    teacher: nn.Module | None = None  # distillation: the frozen classifier
    distill: object = None           # the config's distill: section (type, alpha, tau)
    ema: ModelEmaV3 | None = None
    clip_grad: float = 0.0
    autocast: object = contextlib.nullcontext
    tally: DeviceTally = field(default_factory=DeviceTally)   # device sums since the last read
    path: object = None              # core.compiling.StepPath: compiled how, and why not

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, lr: float, it: int) -> torch.Tensor:
        """One update at learning rate `lr` (each group scaled by its lr_scale) on a batch
        already on the device. Returns the loss, on the device."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        targets = labels
        if self.mixup is not None:
            images, targets = self.mixup(images, labels)
        with self.autocast():
            logits = self.model(images)
        if self.teacher is not None:
            with torch.no_grad(), self.autocast():
                t_logits = self.teacher(images)
            d = self.distill
            loss = distillation_loss(logits.float(), t_logits.float(), targets, d.type, d.alpha, d.tau,
                                     base_criterion=self.criterion)
        else:
            loss = self.criterion(logits.float(), targets)

        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(self.raw_model, step=it)
        self.tally.add(loss)  # stays on the device until the next read
        return loss


def build_mixup(cfg, n_classes: int, batch_per_rank: int):
    """timm's Mixup (it also applies the label smoothing) or None when both alphas are 0."""
    a = cfg.aug
    if not (a.mixup > 0 or a.cutmix > 0) or a.mixup_prob <= 0:
        return None
    if batch_per_rank % 2:
        raise UserError(f"mixup/cutmix need an even batch per process, got {batch_per_rank}; change batch_size "
                        "or set aug.mixup=0 aug.cutmix=0")
    return Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob, switch_prob=a.mixup_switch_prob,
                 mode=a.mixup_mode, label_smoothing=a.smoothing, num_classes=n_classes)


def build_criterion(cfg, mixup) -> nn.Module:
    """DeiT's choice: soft-target CE after mixup, else label smoothing, else plain CE."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if cfg.aug.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.aug.smoothing)
    return nn.CrossEntropyLoss()


def layer_id(name: str, n_layers: int) -> int:
    """0 for the stem, i + 1 for block i, n_layers + 1 for the final norm, pooling and head."""
    if name.startswith(("patch_embed", "stem", "cls_token", "pos_embed")):
        return 0
    m = re.match(r"(?:blocks|layers|stages)\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else n_layers + 1


def layer_decay_groups(model: nn.Module, layer_decay: float) -> list[dict]:
    """core.optim's decay / no-decay split, further split per layer with lr_scale =
    layer_decay ** (n_layers + 1 - layer): the head learns at the full lr, block i at
    decay^(depth - i), the patch embedding at decay^(depth + 1) (BEiT's rule)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ids = [int(m.group(1)) for n in names if (m := re.match(r"(?:blocks|layers|stages)\.(\d+)\.", n))]
    if not ids:
        raise UserError(f"finetune.layer_decay needs a model with numbered blocks; {type(model).__name__} has none")
    n_layers = max(ids) + 1
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lid, nd = layer_id(name, n_layers), no_weight_decay(name, p)
        g = groups.setdefault((lid, nd), {"params": [], "name": "no_decay" if nd else "decay", "layer": lid,
                                          "lr_scale": layer_decay ** (n_layers + 1 - lid)})
        if nd:
            g["weight_decay"] = 0.0
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def layer_decay(cfg) -> float | None:
    """fine-tuning's finetune.layer_decay when it is on (< 1), else None."""
    value = cfg.finetune.layer_decay if cfg.command == "finetune" else None
    return value if value and value < 1 else None


def build_supervised_step(cfg, model: nn.Module, teacher: nn.Module | None, n_classes: int, run) -> SupervisedStep:
    """Mixup, loss, model EMA, optimizer, DDP and torch.compile as `cfg` says, around
    `model` (on run.device) and the distillation `teacher` (or None)."""
    device = run.device
    mixup = build_mixup(cfg, n_classes, run.batch_per_rank)
    criterion = build_criterion(cfg, mixup)
    ema = ModelEmaV3(model, decay=cfg.ema.decay, device=device) if cfg.ema.enabled else None
    o, decay = cfg.optim, layer_decay(cfg)
    groups = layer_decay_groups(model, decay) if decay else param_groups(model)
    optimizer = create_optimizer_v2(groups, opt=o.opt, lr=0.0, weight_decay=o.weight_decay, momentum=o.momentum)
    trained = model
    if run.world_size > 1:
        trained = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    form, off = compile_form(cfg.compile, device, cfg.command)
    compile_as(model, form)  # in place (core/compiling.py); the EMA above is an eager copy
    return SupervisedStep(trained, model, criterion, optimizer, run.scaler, mixup, teacher, cfg.get("distill"), ema,
                          float(o.clip_grad), run.autocast, path=StepPath(form, off=(off,) if off else ()))
