"""The baseline of the DINO step benchmark: one step done the way the reference DINO code
(facebookresearch/dino main_dino.py) does it, written here from its description:

- timm's resmlp_12_224 / resmlp_24_224 as the backbone (random weights), DINO's
  multi-crop wrapper (one backbone call per run of equal-resolution crops) and head;
- fp16 autocast with a GradScaler, no torch.compile;
- the loss as a Python loop over (teacher crop, student crop) pairs;
- per-parameter gradient clipping in a Python loop (one norm, one .item() each);
- the teacher EMA as a Python loop over parameters;
- loss.item() to check for a non-finite loss and torch.cuda.synchronize() each step.

timm's ResMLP takes only its built resolution, so for the `interpolate` and `subgrid`
strategies (96 px local crops through a 224 px model) the baseline runs this same loop
around our ResMLP with grid adaptation: the comparison then isolates the step's code.
The head is the trainer's (lightly's DINOProjectionHead, the same layers as DINO's).
"""
from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf


class RefMultiCrop(nn.Module):
    """DINO's wrapper: consecutive crops of equal size go through the backbone together,
    then every feature through the head at once."""

    def __init__(self, backbone: nn.Module, head: nn.Module):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops):
        if not isinstance(crops, list):
            crops = [crops]
        widths = torch.tensor([c.shape[-1] for c in crops])
        ends = torch.cumsum(torch.unique_consecutive(widths, return_counts=True)[1], 0)
        feats, start = [], 0
        for end in ends.tolist():
            feats.append(self.backbone(torch.cat(crops[start:end])))
            start = end
        return self.head(torch.cat(feats))


class RefDinoLoss(nn.Module):
    """DINO's cross-entropy, pair by pair, with the center as an EMA of the teacher output."""

    def __init__(self, out_dim: int, n_crops: int, student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__()
        self.n_crops, self.student_temp, self.center_momentum = n_crops, student_temp, center_momentum
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output, teacher_temp: float):
        student = (student_output / self.student_temp).chunk(self.n_crops)
        teacher = F.softmax((teacher_output - self.center) / teacher_temp, dim=-1).detach().chunk(2)
        total, terms = 0.0, 0
        for i, q in enumerate(teacher):
            for v, s in enumerate(student):
                if v == i:
                    continue
                total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                terms += 1
        self.update_center(teacher_output)
        return total / terms

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = teacher_output.sum(dim=0, keepdim=True) / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def dino_param_groups(model: nn.Module) -> list[dict]:
    """DINO's rule: no weight decay for biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def clip_gradients_loop(model: nn.Module, clip: float) -> None:
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.data.norm(2)
            coef = clip / (norm.item() + 1e-6)
            if coef < 1:
                p.grad.data.mul_(coef)


def cancel_last_layer_gradients(model: nn.Module, epoch: int, freeze_epochs: int) -> None:
    if epoch >= freeze_epochs:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None


class RefDinoStep:
    """One reference-style DINO iteration; same call signature as resmlp.ssl.step.DinoStep."""

    def __init__(self, student: nn.Module, teacher: nn.Module, out_dim: int, n_crops: int,
                 device: torch.device, fp16: bool, clip_grad: float = 3.0, freeze_last_layer: int = 1,
                 student_temp: float = 0.1, center_momentum: float = 0.9):
        self.student, self.teacher = student, teacher
        self.loss_fn = RefDinoLoss(out_dim, n_crops, student_temp, center_momentum).to(device)
        self.optimizer = torch.optim.AdamW(dino_param_groups(student), lr=0.0)
        self.fp16 = bool(fp16 and device.type == "cuda")
        self.scaler = torch.amp.GradScaler("cuda") if self.fp16 else None
        self.device, self.clip_grad, self.freeze_last_layer = device, clip_grad, freeze_last_layer

    def __call__(self, crops, values, epoch: int):
        lr, weight_decay, momentum, teacher_temp = values   # resmlp.ssl.step.StepValues, as DinoStep takes them
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = lr
            if i == 0:
                group["weight_decay"] = weight_decay
        amp = torch.autocast("cuda", dtype=torch.float16) if self.fp16 else contextlib.nullcontext()
        with amp:
            teacher_output = self.teacher(crops[:2])
            student_output = self.student(crops)
            loss = self.loss_fn(student_output, teacher_output, teacher_temp)
        if not math.isfinite(loss.item()):
            return torch.tensor(float("nan"))
        self.optimizer.zero_grad()
        if self.scaler is None:
            loss.backward()
            if self.clip_grad:
                clip_gradients_loop(self.student, self.clip_grad)
            cancel_last_layer_gradients(self.student, epoch, self.freeze_last_layer)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            if self.clip_grad:
                clip_gradients_loop(self.student, self.clip_grad)
            cancel_last_layer_gradients(self.student, epoch, self.freeze_last_layer)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        with torch.no_grad():
            for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                pt.data.mul_(momentum).add_((1 - momentum) * ps.detach().data)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return loss.detach()


# --------------------------------------------------------------------------- networks

def model_dims(model_cfg, img_size: int) -> dict:
    """dim, depth, patch, img of the config's ResMLP (the named preset plus overrides)."""
    from resmlp.models import ARCHS
    arch = ARCHS[model_cfg.name]
    return {"dim": int(model_cfg.get("dim") or arch["dim"]), "depth": int(model_cfg.get("depth") or arch["depth"]),
            "patch": int(model_cfg.get("patch_size") or arch["patch_size"]), "img": int(img_size),
            "init_values": float(model_cfg.get("init_values") or arch["init_values"])}


