"""DINO's loss: lightly's DINOLoss, which keeps the teacher's center.

For teacher outputs t_i (the 2 global views) and student outputs s_v (all views):

    loss = mean over pairs (i, v), v != i, of  sum_k -softmax((t_i - c) / T_t)_k log softmax(s_v / T_s)_k

and after each call the center moves: c <- m c + (1 - m) mean(t) (m = center_momentum;
lightly's DINOLoss all-reduces mean(t) over the processes itself). The teacher temperature T_t is
passed per call (its warm-up schedule lives in the trainer). tests/test_dino.py checks it
against a plain implementation of DINO's definition.
"""
from __future__ import annotations

import torch.nn as nn


def build_dino_loss(dino_cfg) -> nn.Module:
    from lightly.loss import DINOLoss
    return DINOLoss(dino_cfg.out_dim, student_temp=dino_cfg.student_temp,
                    center_momentum=dino_cfg.center_momentum, warmup_teacher_temp_epochs=0)
