"""`run.sh export <checkpoint | run dir> [format=timm|official|safetensors|onnx|hub] [key=student]`:
a backbone for use outside this project, with a JSON card beside it that says what it is
and how to load it. The weights come through resmlp.models.load, as every command's do,
and leave in timm's or the official keys through resmlp.models.convert; format=onnx
(eval/export_onnx.py) and format=hub (eval/export_hub.py) write the same backbone for ONNX
runtimes and for timm.create_model / the Hugging Face Hub.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write
from resmlp.core.config import CONFIG_DIR, check_choice, method_config
from resmlp.core.errors import UserError
from resmlp.core.files import read_regular, refuse_link
from resmlp.core.report import write_json
from resmlp.core.weights import WeightsSpec
from resmlp.models import export_state_dict
from resmlp.eval.export_timm import timm_entry
from resmlp.models.load import load_backbone

def export(spec: WeightsSpec | str | os.PathLike, fmt: str = "timm", key: str = "teacher", out: str | None = None,
           replace: bool = False, opset: int | None = None) -> tuple[Path, Path]:
    """Write the backbone of `spec` (DINO: its `key` network) for use outside this project,
    and a JSON beside it that says what it is and how to load it. Returns both paths. An
    earlier export of other weights at the same place is refused unless `replace`
    (out_ok=true on the command line); one of the same weights is written again.

    timm         timm's keys (.pth): timm.create_model(<timm name>, pretrained=True,
                 num_classes=0, pretrained_cfg_overlay=dict(file=...)) loads it
    official     facebookresearch/deit resmlp_models.py keys (.pth); timm reads these too
    safetensors  this project's keys in a .safetensors file:
                 resmlp.models.load_pretrained(create_model(...), safetensors.torch.load_file(...))
    onnx         the backbone with its Aff folded (.onnx, opset `opset`: export.opset's default
                 when None), a dynamic batch axis, its input in the metadata: onnxruntime runs it
    hub          a folder (config.json, model.safetensors in timm's keys, README.md):
                 timm.create_model("local-dir:<folder>", pretrained=True) builds it
    """
    check_choice("export.format", fmt)
    if fmt == "onnx":
        from resmlp.eval.export_onnx import require_onnx
        require_onnx()
    spec = WeightsSpec.parse(spec)
    model, info = load_backbone(spec, key=key, pretrained=False)
    if not info["is_resmlp"]:
        raise UserError(f"{spec} is a timm {info['model']}: it is a timm model already, nothing to export")
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    base = Path(out) if out else (Path(info["path"]).parent / "export")
    stem = f"{info['model']}_{info['key'] or 'backbone'}_{fmt}"
    weights = base / (stem + {"safetensors": ".safetensors", "onnx": ".onnx", "hub": ""}.get(fmt, ".pth"))
    keys = {"timm": "timm", "official": "official", "hub": "timm"}.get(fmt)  # the file's keys; None: ours
    foreign = export_state_dict(sd, keys) if keys else sd
    if not replace:
        check_replaces(weights, info)
    if not out:   # beside the checkpoint: its folder's export/ is written in, never a link to elsewhere
        refuse_link(base, within=Path(info["path"]).parent)
    base.mkdir(parents=True, exist_ok=True)
    data = input_spec(info)
    extra = {}
    if fmt == "safetensors":
        from safetensors.torch import save
        with atomic_write(weights, what="the exported weights") as f:
            f.write(save(sd, metadata={"format": "resmlp-ssl", "model": info["model"]}))
    elif fmt == "onnx":
        from resmlp.eval.export_onnx import write_onnx
        extra = write_onnx(model, info, data, weights, int(method_config("export").export.opset if opset is None
                                                              else opset))
    elif fmt == "hub":
        from resmlp.eval.export_hub import write_hub
        extra = write_hub(foreign, info, data, weights, _known_results(info))
    else:
        with atomic_write(weights, what="the exported weights") as f:
            torch.save(foreign, f)
    card = export_card(info, fmt, weights, data, extra)
    return weights, write_json(weights.with_suffix(".json"), card)


def input_spec(info: Mapping) -> dict:
    """What the backbone takes: the training data's normalization, image size and eval crop
    (its config's; defaults.yaml's for weights without one), resized as data/transforms.py's
    eval transform does."""
    from omegaconf import OmegaConf

    from resmlp.data.transforms import BICUBIC
    arch, own = info["arch"], (info.get("config") or {}).get("data") or {}
    data = {**OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "defaults.yaml").data),
            **{k: v for k, v in own.items() if v is not None}}
    img = arch.get("img_size", data["img_size"])
    h, w = (img, img) if isinstance(img, int) else tuple(img)
    return {"name": own.get("name"), "img_size": img, "input_size": [arch.get("in_chans", 3), h, w],
            "patch_size": arch.get("patch_size"), "mean": list(data["mean"]), "std": list(data["std"]),
            "crop_ratio": data["crop_ratio"], "interpolation": BICUBIC.value}


def check_replaces(weights: Path, info: Mapping) -> None:
    """UserError when `weights` or its card exists and the card does not say it holds the
    same weights (info["weights_hash"]): an export of other weights is not written over."""
    card_path = weights.with_suffix(".json")
    if not (weights.exists() or card_path.exists()):
        return
    try:
        source = json.loads(read_regular(card_path)).get("source") or {}
    except (OSError, ValueError, AttributeError):
        source = {}
    if source and source.get("weights_hash") == info.get("weights_hash"):
        return
    what = (f"an export of other weights ({source.get('spec')}, epoch {source.get('epoch')})" if source
            else "a file no export card describes")
    raise UserError(f"{weights if weights.exists() else card_path} holds {what}; choose another out=, or pass "
                    "out_ok=true to replace it")


def export_card(info: Mapping, fmt: str, weights: Path, data: Mapping, extra: Mapping) -> dict:
    """What an exported file holds and how to use it: architecture, the data's
    normalization and image size, and the k-NN result of its run if one is known."""
    arch = dict(info["arch"])
    card = {"format": fmt, "file": weights.name, "num_features": info.get("num_features"),
            "source": {k: info.get(k) for k in ("spec", "source", "key", "epoch", "weights_hash")},
            "architecture": {"model": info["model"], **arch},
            "data": {k: data[k] for k in ("name", "img_size", "patch_size", "mean", "std", "crop_ratio")}}
    if fmt in ("timm", "official"):
        card["timm"] = timm_entry(arch, data["img_size"], fmt, weights.name)
    elif fmt == "safetensors":
        card["load"] = (f"resmlp.models.load_pretrained(resmlp.models.create_model({info['model']!r}, num_classes=0, "
                        f"**architecture), safetensors.torch.load_file({weights.name!r}))")
    else:
        card.update(extra)
    return {**card, **_known_results(info)}


def _known_results(info: Mapping) -> dict:
    """{"knn": ..., "linear": ...}: what the checkpoint's run measured of these weights, where known."""
    found = {"knn": _known_knn(info), "linear": _known_linear(info)}
    return {k: v for k, v in found.items() if v}


def _read_json(path: Path) -> dict:
    """A results file's fields; {} when it is absent or unreadable (a card then leaves them out)."""
    try:
        obj = json.loads(read_regular(path))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _known_linear(info: Mapping) -> dict | None:
    """The linear probe of the checkpoint's weights: the run's own at its end (results.json's
    linear_*, the teacher's), else the last `linear` command's (linear.json) of these weights,
    with its protocol and labeled set."""
    if not info.get("run_dir"):
        return None
    run = Path(info["run_dir"])
    res = _read_json(run / "results.json")
    if "linear_top1" in res and info.get("key") in (None, "teacher"):
        return {**{k: v for k, v in res.items() if k.startswith("linear_")},
                "data": _knn_data(info.get("config") or {}, res)}
    res = _read_json(run / "linear.json")
    if (res.get("checkpoint") or {}).get("weights_hash") == info.get("weights_hash") and "top1" in res:
        keep = ("protocol", "mode", "epochs", "top1", "top5", "lr", "n_train", "n_test", "data")
        return {k: res[k] for k in keep if k in res}
    return None


def _known_knn(info: Mapping) -> dict | None:
    """The k-NN result of the checkpoint's run, from its results.json or knn.json, with the
    labeled set it ran on (`data`: its train split the bank, its test split the queries)."""
    if not info.get("run_dir"):
        return None
    run = Path(info["run_dir"])
    res = _read_json(run / "results.json")
    if "knn_top1" in res and info.get("key") in (None, "teacher"):
        return {**{k: res.get(k) for k in ("knn_top1", "knn_top5", "knn_k", "knn_T") if k in res},
                "data": _knn_data(info.get("config") or {}, res)}
    res = _read_json(run / "knn.json")
    if res and (res.get("checkpoint") or {}).get("weights_hash") == info.get("weights_hash"):
        data = dict(res.get("data") or {})
        data.setdefault("root", ((res.get("config") or {}).get("data") or {}).get("root"))
        return {"results": res.get("results"), "protocol": res.get("protocol"), "data": data}
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
    """bash run.sh export <checkpoint | run dir> [format=timm|official|safetensors|onnx|hub] [key=student] [out=...]"""
    fmt = str(cfg.export.format)
    weights, card = export(WeightsSpec.parse(cfg.checkpoint), fmt, str(cfg.features.key), cfg.out,
                           replace=bool(cfg.out_ok), opset=int(cfg.export.opset))
    print(f"wrote {weights}\nwrote {card}", flush=True)
    if fmt == "hub":
        written = json.loads(card.read_text())
        print(f"load it: {written['load']}\nput it on the Hub: {written['hub']['upload']}", flush=True)
    return 0
