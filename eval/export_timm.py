"""What timm builds of an exported ResMLP: timm's entry point of its size, where there is
one, and the MlpMixer line that builds it at any size (the export cards' `timm` entry, the
Hub folder's config and model card)."""
from __future__ import annotations

from collections.abc import Mapping

# timm's ResMLP entry points, by (dim, depth, patch size) at 224 px
TIMM_NAMES = {(384, 12, 16): "resmlp_12_224", (384, 24, 16): "resmlp_24_224", (384, 36, 16): "resmlp_36_224",
              (768, 24, 8): "resmlp_big_24_224"}
# what those entry points build, at any size: MlpMixer(**kwargs, block_layer=ResBlock, norm_layer=Affine)
TIMM_CLASS = "timm.models.mlp_mixer.MlpMixer"
TIMM_LAYERS = {"block_layer": "ResBlock", "norm_layer": "Affine"}


def timm_name(arch: Mapping) -> str | None:
    """timm's resmlp entry point that builds `arch`, where there is one: those entry points
    fix width, depth, patch size and MLP ratio (a keyword for one of them is an error there)
    and take any image size and channels."""
    if float(arch.get("mlp_ratio", 4.0)) != 4.0:
        return None
    return TIMM_NAMES.get((arch["dim"], arch["depth"], arch["patch_size"]))


def timm_entry(arch: Mapping, img, fmt: str, file: str) -> dict:
    """How timm builds this model and loads the file, for any size: timm's MlpMixer with
    ResMLP's block and Affine (what its resmlp_* entry points build) at this model's sizes,
    loaded strictly. timm.create_model cannot take other sizes (its entry points fix them),
    and its pretrained=True path loads non-strictly once num_classes differs from its 1000.
    `model`: timm's entry point of the same width, depth and patch size, where there is one."""
    kwargs = {"num_classes": 0, "img_size": img, "patch_size": arch["patch_size"], "embed_dim": arch["dim"],
              "num_blocks": arch["depth"], "mlp_ratio": arch.get("mlp_ratio", 4.0), "in_chans": arch.get("in_chans", 3)}
    names = ["MlpMixer", *TIMM_LAYERS.values()] + (["checkpoint_filter_fn"] if fmt == "official" else [])
    weights = f"torch.load({file!r}, map_location='cpu', weights_only=True)"
    if fmt == "official":  # timm's own converter of the official keys
        weights = f"checkpoint_filter_fn({weights}, model)"
    build = ", ".join([f"{k}={v!r}" for k, v in kwargs.items()] + [f"{k}={v}" for k, v in TIMM_LAYERS.items()])
    return {"model": timm_name(arch), "class": TIMM_CLASS,
            "kwargs": kwargs, "layers": TIMM_LAYERS,
            "load": f"import torch; from timm.models.mlp_mixer import {', '.join(names)}; "
                    f"model = MlpMixer({build}); model.load_state_dict({weights})"}
