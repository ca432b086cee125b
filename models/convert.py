"""ResMLP weights in other projects' keys: timm's `resmlp_*_224` and the official
facebookresearch/deit `resmlp_models.py`, read into ours (`convert_state_dict`,
`load_pretrained`) and written back out (`export_state_dict`, for `run.sh export`).

The key map (official | timm | ours, per block i): blocks.i.attn | linear_tokens |
cross_patch; gamma_1/2 | ls1/2 | ls1/2; mlp | mlp_channels | mlp; patch_embed.proj |
stem.proj | patch_embed.proj. timm keeps each Affine's alpha and beta as [1, 1, D], the
others as [D]. Checkpoint files (wrapped in 'model', 'teacher', DDP's 'module.', ...) are
opened by resmlp.models.load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

import torch

from resmlp.core.errors import UserError
from resmlp.models.resmlp import ResMLP

# (pattern, replacement) applied to full keys; anchored so that e.g. timm's
# "mlp_channels" is not caught by a rule for "mlp".
_TIMM_RULES = [
    (r'^stem\.proj\.', 'patch_embed.proj.'),
    (r'^(blocks\.\d+)\.linear_tokens\.', r'\1.cross_patch.'),
    (r'^(blocks\.\d+)\.mlp_channels\.', r'\1.mlp.'),
]
_OFFICIAL_RULES = [
    (r'^(blocks\.\d+)\.attn\.', r'\1.cross_patch.'),
    (r'^(blocks\.\d+)\.gamma_1$', r'\1.ls1'),
    (r'^(blocks\.\d+)\.gamma_2$', r'\1.ls2'),
]
_OFFICIAL_KEY = re.compile(r'^blocks\.\d+\.(attn\.|gamma_[12]$)')


def detect_format(sd: Mapping) -> str:
    """'timm', 'official' or 'resmlp' (ours) for a plain state_dict."""
    if any(k.startswith('stem.proj.') or '.linear_tokens.' in k or '.mlp_channels.' in k for k in sd):
        return 'timm'
    if any(_OFFICIAL_KEY.match(k) for k in sd):
        return 'official'
    return 'resmlp'


def convert_state_dict(sd: Mapping) -> dict:
    """A timm (resmlp_*_224), official (facebookresearch/deit resmlp_models.py) or own
    plain state_dict -> this module's keys and shapes (Aff alpha/beta as [D]). The format
    is detected from the keys; our own keys pass through. Checkpoint files (wrapped in
    'model', 'teacher', DDP's 'module.', ...) are opened by resmlp.models.load."""
    fmt = detect_format(sd)
    rules = {'timm': _TIMM_RULES, 'official': _OFFICIAL_RULES}.get(fmt, [])
    out = {}
    for k, v in sd.items():
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        if (k.endswith('.alpha') or k.endswith('.beta')) and v.dim() > 1:
            v = v.reshape(-1)  # timm keeps [1, 1, D]
        out[k] = v
    return out


# ours -> theirs, for export: the inverse of the rules above, on the paper's architecture
_TO_TIMM = [
    (r'^patch_embed\.proj\.', 'stem.proj.'),
    (r'^(blocks\.\d+)\.cross_patch\.', r'\1.linear_tokens.'),
    (r'^(blocks\.\d+)\.mlp\.', r'\1.mlp_channels.'),
]
_TO_OFFICIAL = [
    (r'^(blocks\.\d+)\.cross_patch\.', r'\1.attn.'),
    (r'^(blocks\.\d+)\.ls1$', r'\1.gamma_1'),
    (r'^(blocks\.\d+)\.ls2$', r'\1.gamma_2'),
]
# Every key of the paper's model (linear cross-patch, Affine, average pooling) in our names.
_PAPER_KEY = re.compile(r'^(patch_embed\.proj\.(weight|bias)|norm\.(alpha|beta)|head\.(weight|bias)|'
                        r'blocks\.\d+\.(norm[12]\.(alpha|beta)|cross_patch\.(weight|bias)|ls[12]|'
                        r'mlp\.fc[12]\.(weight|bias)))$')
EXPORT_FORMATS = ('timm', 'official')


def export_state_dict(sd: Mapping, fmt: str) -> dict:
    """Our state_dict -> timm's keys ('timm': timm's resmlp_*_224, Affine as [1, 1, D]) or
    the official facebookresearch/deit ones ('official'): convert_state_dict undone.
    Only the paper's architecture has a counterpart there."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"format={fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    other = [k for k in sd if not _PAPER_KEY.match(k)]
    if other:
        raise UserError(f"format={fmt} needs the paper's ResMLP (linear cross-patch, Affine, average pooling); "
                        f"this one has {other[0]!r}: export it with format=safetensors")
    rules = _TO_TIMM if fmt == 'timm' else _TO_OFFICIAL
    out = {}
    for k, v in sd.items():
        for pattern, repl in rules:
            k = re.sub(pattern, repl, k)
        if fmt == 'timm' and (k.endswith('.alpha') or k.endswith('.beta')):
            v = v.reshape(1, 1, -1)
        out[k] = v
    return out


@dataclass
class LoadReport:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "key: ckpt shape vs model shape"

    def __bool__(self) -> bool:  # true when something did not fit
        return bool(self.missing or self.unexpected or self.mismatched)

    def summary(self, show: int = 3) -> str:
        parts = []
        for what, keys in (('missing', self.missing), ('unexpected', self.unexpected),
                           ('shape-mismatched', self.mismatched)):
            if keys:
                more = f', ... {len(keys) - show} more' if len(keys) > show else ''
                parts.append(f"{len(keys)} {what} ({'; '.join(keys[:show])}{more})")
        return ', '.join(parts) if parts else 'all keys match'


def _shape(t: torch.Tensor) -> str:
    return '[' + ','.join(str(s) for s in t.shape) + ']'


def load_pretrained(model: ResMLP, sd: Mapping, strict: bool = True,
                    ignore_head: bool = False) -> LoadReport:
    """Convert `sd` (any format convert_state_dict knows) and load it into `model`.

    strict: raise UserError naming the missing, unexpected and shape-mismatched keys (the
      first few of each, with counts) if anything does not fit; nothing is loaded then.
    Not strict: load every key that fits, skip the rest, and return the LoadReport.
    ignore_head: drop the checkpoint's head.* and do not ask for the model's (a backbone
      into a model with a new head, or with num_classes=0).
    """
    sd = convert_state_dict(sd)
    own = model.state_dict()
    if ignore_head:
        sd = {k: v for k, v in sd.items() if not k.startswith('head.')}
        own = {k: v for k, v in own.items() if not k.startswith('head.')}
    report = LoadReport(
        missing=[k for k in own if k not in sd],
        unexpected=[k for k in sd if k not in own],
        mismatched=[f'{k}: {_shape(sd[k])} vs model {_shape(own[k])}'
                    for k in sd if k in own and sd[k].shape != own[k].shape],
    )
    if strict and report:
        raise UserError(f'checkpoint does not fit the model: {report.summary()}')
    fitting = {k: v for k, v in sd.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(fitting, strict=False)
    return report
