"""Build a model from a config's `model:` section: our ResMLPs (their builders are registered
in resmlp.py), or any timm model (`create_timm`)."""
from __future__ import annotations

import torch.nn as nn

from resmlp.core.errors import UserError

# Keys of `model:` that only our ResMLP builders understand; timm models get the rest.
TIMM_KEYS = ("img_size", "drop_path_rate", "in_chans")
# Keys that are not architecture: applied to the built model, never passed to a builder.
RUNTIME_KEYS = ("name", "grad_checkpointing")


def model_kwargs(model_cfg) -> dict:
    """The create_model overrides in a `model:` section (unset keys left to the builder)."""
    return {k: v for k, v in dict(model_cfg).items() if k not in RUNTIME_KEYS and v is not None}


def build_model(model_cfg, num_classes: int = 0) -> nn.Module:
    """num_classes=0 gives the backbone: forward returns pooled features.
    `model.grad_checkpointing=true` recomputes each block's activations in the backward
    pass (timm's set_grad_checkpointing): less memory for about a third more compute."""
    model = _create(model_cfg, num_classes)
    if model_cfg.get("grad_checkpointing"):
        if not hasattr(model, "set_grad_checkpointing"):
            raise UserError(f"model.grad_checkpointing=true: {model_cfg.name} has no activation checkpointing")
        model.set_grad_checkpointing(True)
    return model


def create_timm(name: str, **kwargs) -> nn.Module:
    """timm.create_model, retried without img_size for architectures that take none
    (a convnet): every command builds timm models through here."""
    import timm
    try:
        return timm.create_model(name, **kwargs)
    except TypeError:
        if "img_size" not in kwargs:
            raise
        kwargs = {k: v for k, v in kwargs.items() if k != "img_size"}
        return timm.create_model(name, **kwargs)


def _create(model_cfg, num_classes: int) -> nn.Module:
    from resmlp.models import create_model, list_models
    name = model_cfg.name
    kwargs = model_kwargs(model_cfg)
    if name in list_models():
        return create_model(name, num_classes=num_classes, **kwargs)
    import timm
    if not timm.is_model(name):
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(list_models())} or a timm model")
    timm_kwargs = {k: v for k, v in kwargs.items() if k in TIMM_KEYS}
    return create_timm(name, pretrained=False, num_classes=num_classes, **timm_kwargs)