def timm_resmlp(dims: dict, drop_path_rate: float = 0.0, num_classes: int = 0) -> nn.Module:
    """timm's ResMLP: resmlp_12_224 / resmlp_24_224 for the paper's S12 / S24, else timm's
    MlpMixer built the way those are (ResBlock, Affine) at the given size. Random weights."""
    import timm
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock
    if (dims["dim"], dims["patch"], dims["img"]) == (384, 16, 224) and dims["depth"] in (12, 24):
        return timm.create_model(f"resmlp_{dims['depth']}_224", pretrained=False, num_classes=num_classes,
                                 drop_path_rate=drop_path_rate)
    return MlpMixer(num_classes=num_classes, img_size=dims["img"], patch_size=dims["patch"],
                    num_blocks=dims["depth"], embed_dim=dims["dim"], mlp_ratio=4,
                    block_layer=partial(ResBlock, init_values=dims["init_values"]), norm_layer=Affine,
                    drop_path_rate=drop_path_rate)


def timm_name(dims: dict) -> str:
    if (dims["dim"], dims["patch"], dims["img"]) == (384, 16, 224) and dims["depth"] in (12, 24):
        return f"timm resmlp_{dims['depth']}_224"
    return f"timm MlpMixer-ResMLP d{dims['dim']}x{dims['depth']}"


def build_reference_networks(cfg, plan, device: torch.device, backbone: str = "timm"):
    """Student and teacher for RefDinoStep from a dino config: timm's ResMLP (or ours with
    the crop plan's grid adaptation, backbone='ours') + the trainer's head."""
    from resmlp.models.from_config import build_model
    from resmlp.ssl.head import build_head

    def one(drop_path: float) -> nn.Module:
        if backbone == "timm":
            bb = timm_resmlp(model_dims(cfg.model, cfg.data.img_size), drop_path)
        else:
            # the plain blocks, as the reference code would run them
            bb = build_model(OmegaConf.merge(cfg.model, {"drop_path_rate": drop_path, "fused": False}),
                             num_classes=0)
            if plan.grid_adapt != "none":
                bb.grid_adapt = plan.grid_adapt
        return RefMultiCrop(bb, build_head(bb.num_features, cfg.dino))

    student = one(float(cfg.model.drop_path_rate)).to(device)
    teacher = one(0.0).to(device)
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    return student, teacher
