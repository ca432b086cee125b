"""Signs of DINO collapse, read off the teacher's output.

Two ways to collapse (DINO paper, Sec. 5.3): every image to the same one-hot output
(teacher entropy -> 0) or to the uniform output (entropy -> ln K, and the loss sticks
at ln K). The KL between the teacher's distribution and the distribution of the
center alone shows how much the output depends on the image at all.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def teacher_stats(teacher_out: torch.Tensor, center: torch.Tensor, temp: float) -> dict:
    """Mean entropy of softmax((t - c)/temp) and its mean KL to softmax(c/temp)."""
    logp = F.log_softmax((teacher_out.float() - center.reshape(1, -1)) / temp, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1).mean()
    logq = F.log_softmax(center.reshape(1, -1).float() / temp, dim=-1)
    kl = (p * (logp - logq)).sum(-1).mean()
    return {"teacher_entropy": float(entropy), "teacher_kl_center": float(kl)}


def collapse_warning(mean_entropy: float, out_dim: int) -> str | None:
    top = math.log(out_dim)
    if mean_entropy > 0.97 * top:
        return (f"teacher output is near uniform (entropy {mean_entropy:.2f} of max {top:.2f}) for a whole "
                "epoch: DINO may have collapsed; lower dino.teacher_temp or raise optim.lr warm-up")
    if mean_entropy < 0.02 * top:
        return (f"teacher output is near one-hot (entropy {mean_entropy:.3f}) for a whole epoch: DINO may "
                "have collapsed; raise dino.center_momentum or dino.teacher_temp")
    return None
