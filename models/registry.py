"""The family's timm entry points: `timm.create_model('resmlp_s12', ...)` works once
resmlp.models is imported (its __init__ imports this module). The names do not clash with
timm's own resmlp_12_224 family.

pretrained=True reads a folder `export format=hub` wrote for a size timm's own entry points
cannot build: timm.create_model("local-dir:<folder>" | "hf-hub:<user>/<repo>",
pretrained=True) parses its config.json and hands this module the config (where the folder
is) and its model_args. Its model.safetensors (timm's keys) is read by core.checkpoint's
loader, as every weights file is, and loaded strictly by convert.load_pretrained. This
module, not models/load.py, reads it: load.py builds models through the package, which
imports this module.
"""
from __future__ import annotations

from pathlib import Path

from timm.models import register_model

from resmlp.core.checkpoint import load_checkpoint
from resmlp.core.errors import UserError
from resmlp.models.convert import load_pretrained
from resmlp.models.resmlp import ResMLP, create_resmlp

HUB_WEIGHTS = "model.safetensors"  # the weights file of a timm / Hugging Face Hub folder (timm's name)
# What timm.create_model hands an entry point besides the model's own keys: the config's
# model_args come as keys too, and again as pretrained_model_args.
TIMM_ONLY = ("pretrained_cfg_overlay", "cache_dir", "pretrained_model_args")


def _timm_entry(name: str, pretrained: bool, kwargs: dict) -> ResMLP:
    cfg = kwargs.pop("pretrained_cfg", None)
    for k in TIMM_ONLY:
        kwargs.pop(k, None)
    model = create_resmlp(name, **kwargs)
    if pretrained:
        load_hub_weights(model, cfg, name)
    return model


def load_hub_weights(model: ResMLP, pretrained_cfg, name: str) -> None:
    """The weights of a Hub folder into `model`, where `pretrained_cfg` (timm's parse of its
    config.json) says the folder is; a head timm asks for (num_classes=) stays new. The
    config becomes model.pretrained_cfg, which timm.data.resolve_model_data_config reads."""
    cfg = pretrained_cfg.to_dict() if hasattr(pretrained_cfg, "to_dict") else dict(pretrained_cfg or {})
    if cfg.get("source") == "local-dir":
        path = Path(cfg["file"]) / HUB_WEIGHTS
    elif cfg.get("source") == "hf-hub":
        from huggingface_hub import hf_hub_download
        repo, _, revision = str(cfg["hf_hub_id"]).partition("@")
        path = Path(hf_hub_download(repo, HUB_WEIGHTS, revision=revision or None))
    else:
        raise UserError(f"{name} has no downloadable weights; load a state_dict with load_pretrained, or a "
                        "folder of `export format=hub` with timm.create_model('local-dir:<folder>', pretrained=True)")
    if not path.is_file():
        raise UserError(f"{path.parent} holds no {HUB_WEIGHTS}: pass a folder `export format=hub` wrote")
    load_pretrained(model, load_checkpoint(path), ignore_head=True)
    model.pretrained_cfg = cfg


@register_model
def resmlp_s12(pretrained: bool = False, **kwargs) -> ResMLP:
    """ResMLP-S12: dim 384, 12 blocks, patch 16; 15,350,872 params, 3.0 GMACs at 224 px."""
    return _timm_entry("resmlp_s12", pretrained, kwargs)


@register_model
def resmlp_s24(pretrained: bool = False, **kwargs) -> ResMLP:
    """ResMLP-S24: dim 384, 24 blocks, patch 16; 30,020,680 params, 6.0 GMACs at 224 px."""
    return _timm_entry("resmlp_s24", pretrained, kwargs)


@register_model
def resmlp_s36(pretrained: bool = False, **kwargs) -> ResMLP:
    """ResMLP-S36: dim 384, 36 blocks, patch 16; 44,690,488 params, 8.9 GMACs at 224 px."""
    return _timm_entry("resmlp_s36", pretrained, kwargs)


@register_model
def resmlp_b24(pretrained: bool = False, **kwargs) -> ResMLP:
    """ResMLP-B24: dim 768, 24 blocks, patch 16 (B24/8: patch_size=8); 115,736,776 params."""
    return _timm_entry("resmlp_b24", pretrained, kwargs)
