"""`run.sh export <checkpoint | run dir> [format=timm|official|safetensors] [key=student]`:
a backbone for use outside this project, with a JSON card beside it that says what it is
and how to load it. The weights come through resmlp.models.load, as every command's do,
and leave in timm's or the official keys through resmlp.models.convert.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write, resolve_checkpoint_path
from resmlp.core.config import check_choice
from resmlp.core.errors import UserError
from resmlp.core.report import write_json
from resmlp.models import export_state_dict
from resmlp.models.load import load_backbone

# timm's ResMLP entry points, by (dim, depth, patch size) at 224 px
TIMM_NAMES = {(384, 12, 16): "resmlp_12_224", (384, 24, 16): "resmlp_24_224", (384, 36, 16): "resmlp_36_224",
              (768, 24, 8): "resmlp_big_24_224"}


def export(spec, fmt: str = "timm", key: str = "teacher", out: str | None = None,
           replace: bool = False) -> tuple[Path, Path]:
    """Write the backbone of `spec` (DINO: its `key` network) for use outside this project,
    and a JSON beside it that says what it is and how to load it. Returns both paths. An
    earlier export of other weights at the same place is refused unless `replace`
    (out_ok=true on the command line); one of the same weights is written again.

    timm         timm's keys (.pth): timm.create_model(<timm name>, pretrained=True,
                 num_classes=0, pretrained_cfg_overlay=dict(file=...)) loads it
    official     facebookresearch/deit resmlp_models.py keys (.pth); timm reads these too
    safetensors  this project's keys in a .safetensors file:
                 resmlp.models.load_pretrained(create_model(...), safetensors.torch.load_file(...))
    """
    check_choice("export.format", fmt)
    model, info = load_backbone(spec, key=key, pretrained=False)
    if not info["is_resmlp"]:
        raise UserError(f"{spec} is a timm {info['model']}: it is a timm model already, nothing to export")
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    base = Path(out) if out else (Path(info["path"]).parent / "export")
    stem = f"{info['model']}_{info['key'] or 'backbone'}_{fmt}"
    weights = base / (stem + (".safetensors" if fmt == "safetensors" else ".pth"))
    if not replace:
        check_replaces(weights, info)
    base.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(weights), metadata={"format": "resmlp-ssl", "model": info["model"]})
    else:
        with atomic_write(weights, what="the exported weights") as f:
            torch.save(export_state_dict(sd, fmt), f)
    card = export_card(info, fmt, weights)
    return weights, write_json(weights.with_suffix(".json"), card)


def check_replaces(weights: Path, info: Mapping) -> None:
    """UserError when `weights` or its card exists and the card does not say it holds the
    same weights (info["weights_hash"]): an export of other weights is not written over."""
    card_path = weights.with_suffix(".json")
    if not (weights.exists() or card_path.exists()):
        return
    try:
        source = json.loads(card_path.read_text()).get("source") or {}
    except (OSError, ValueError, AttributeError):
        source = {}
    if source and source.get("weights_hash") == info.get("weights_hash"):
        return
    what = (f"an export of other weights ({source.get('spec')}, epoch {source.get('epoch')})" if source
            else "a file no export card describes")
    raise UserError(f"{weights if weights.exists() else card_path} holds {what}; choose another out=, or pass "
                    "out_ok=true to replace it")


def export_card(info: Mapping, fmt: str, weights: Path) -> dict:
    """What an exported file holds and how to use it: architecture, the data's
    normalization and image size, and the k-NN result of its run if one is known."""
    arch = dict(info["arch"])
    cfg = info.get("config") or {}
    data = dict(cfg.get("data") or {})
    img = arch.get("img_size", data.get("img_size", 224))
    card = {"format": fmt, "file": weights.name, "num_features": info.get("num_features"),
            "source": {k: info.get(k) for k in ("spec", "source", "key", "epoch", "weights_hash")},
            "architecture": {"model": info["model"], **arch},
            "data": {"name": data.get("name"), "img_size": img, "patch_size": arch.get("patch_size"),
                     "mean": data.get("mean", [0.485, 0.456, 0.406]), "std": data.get("std", [0.229, 0.224, 0.225]),
                     "crop_ratio": data.get("crop_ratio")}}
    timm_name = TIMM_NAMES.get((arch.get("dim"), arch.get("depth"), arch.get("patch_size")))
    if fmt != "safetensors":
        kwargs = {"num_classes": 0}
        if img != 224:
            kwargs["img_size"] = img
        if timm_name is None:
            card["timm"] = None
        else:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            card["timm"] = {"model": timm_name, "kwargs": kwargs,
                            "load": f"timm.create_model({timm_name!r}, pretrained=True, {args}, "
                                    f"pretrained_cfg_overlay=dict(file={str(weights.name)!r}))"}
    else:
        card["load"] = (f"resmlp.models.load_pretrained(resmlp.models.create_model({info['model']!r}, num_classes=0, "
                        f"**architecture), safetensors.torch.load_file({weights.name!r}))")
    knn = _known_knn(info)
    if knn:
        card["knn"] = knn
    return card


def _known_knn(info: Mapping) -> dict | None:
    """The k-NN result of the checkpoint's run, from its results.json or knn.json."""
    if not info.get("run_dir"):
        return None
    run = Path(info["run_dir"])
    try:
        res = json.loads((run / "results.json").read_text())
        if "knn_top1" in res and (info.get("key") in (None, "teacher")):
            return {k: res.get(k) for k in ("knn_top1", "knn_top5", "knn_k", "knn_T", "data") if k in res}
    except (OSError, ValueError):
        pass
    try:
        res = json.loads((run / "knn.json").read_text())
        if (res.get("checkpoint") or {}).get("weights_hash") == info.get("weights_hash"):
            return {"results": res.get("results"), "protocol": res.get("protocol")}
    except (OSError, ValueError):
        pass
    return None


def results_dir(cfg) -> Path | None:
    """Where run() writes: out=, else export/ beside the checkpoint (a timm:<name> is refused later)."""
    if cfg.out:
        return Path(cfg.out)
    spec = str(cfg.checkpoint)
    return None if spec.startswith("timm:") else resolve_checkpoint_path(spec).parent / "export"


def run(cfg) -> int:
    """bash run.sh export <checkpoint | run dir> [format=timm|official|safetensors] [key=student] [out=...]"""
    weights, card = export(cfg.checkpoint, str(cfg.export.format), str(cfg.features.key), cfg.out,
                           replace=bool(cfg.out_ok))
    print(f"wrote {weights}\nwrote {card}", flush=True)
    return 0
