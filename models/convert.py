"""ResMLP weights in other projects' keys: timm's `resmlp_*_224` and the official
facebookresearch/deit `resmlp_models.py`, read into ours (`convert_state_dict`,
`load_pretrained`) and written back out (`export_state_dict`, for `run.sh export`), by one
table of the names that differ (KEY_NAMES). timm keeps each Affine's alpha and beta as
[1, 1, D], the others as [D]. Checkpoint files (wrapped in 'model', 'teacher', DDP's
'module.', ...) are opened by resmlp.models.load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

import torch

from resmlp.core.errors import UserError
from resmlp.models.resmlp import ResMLP

# Where the keys differ, as (ours, theirs) per format; "{i}" stands for a block's index, a
# name ending in "." for every key under it. Both directions are made from this one table.
KEY_NAMES = {
    'timm': [('patch_embed.proj.', 'stem.proj.'), ('blocks.{i}.cross_patch.', 'blocks.{i}.linear_tokens.'),
             ('blocks.{i}.mlp.', 'blocks.{i}.mlp_channels.')],
    'official': [('blocks.{i}.cross_patch.', 'blocks.{i}.attn.'), ('blocks.{i}.ls1', 'blocks.{i}.gamma_1'),
                 ('blocks.{i}.ls2', 'blocks.{i}.gamma_2')],
}


def _rules(fmt: str, to_ours: bool) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) for re.sub on full keys, anchored so that e.g. timm's
    "mlp_channels" is not caught by a rule for "mlp"."""
    rules = []
    for ours, theirs in KEY_NAMES[fmt]:
        src, dst = (theirs, ours) if to_ours else (ours, theirs)
        pattern = '^' + re.escape(src).replace(re.escape('{i}'), r'(\d+)') + ('' if src.endswith('.') else '$')
        rules.append((re.compile(pattern), dst.replace('{i}', r'\1')))
    return rules


def _rename(key: str, rules) -> str:
    for pattern, repl in rules:
        key = pattern.sub(repl, key)
    return key


def detect_format(sd: Mapping) -> str:
    """'timm', 'official' or 'resmlp' (ours) for a plain state_dict."""
    for fmt in KEY_NAMES:
        if any(pattern.match(k) for pattern, _ in _rules(fmt, to_ours=True) for k in sd):
            return fmt
    return 'resmlp'


def convert_state_dict(sd: Mapping) -> dict:
    """A timm (resmlp_*_224), official (facebookresearch/deit resmlp_models.py) or own
    plain state_dict -> this module's keys and shapes (Aff alpha/beta as [D]). The format
    is detected from the keys; our own keys pass through. Checkpoint files (wrapped in
    'model', 'teacher', DDP's 'module.', ...) are opened by resmlp.models.load."""
    fmt = detect_format(sd)
    rules = _rules(fmt, to_ours=True) if fmt in KEY_NAMES else []
    out = {}
    for k, v in sd.items():
        k = _rename(k, rules)
        if (k.endswith('.alpha') or k.endswith('.beta')) and v.dim() > 1:
            v = v.reshape(-1)  # timm keeps [1, 1, D]
        out[k] = v
    return out


# Every key of the paper's model (linear cross-patch, Affine, average pooling) in our names.
_PAPER_KEY = re.compile(r'^(patch_embed\.proj\.(weight|bias)|norm\.(alpha|beta)|head\.(weight|bias)|'
                        r'blocks\.\d+\.(norm[12]\.(alpha|beta)|cross_patch\.(weight|bias)|ls[12]|'
                        r'mlp\.fc[12]\.(weight|bias)))$')


def export_state_dict(sd: Mapping, fmt: str) -> dict:
    """Our state_dict -> timm's keys ('timm': timm's resmlp_*_224, Affine as [1, 1, D]) or
    the official facebookresearch/deit ones ('official'): convert_state_dict undone.
    Only the paper's architecture has a counterpart there."""
    if fmt not in KEY_NAMES:
        raise UserError(f"format={fmt!r} is not one of {', '.join(KEY_NAMES)}")
    other = [k for k in sd if not _PAPER_KEY.match(k)]
    if other:
        raise UserError(f"format={fmt} needs the paper's ResMLP (linear cross-patch, Affine, average pooling); "
                        f"this one has {other[0]!r}: export it with format=safetensors")
    rules = _rules(fmt, to_ours=False)
    out = {}
    for k, v in sd.items():
        k = _rename(k, rules)
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
