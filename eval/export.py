"""`run.sh export <checkpoint | run dir> [format=timm|official|safetensors] [key=student]`:
a backbone for use outside this project, with a JSON card beside it that says what it is
and how to load it. The weights come through resmlp.models.load, as every command's do,
and leave in timm's or the official keys through resmlp.models.convert.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write
from resmlp.core.config import check_choice
from resmlp.core.errors import UserError
from resmlp.core.report import write_json
from resmlp.core.weights import WeightsSpec
from resmlp.models import export_state_dict
from resmlp.models.load import load_backbone

# timm's ResMLP entry points, by (dim, depth, patch size) at 224 px
TIMM_NAMES = {(384, 12, 16): "resmlp_12_224", (384, 24, 16): "resmlp_24_224", (384, 36, 16): "resmlp_36_224",
              (768, 24, 8): "resmlp_big_24_224"}
# what those entry points build, at any size: MlpMixer(**kwargs, block_layer=ResBlock, norm_layer=Affine)
TIMM_CLASS = "timm.models.mlp_mixer.MlpMixer"
TIMM_LAYERS = {"block_layer": "ResBlock", "norm_layer": "Affine"}


def export(spec: WeightsSpec | str | os.PathLike, fmt: str = "timm", key: str = "teacher", out: str | None = None,
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
    spec = WeightsSpec.parse(spec)
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
    if fmt != "safetensors":
        card["timm"] = timm_entry(arch, img, fmt, weights.name)
    else:
        card["load"] = (f"resmlp.models.load_pretrained(resmlp.models.create_model({info['model']!r}, num_classes=0, "
                        f"**architecture), safetensors.torch.load_file({weights.name!r}))")
    knn = _known_knn(info)
    if knn:
        card["knn"] = knn
    return card


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
    return {"model": TIMM_NAMES.get((arch["dim"], arch["depth"], arch["patch_size"])), "class": TIMM_CLASS,
            "kwargs": kwargs, "layers": TIMM_LAYERS,
            "load": f"import torch; from timm.models.mlp_mixer import {', '.join(names)}; "
                    f"model = MlpMixer({build}); model.load_state_dict({weights})"}


def _known_knn(info: Mapping) -> dict | None:
    """The k-NN result of the checkpoint's run, from its results.json or knn.json, with the
    labeled set it ran on (`data`: its train split the bank, its test split the queries)."""
    if not info.get("run_dir"):
        return None
    run = Path(info["run_dir"])
    try:
        res = json.loads((run / "results.json").read_text())
        if "knn_top1" in res and (info.get("key") in (None, "teacher")):
            return {**{k: res.get(k) for k in ("knn_top1", "knn_top5", "knn_k", "knn_T") if k in res},
                    "data": _knn_data(info.get("config") or {}, res)}
    except (OSError, ValueError):
        pass
    try:
        res = json.loads((run / "knn.json").read_text())
        if (res.get("checkpoint") or {}).get("weights_hash") == info.get("weights_hash"):
            data = dict(res.get("data") or {})
            data.setdefault("root", ((res.get("config") or {}).get("data") or {}).get("root"))
            return {"results": res.get("results"), "protocol": res.get("protocol"), "data": data}
    except (OSError, ValueError):
        pass
    return None


def _knn_data(cfg: Mapping, results: Mapping) -> dict:
    """The labeled set a training run's k-NN read: `eval.data` (its root and subset) when
    the run named one, else its training set (resmlp.data.datasets.eval_data)."""
    judge = cfg.get("eval") or {}
    if judge.get("data"):
        src = {"name": judge["data"], "root": judge.get("root"), "subset": judge.get("subset")}
    else:
        data = cfg.get("data") or {}
        src = {"name": results.get("eval_data") or data.get("name") or results.get("data"),
               "root": data.get("root"), "subset": data.get("subset")}
    return {**src, "bank": "train split", "queries": "test split"}


def results_dir(cfg) -> Path | None:
    """Where run() writes: out=, else export/ beside the checkpoint (timm's weights are refused later)."""
    if cfg.out:
        return Path(cfg.out)
    spec = WeightsSpec.parse(cfg.checkpoint)
    return None if spec.is_timm else spec.file.parent / "export"


def run(cfg) -> int:
    """bash run.sh export <checkpoint | run dir> [format=timm|official|safetensors] [key=student] [out=...]"""
    weights, card = export(WeightsSpec.parse(cfg.checkpoint), str(cfg.export.format), str(cfg.features.key),
                           cfg.out, replace=bool(cfg.out_ok))
    print(f"wrote {weights}\nwrote {card}", flush=True)
    return 0
