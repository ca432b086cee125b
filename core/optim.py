"""Parameter groups and the learning-rate rule shared by every trainer.

DINO's rule (no weight decay for biases and 1-D parameters) would still decay timm's
Affine alpha/beta, which are stored as [1, 1, D]. So Affine and LayerScale parameters
are excluded by name as well as by shape.
"""
from __future__ import annotations

import torch.nn as nn

NO_DECAY_NAMES = ("alpha", "beta", "gamma", "gamma_1", "gamma_2", "ls1", "ls2", "cls_token")


def no_weight_decay(name: str, param: nn.Parameter) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    parts = name.split(".")
    return (param.ndim <= 1 or leaf == "bias" or leaf in NO_DECAY_NAMES
            or any(p in ("ls1", "ls2") for p in parts))


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups: `decay` (weight_decay set by the trainer) and `no_decay` (always 0)."""
    decay, no_decay = [], []
    # Models may name more (timm's convention), e.g. a class token.
    named = getattr(model, "no_weight_decay", lambda: set())()
    for name, p in model.named_parameters():
        if p.requires_grad:
            spared = no_weight_decay(name, p) or name in named or name.split(".", 1)[-1] in named
            (no_decay if spared else decay).append(p)
    return [{"params": decay, "name": "decay"},
            {"params": no_decay, "name": "no_decay", "weight_decay": 0.0}]


def scaled_lr(optim_cfg, batch_size: int) -> float:
    """The linear scaling rule: `optim.lr` is given for a global batch of `optim.lr_batch`."""
    return float(optim_cfg.lr) * int(batch_size) / int(optim_cfg.lr_batch)
