"""DeiT distillation (Touvron et al. 2021): the loss and the teacher.

Hard distillation (DeiT's best, and the paper's ResMLP "distillation" rows):

    loss = (1 - alpha) * CE(student, targets) + alpha * CE(student, argmax teacher(x))

with alpha = 0.5, on the same augmented (and, with mixup, the same mixed) images; the
label term uses the soft mixed targets when mixup is on. The student has a single head,
as the official distilled ResMLP weights (DeiT's distillation token has no counterpart
in an MLP without tokens).

Soft distillation (`distill.type=soft`), DeiT's formula:

    KL(log_softmax(s / tau) || log_softmax(t / tau)), summed, * tau^2 / s.numel()

(DeiT divides by the number of logits, batch x classes, not by the batch).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from resmlp.core.config import check_choice
from resmlp.core.errors import UserError
from resmlp.core.weights import WeightsSpec, timm_spec
from resmlp.models.load import load_classifier, timm_weights



def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                      kind: str = "hard", alpha: float = 0.5, tau: float = 1.0,
                      base_criterion=None) -> torch.Tensor:
    """(1 - alpha) * base(student, targets) + alpha * distillation term.

    targets: class indices (B,) or soft targets (B, C) from mixup / label smoothing.
    base_criterion: the label loss (the trainer passes its SoftTargetCrossEntropy /
      LabelSmoothingCrossEntropy); None: cross-entropy with hard or soft targets.
    """
    check_choice("distill.type", kind)
    if base_criterion is not None:
        base = base_criterion(student_logits, targets)
    elif targets.dim() == 2:
        base = torch.sum(-targets * F.log_softmax(student_logits, dim=-1), dim=-1).mean()
    else:
        base = F.cross_entropy(student_logits, targets)
    teacher_logits = teacher_logits.detach()
    if kind == "hard":
        kd = F.cross_entropy(student_logits, teacher_logits.argmax(dim=1))
    else:
        kd = F.kl_div(F.log_softmax(student_logits / tau, dim=1), F.log_softmax(teacher_logits / tau, dim=1),
                      reduction="sum", log_target=True) * (tau * tau) / student_logits.numel()
    return (1 - alpha) * base + alpha * kd


# ----------------------------------------------------------------------------------------
# The teacher
# ----------------------------------------------------------------------------------------

def _timm_teacher(spec: WeightsSpec) -> nn.Module:
    import timm
    name = spec.timm_name
    if spec.flag:
        raise UserError(f"teacher {spec}: a teacher needs trained weights; pass {spec.plain} "
                        "(pretrained, needs a download) or a checkpoint of a trained classifier")
    if not timm.is_model(name):
        raise UserError(f"timm has no model {name!r} for the teacher; e.g. "
                        f"teacher={timm_spec('regnety_160.deit_in1k')}")
    return timm_weights(spec, True, "train a teacher here (bash run.sh supervised regnety_016 ...) and pass its "
                        f"run dir, or pass a downloaded state_dict file with distill.teacher_model={name}",
                        what="teacher ")


def load_teacher(spec: WeightsSpec | str, num_classes: int, data_name: str, img_size: int, device,
                 teacher_model: str | None = None) -> tuple[nn.Module, dict]:
    """The teacher classifier in eval mode without gradients, and a description of it.

    spec: a run dir / checkpoint of this project's supervised, distill or finetune commands
    (its saved config names the architecture), a foreign classifier state_dict with
    `teacher_model` naming the architecture, or timm's model with its pretrained weights.
    The teacher must predict the data's classes and take its image size.
    """
    spec = WeightsSpec.parse(spec)
    if spec.path is not None:
        model, name = load_classifier(spec, teacher_model)
    else:
        model, name = _timm_teacher(spec), spec.timm_name
    model.eval().requires_grad_(False)
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, 3, img_size, img_size))
    except Exception as e:  # noqa: BLE001 - e.g. a ResMLP teacher built for another size
        raise UserError(f"teacher {spec} cannot take {img_size}px images of {data_name} "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    k = int(out.shape[-1])
    if k != num_classes:
        raise UserError(f"teacher {spec} predicts {k} classes but {data_name} has {num_classes}; "
                        "use a teacher trained on this dataset")
    info = {"spec": spec.text, "model": name, "params": sum(p.numel() for p in model.parameters())}
    if spec.path is not None:
        res_file = spec.file.parent / "results.json"
        if res_file.exists():
            import json
            try:
                res = json.loads(res_file.read_text())
                info["top1"] = res.get("top1")
            except (OSError, ValueError):
                pass
    return model.to(device), info
