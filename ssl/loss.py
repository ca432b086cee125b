"""DINO's loss, with the teacher's targets centered as DINO does or as DINOv2 does.

For teacher targets q_i (the 2 global views) and student outputs s_v (all views):

    loss = mean over pairs (i, v), v != i, of  sum_k -q_ik log softmax(s_v / T_s)_k

`dino.centering` says how the teacher's outputs t_i become the targets q_i:

- `mean` (DINO): q_i = softmax((t_i - c) / T_t), and after each call the center moves:
  c <- m c + (1 - m) mean(t) (m = center_momentum): lightly's DINOLoss keeps the center and
  moves it (`update_center`, all-reduced over processes by lightly itself); the loss is the
  same cross-entropy as under either centering (tests/test_dino.py checks it against
  lightly's DINOLoss.forward and a plain implementation).
- `sinkhorn` (DINOv2): q = Sinkhorn-Knopp of exp(t / T_t) over the global batch (every
  process's rows of both global views together): the rows of q are each image's target and
  every prototype gets the same share of the batch, which no uniform or one-hot output can
  satisfy. lightly's positionwise Sinkhorn-Knopp (CAPI's) with one position is DINOv2's
  algorithm (three iterations, all-reduced); it also shifts each prototype's logits by
  their maximum over the batch first, which the normalization cancels, so large logits
  (norm_last_layer=false) cannot overflow. No center is used; the buffer stays, at zero,
  so that checkpoints have the same keys under either centering.

`dino.koleo_weight` > 0 adds DINOv2's KoLeo term (lightly's KoLeoLoss) on the student's pooled
features of each global view, per process as DINOv2 computes it: it pushes each image's
feature away from its nearest neighbour in the batch, spreading the features.

The teacher temperature T_t is passed per call (its warm-up schedule lives in the
trainer). tests/test_dino.py checks both against plain implementations.

With `compile=true` the cross-entropy (the student's log-softmax over every view and its
backward: the loss's largest passes) and the mean centering's targets run compiled, each a
region of its own (`DinoLoss.compile_regions`); Sinkhorn-Knopp (its all-reduces) and the
center's update stay eager.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SINKHORN_ITERATIONS = 3  # DINOv2's


def cross_entropy(q: torch.Tensor, student_out: list[torch.Tensor], student_temp: float) -> torch.Tensor:
    """DINO's loss from the targets q ((views x B, K): the teacher's views, view by view)
    and the student's outputs (one (B, K) per view): the mean over every (teacher view,
    other student view) pair of the cross-entropy -sum_k q_k log softmax(s / T_s)_k."""
    q = q.view(-1, student_out[0].shape[0], q.shape[-1])
    log_p = F.log_softmax(torch.stack(student_out).float() / student_temp, dim=-1)
    cross = -torch.einsum("tbk,sbk->ts", q, log_p) / q.shape[1]  # (teacher view, student view)
    cross.fill_diagonal_(0)  # a view is not its own target
    return cross.sum() / (cross.numel() - min(cross.shape))


def centered_softmax(t: torch.Tensor, center: torch.Tensor, teacher_temp: torch.Tensor) -> torch.Tensor:
    """DINO's targets: softmax((t - center) / T_t), T_t a 0-dim tensor (a number would be
    a constant of a compiled graph, one graph per value of its warm-up)."""
    return F.softmax((t - center.reshape(1, -1)) / teacher_temp, dim=-1)


class DinoLoss(nn.Module):
    """`targets(t, T_t)` gives the teacher's targets (probabilities, one row per image),
    `forward` the loss; the step computes the targets once and passes them to both the
    loss and the health statistics, so that the collapse watch reads what is trained on."""

    def __init__(self, dino_cfg):
        super().__init__()
        from lightly.loss import DINOLoss, KoLeoLoss
        self.centering = dino_cfg.centering  # its words: the limit in configs/method/dino.yaml
        self.student_temp = float(dino_cfg.student_temp)
        self.dino = DINOLoss(dino_cfg.out_dim, student_temp=self.student_temp,
                             center_momentum=dino_cfg.center_momentum, warmup_teacher_temp_epochs=0)
        self.koleo_loss = KoLeoLoss()
        self.cross_entropy, self.centered_softmax = cross_entropy, centered_softmax

    def compile_regions(self, on: bool = True) -> None:
        """The cross-entropy and the mean centering's targets compiled (compile=true), or
        eager again (on=False: a run falling back)."""
        from resmlp.core.compiling import compiled
        wrap = compiled if on else (lambda fn: fn)
        self.cross_entropy, self.centered_softmax = wrap(cross_entropy), wrap(centered_softmax)

    @property
    def center(self) -> torch.Tensor:
        return self.dino.center

    @torch.no_grad()
    def targets(self, teacher_out: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        """(N, K) teacher outputs of this process -> (N, K) targets, each row summing to 1."""
        t = teacher_out.float()
        if self.centering == "mean":
            if not isinstance(teacher_temp, torch.Tensor):   # a fill kernel: no copy from the host
                teacher_temp = torch.full((), float(teacher_temp), device=t.device)
            return self.centered_softmax(t, self.center, teacher_temp)
        from lightly.loss.capi_loss import sinkhorn_knopp
        q = sinkhorn_knopp((t / teacher_temp).unsqueeze(1), iterations=SINKHORN_ITERATIONS, gather_distributed=True)
        return q.squeeze(1)

    def forward(self, teacher_out: list[torch.Tensor], student_out: list[torch.Tensor], teacher_temp: float,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss over every (teacher view, other student view) pair; with the mean
        centering the center then moves. `targets`: what `targets` gave for
        torch.cat(teacher_out), computed here when not passed."""
        if targets is None:
            targets = self.targets(torch.cat(teacher_out), teacher_temp)
        loss = self.cross_entropy(targets, student_out, self.student_temp)
        if self.centering == "mean":
            # lightly gives the center new storage at every update (`center.data = ...`); a CUDA
            # graph would keep reading the old one. The new values go back into the one buffer.
            kept = self.center.data
            self.dino.update_center(torch.stack(teacher_out).float())
            kept.copy_(self.center.data)
            self.center.data = kept
        return loss

    def koleo(self, global_features: torch.Tensor) -> torch.Tensor:
        """KoLeo of the student's pooled features of the 2 global views ((2B, D), view by
        view), summed over the views as DINOv2 does; unweighted."""
        return sum(self.koleo_loss(f) for f in global_features.float().chunk(2))


def build_dino_loss(dino_cfg) -> nn.Module:
    return DinoLoss(dino_cfg)
