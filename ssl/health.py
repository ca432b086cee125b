"""Signs of DINO collapse, read off the teacher's output.

Two ways to collapse (DINO paper, Sec. 5.3): every image to the same one-hot output
(teacher entropy -> 0) or to the uniform output (entropy -> ln K, and the loss sticks
at ln K). Both make the output independent of the image, which the KL of each image's
teacher distribution to the batch's mean distribution measures: 0 for a constant output
(collapse of either kind), up to ln(batch) when every image gets its own sharp output.
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def teacher_stats(targets: torch.Tensor) -> dict:
    """Mean entropy of the teacher's targets (N, K) as the loss uses them (ssl.loss.DinoLoss.
    targets: after the mean centering or Sinkhorn-Knopp), and their mean KL to the batch's
    mean target (how much the targets depend on the image), as 0-dim tensors on the
    targets' device: reading them is left to the caller (a host sync). Sinkhorn-Knopp
    spreads the batch's mean target over the prototypes, but a KL of 0 still means the same
    target for every image, so the collapse watch reads it under either centering."""
    p = targets.float()
    p_log_p = torch.special.xlogy(p, p)  # 0 where a probability underflowed to 0
    entropy = -p_log_p.sum(-1).mean()
    log_mean = p.mean(0, keepdim=True).clamp_min(1e-30).log()
    kl = (p_log_p - p * log_mean).sum(-1).mean()
    return {"teacher_entropy": entropy, "teacher_kl_mean": kl}


def collapse_warning(mean_entropy: float, out_dim: int) -> str | None:
    top = math.log(out_dim)
    if mean_entropy > 0.97 * top:
        return (f"teacher output is near uniform (entropy {mean_entropy:.2f} of max {top:.2f}) for a whole "
                "epoch: DINO may have collapsed; lower dino.teacher_temp (sharper targets) or lengthen "
                "optim.warmup_epochs")
    if mean_entropy < 0.02 * top:
        return (f"teacher output is near one-hot (entropy {mean_entropy:.3f}) for a whole epoch: DINO may "
                "have collapsed; raise dino.center_momentum or dino.teacher_temp")
    return None


# The KL under which the targets count as drifting, per centering: between the collapsing and
# the learning runs of docs/dino_learning.md. Sinkhorn-Knopp spreads every target over the
# prototypes, so the same teacher reads lower through it than through the mean centering
# (the table there), and its learning runs sat lower too.
COLLAPSE_KL = {"mean": 0.35, "sinkhorn": 0.2}


def collapse_kl(dino_cfg) -> float:
    """dino.collapse_kl, or the threshold for the run's centering when it is null."""
    value = dino_cfg.get("collapse_kl")
    return float(value) if value is not None else COLLAPSE_KL[dino_cfg.centering]


def drift_advice(dino_cfg) -> str:
    """What to change when the targets drift to uniform, for the setting the run is in: the
    remedies that the runs of docs/dino_learning.md found to stop that drift in it."""
    sinkhorn = dino_cfg.centering == "sinkhorn"
    koleo = float(dino_cfg.koleo_weight) > 0
    norm = dino_cfg.bottleneck_norm != "none"
    if not (sinkhorn or koleo or norm):  # DINO as published
        return ("set DINOv2's dino.centering=sinkhorn with dino.koleo_weight=0.1, or this project's "
                "dino.bottleneck_norm=batchnorm, which takes away the part of the head's output that every image "
                "shares")
    if sinkhorn and not koleo:
        return ("add DINOv2's KoLeo term, dino.koleo_weight=0.1: Sinkhorn-Knopp alone did not stop this drift on "
                "a ResMLP")
    return "lower optim.lr or raise dino.momentum_teacher, which slow the drift"


class CollapseWatch:
    """Warns while a collapse to uniform targets happens, not after it: the teacher's KL
    to the batch-mean target (`teacher_kl_mean`) falls long before the entropy reaches
    ln K. `update` takes that KL at every log line; when it has stayed under `threshold`
    for `patience` lines in a row it returns the warning, once, and a line back above the
    threshold starts a new episode. `advice` (drift_advice: the knob that fits the run's
    setting) ends the warning."""

    def __init__(self, threshold: float, patience: int, advice: str = ""):
        if threshold < 0 or patience < 1:
            raise ValueError(f"CollapseWatch needs threshold >= 0 and patience >= 1, got {threshold}, {patience}")
        self.threshold, self.patience, self.advice = float(threshold), int(patience), advice
        self.below = 0

    def update(self, kl: float) -> str | None:
        if not kl < self.threshold:  # a NaN or a healthy value ends an episode
            self.below = 0
            return None
        self.below += 1
        if self.below != self.patience:
            return None
        return (f"the teacher's targets barely depend on the image (KL to the batch-mean target {kl:.3f} < "
                f"{self.threshold:g} for {self.patience} log lines): DINO is collapsing to uniform targets"
                + (f"; {self.advice}" if self.advice else "") + " (docs/dino_learning.md)")

    # The count of lines under the threshold goes into the checkpoint, so that a resumed run
    # neither warns again for an episode it already reported nor forgets one under way.
    def state_dict(self) -> dict:
        return {"below": self.below}

    def load_state_dict(self, state: dict) -> None:
        self.below = int(state["below"])
