"""ResMLP model family: builders, weight conversion and inference folding.

Importing this package registers resmlp_s12 / s24 / s36 / b24 with timm, so
`timm.create_model('resmlp_s12')` works too.
"""
from resmlp.models.convert import LoadReport, convert_state_dict, detect_format, export_state_dict, load_pretrained
from resmlp.models.fold import fold_affine
from resmlp.models.registry import load_hub_weights  # importing it registers the family with timm
from resmlp.models.resmlp import (
    ARCHS,
    CROSS_PATCHES,
    GRID_ADAPTS,
    NORMS,
    OVERRIDE_KEYS,
    POOLINGS,
    Affine,
    ClassMLPPool,
    CrossPatchConv,
    CrossPatchLinear,
    CrossPatchMLP,
    FusedResMLPBlock,
    ResMLP,
    ResMLPBlock,
    adapt_token_mixing,
    create_resmlp,
)


def list_models() -> list[str]:
    """Names create_model accepts."""
    return list(ARCHS)


def create_model(name: str, **overrides) -> ResMLP:
    """Build a ResMLP by name: resmlp_s12, resmlp_s24, resmlp_s36 or resmlp_b24.

    Overrides (all optional): img_size (224, int or [h, w]), patch_size (16), in_chans (3),
    num_classes (1000; 0 = forward returns pooled (B, D) features), drop_path_rate (0,
    the same for every block), init_values (LayerScale init; default per depth as in
    the official code: S12 0.1, S24 1e-5, S36 1e-6, B24 1e-6), pooling ('avg' |
    'class_mlp'), norm ('affine' | 'layernorm'), cross_patch ('linear' | 'mlp' | 'conv3x3'
    | 'dwconv3x3' | 'dwsep3x3' | 'none'), grid_adapt ('none' | 'interpolate' | 'subgrid';
    can be changed later with `model.grid_adapt = ...`), fused (False; True: FusedResMLPBlocks,
    the same parameters and function with Aff and LayerScale folded on every forward, for
    training; with it token_major, kernels, residual_dtype: resmlp.models.fused.FusedOptions),
    and dim / depth / mlp_ratio for other sizes. An unknown name, key or value
    raises resmlp.core.errors.UserError.
    """
    return create_resmlp(name, **overrides)


__all__ = [
    'ARCHS', 'CROSS_PATCHES', 'GRID_ADAPTS', 'NORMS', 'OVERRIDE_KEYS', 'POOLINGS',
    'Affine', 'ClassMLPPool', 'CrossPatchConv', 'CrossPatchLinear', 'CrossPatchMLP', 'FusedResMLPBlock',
    'LoadReport', 'ResMLP', 'ResMLPBlock', 'adapt_token_mixing', 'convert_state_dict',
    'create_model', 'detect_format', 'export_state_dict', 'fold_affine', 'list_models', 'load_hub_weights',
    'load_pretrained',
]
