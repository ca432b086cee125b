"""`export format=hub`: a folder that timm builds by name and the Hugging Face Hub takes as
it is, the layout timm's own push_to_hf_hub writes:

    config.json        timm's pretrained config: `architecture` (the entry point timm calls),
                       `model_args` (its keyword arguments), `num_classes: 0` and
                       `pretrained_cfg` (input size, mean, std, interpolation, crop)
    model.safetensors  the backbone in timm's keys
    README.md          the model card: data, recipe, epochs, the run's k-NN and linear
                       results with their protocol, how to load it

timm.create_model("local-dir:<folder>", pretrained=True) builds it, and after
`hf upload <user>/<repo> <folder>` (huggingface_hub's CLI) so does "hf-hub:<user>/<repo>". timm's
resmlp_*_224 entry points fix width, depth, patch size and MLP ratio (a model_arg for one of
them is an error there), so they build only the paper's sizes, at any image size. For another
size config.json names this project's builder of the same family (registered with timm by
`import resmlp.models`; models/registry.py's load_hub_weights reads the folder), and the card
gives timm's MlpMixer line that builds it with timm alone.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from resmlp.core.checkpoint import atomic_write
from resmlp.eval.export_timm import timm_entry, timm_name
from resmlp.models.load import model_label
from resmlp.models.registry import HUB_WEIGHTS

CONFIG, CARD = "config.json", "README.md"


def hub_config(info: Mapping, data: Mapping) -> dict:
    """config.json, as timm's save_config_for_hf lays it out (models/_hub.py) and its
    load_model_config_from_path reads it: top-level architecture, num_classes, model_args;
    the data config in pretrained_cfg."""
    arch = info["arch"]
    channels, h, w = data["input_size"]
    args = {"num_classes": 0, "img_size": [h, w], "in_chans": channels}
    name, first_conv = timm_name(arch), "stem.proj"
    if name:
        args["global_pool"] = "avg"
    else:  # this project's builder, which takes the sizes
        name, first_conv = info["model"], "patch_embed.proj"
        args.update(dim=arch["dim"], depth=arch["depth"], patch_size=arch["patch_size"],
                    mlp_ratio=float(arch.get("mlp_ratio", 4.0)))
    return {"architecture": name, "num_classes": 0, "num_features": arch["dim"], "global_pool": "avg",
            "model_args": args,
            "pretrained_cfg": {"custom_load": False, "input_size": [channels, h, w], "fixed_input_size": True,
                               "interpolation": data["interpolation"], "crop_pct": data["crop_ratio"],
                               "crop_mode": "center", "mean": data["mean"], "std": data["std"], "num_classes": 0,
                               "pool_size": None, "first_conv": first_conv, "classifier": "head"}}


def write_hub(sd: Mapping[str, torch.Tensor], info: Mapping, data: Mapping, folder: Path, results: Mapping) -> dict:
    """Write the folder (`sd` in timm's keys); the export card's fields. The files are made in
    a folder beside it and moved in at the end, so a killed export leaves no half folder."""
    from safetensors.torch import save_file

    config = hub_config(info, data)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        with atomic_write(tmp / CONFIG, "w", what="the Hub config") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        save_file(dict(sd), str(tmp / HUB_WEIGHTS), metadata={"format": "pt"})
        with atomic_write(tmp / CARD, "w", what="the model card") as f:
            f.write(model_card(info, data, results))
        if folder.exists():  # the same weights again, or out_ok=true: the three files replaced, others kept
            for name in (CONFIG, HUB_WEIGHTS, CARD):
                os.replace(tmp / name, folder / name)
        else:
            os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    own = timm_name(info["arch"]) is None
    return {"hub": {"files": [CONFIG, HUB_WEIGHTS, CARD], "architecture": config["architecture"],
                    "model_args": config["model_args"], "timm_alone": not own,
                    "upload": f"hf upload <user>/<repo> {folder}"},
            "load": load_line(f"local-dir:{folder}", own),
            "timm": timm_entry(info["arch"], data["img_size"], "timm", HUB_WEIGHTS)}


def load_line(where: str, own: bool) -> str:
    """The one line that builds the folder's model in timm."""
    line = f"timm.create_model({where!r}, pretrained=True)"
    return f"import resmlp.models, timm; {line}" if own else f"import timm; {line}"


def model_card(info: Mapping, data: Mapping, results: Mapping) -> str:
    """README.md: what the weights are, how they were trained and judged, how to load them."""
    arch, cfg = info["arch"], info.get("config") or {}
    own = timm_name(arch) is None
    dino = _is_dino(info)
    channels, h, w = data["input_size"]
    what = (f"The {info.get('key') or 'teacher'} network of a DINO run (self-supervised, no labels), without its "
            "head" if dino else f"The backbone of a {info.get('source')} checkpoint, without its head")
    lines = ["---", "library_name: timm", "tags:", "- image-feature-extraction", "- timm", "- resmlp",
             *(["- dino"] if dino else []), "---", "",
             f"# {model_label(info)}" + (", self-supervised with DINO" if dino else ""), "",
             f"{what}: a ResMLP {arch['dim']} wide, {arch['depth']} blocks deep, {arch['patch_size']} px patches "
             f"at {h}x{w} px ({channels} channels in). It returns {arch['dim']} pooled features per image. "
             "Exported by resmlp-ssl.", "",
             "## Load", "", "```python", load_line("hf-hub:<user>/<repo>", own) + "   # from the Hub",
             load_line("local-dir:<this folder>", own) + "   # from disk", "```", ""]
    if own:
        entry = timm_entry(arch, data["img_size"], "timm", HUB_WEIGHTS)
        kwargs = ", ".join(f"{k}={v!r}" for k, v in entry["kwargs"].items())
        lines += [f"config.json names resmlp-ssl's `{info['model']}` builder: timm's own ResMLP entry points fix "
                  "their width, depth and patch size. `import resmlp.models` (resmlp-ssl installed) registers it "
                  "with timm. With timm alone, the same network and weights:", "", "```python",
                  "from safetensors.torch import load_file",
                  "from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock",
                  f"model = MlpMixer({kwargs}, block_layer=ResBlock, norm_layer=Affine)",
                  f"model.load_state_dict(load_file({HUB_WEIGHTS!r}))", "```", ""]
    lines += [f"Its input: {'RGB images' if channels == 3 else f'{channels}-channel images'}, resized "
              f"({data['interpolation']}) to {round(h / data['crop_ratio'])} px on the shorter side (crop_pct "
              f"{data['crop_ratio']:g}) and center-cropped to {h}x{w}, scaled to [0, 1] and normalized with mean "
              f"{data['mean']} and std {data['std']} (`timm.data.resolve_model_data_config(model)` reads them "
              "from config.json).", "", "## Training", "", "| | |", "|---|---|",
              *(f"| {k} | {v} |" for k, v in _training(info, cfg, data).items()), "", "## Results", "",
              *_results(results), "", "## Files", "",
              f"`{CONFIG}` (timm's pretrained config), `{HUB_WEIGHTS}` (timm's keys), this card. Written by "
              "resmlp-ssl's `bash run.sh export <run> format=hub`; put on the Hub with "
              "`hf upload <user>/<repo> <this folder>` (huggingface_hub's CLI; older releases: "
              "`huggingface-cli upload`).", ""]
    return "\n".join(lines)


def _training(info: Mapping, cfg: Mapping, data: Mapping) -> dict:
    """The Training table's rows: what the checkpoint's saved config says."""
    d = cfg.get("data") or {}
    subset = f", {d['subset']} images" if d.get("subset") else ""
    method = cfg.get("command") or info.get("source")
    rows = {"method": f"{method} (self-supervised)" if _is_dino(info) else method,
            "data": f"{data.get('name') or 'unknown'}{subset}, {data['img_size']} px"}
    if cfg.get("recipe"):
        rows["recipe"] = ", ".join(cfg["recipe"]) if isinstance(cfg["recipe"], list) else str(cfg["recipe"])
    if info.get("epoch") is not None:
        rows["epochs"] = f"{info['epoch']}" + (f" of {cfg['epochs']}" if cfg.get("epochs") else "")
    if cfg.get("batch_size"):
        rows["batch"] = f"{cfg['batch_size']} images (global)"
    rows["weights"] = f"the {info.get('key') or 'backbone'} network, weights hash {info.get('weights_hash')}"
    return rows


def _is_dino(info: Mapping) -> bool:
    """Whether the weights are a DINO network (this project's or DINO's own checkpoint)."""
    return str(info.get("source")).startswith("dino")


def _results(results: Mapping) -> list[str]:
    """The Results section: the k-NN and linear probe of these weights, each with its protocol."""
    lines = []
    knn, linear = results.get("knn"), results.get("linear")
    if knn and "knn_top1" in knn:
        lines.append(f"- k-NN top-1 **{knn['knn_top1']:.2f}**, top-5 {knn.get('knn_top5', float('nan')):.2f} "
                     f"(DINO's weighted k-NN: cosine similarity, k={knn.get('knn_k')}, T={knn.get('knn_T')}; "
                     f"{_on(knn.get('data'), BANK)}), at the end of training")
    elif knn:
        protocol = knn.get("protocol") or {}
        for k, r in (knn.get("results") or {}).items():
            lines.append(f"- k-NN top-1 **{r['top1']:.2f}**, top-5 {r['top5']:.2f} (DINO's weighted k-NN: "
                         f"cosine similarity, k={k}, T={protocol.get('temperature')}; {_on(knn.get('data'), BANK)})")
    if linear and "linear_top1" in linear:
        protocol = linear.get("linear_protocol") or "DINO's: SGD over a learning-rate grid, the best on the test split"
        lines.append(f"- linear probe top-1 **{linear['linear_top1']:.2f}**, top-5 "
                     f"{linear.get('linear_top5', float('nan')):.2f} (frozen features; protocol: "
                     f"{_words(protocol)}; {_on(linear.get('data'), PROBE)}), at the end of training")
    elif linear:
        lines.append(f"- linear probe top-1 **{linear['top1']:.2f}**, top-5 {linear.get('top5', float('nan')):.2f} "
                     f"(frozen features; protocol: {_words(linear.get('protocol'))}; {_on(linear.get('data'), PROBE)})")
    return lines or ["No k-NN or linear probe of these weights was found beside the checkpoint "
                     "(`bash run.sh knn <run>` and `bash run.sh linear <run>` write them before an export)."]


BANK = "the train split the bank, the test split the queries"
PROBE = "trained on the train split, measured on the test split"


def _on(data: Mapping | None, roles: str) -> str:
    """The labeled set a result was measured on, and what each split was, in words."""
    data = data or {}
    subset = f", subset {data['subset']}" if data.get("subset") else ""
    return f"{data.get('name') or 'its labeled set'}{subset}: {roles}"


def _words(protocol) -> str:
    """A protocol as a results file records it (a name, or a dict with one) in words."""
    if isinstance(protocol, Mapping):
        return ", ".join(f"{k} {v}" for k, v in protocol.items())
    return str(protocol) if protocol else "DINO's (SGD over a learning-rate grid, the best on the test split)"
