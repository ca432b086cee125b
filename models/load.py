"""Checkpoints into models: the one place every command loads weights.

    load_backbone(spec)      any checkpoint -> a frozen feature backbone (evaluators, fine-tuning, export)
    load_classifier(spec)    a trained classifier with its head (the distillation teacher)
    load_into(model, sd)     a state_dict into a built model, every mismatch named
    init_weights(spec, model)  weights to continue training from (dino.init): checked against
                             a built backbone, its patch grid adapted, the DINO head alongside

Run state (optimizer, RNG, resume) is written and read by resmlp.core.checkpoint;
this module reads the weights out of such files and out of everyone else's. Every file is
opened by core.checkpoint's load_checkpoint: weights only, nothing in a file runs (weights_trust=true for
a file from a trusted source that needs more). Nor is a model built that the weights do not
fill: its size is counted on the meta device first (a few KB naming `blocks.9999.*`, or a
saved config naming a depth or width the tensors do not have, is one line, not a build
until memory runs out).

Accepted `spec`s (resmlp.core.weights.WeightsSpec parses them; each entry point takes the
parsed spec or its text):
    <run dir>                  this project's run directory (reads <run dir>/checkpoint.pth)
    <file>                     a torch file holding one of
        - this project's DINO checkpoint: {'format': 'resmlp-ssl', 'config': {...},
          'teacher' / 'student': {'backbone.*', 'head.*'}}; `key` picks the network
        - this project's supervised / fine-tuned checkpoint: {'format': 'resmlp-ssl',
          'model': full classifier state_dict}; the head is dropped
        - an official DINO checkpoint: {'teacher' / 'student': {'module.backbone.*', ...}}
        - a timm or official (facebookresearch/deit) ResMLP state_dict, bare or wrapped
          in {'model': ...} (DeiT) or {'state_dict': ...}
    <file>.safetensors         a state_dict in safetensors' format (timm's, this project's export)
    timm:<name>                timm.create_model(name) with its pretrained weights
    timm:<name>?random         the same architecture with random weights (no download;
                               for smoke tests and for checking a pipeline)

Project checkpoints carry their config, which names the model; foreign state_dicts do
not, so the architecture is read off the weights (dim, in_chans and patch size from the
patch embedding, depth from the block count, the patch grid -> img_size from the
cross-patch matrix, pooling / norm / cross-patch kind from which keys exist). The
weights win over a saved config where they disagree: they are what gets evaluated.

The backbone is built with num_classes=0 (forward returns pooled (B, D) features), in
eval mode. Its state_dict loads into create_model(info['model'], **info['arch'],
num_classes=C) with only head.* missing.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from resmlp.core.checkpoint import FORMAT, load_checkpoint
from resmlp.core.config import check_choice, choices
from resmlp.core.errors import UserError
from resmlp.core.weights import WeightsSpec, timm_spec
from resmlp.models.from_config import build_model, create_timm

DINO_KEYS = choices("features.key")  # the networks a DINO checkpoint holds, which features.key picks
_WRAPPERS = ("model", "state_dict", "model_ema", "state_dict_ema")


# --------------------------------------------------------------------------- hashing

def weights_hash(model_or_sd) -> str:
    """sha256 (hex, 16 chars) of a state_dict's names, dtypes, shapes and bytes.

    Hashes what is evaluated rather than the file, so a checkpoint re-saved in another
    format, or the teacher of a run that has not moved, maps to the same feature cache.
    """
    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name]
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- unwrapping

def _is_state_dict(d) -> bool:
    return isinstance(d, Mapping) and len(d) > 0 and all(
        isinstance(v, torch.Tensor) for v in d.values())


def _strip(sd: Mapping, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def _preview(keys, n: int = 5) -> str:
    keys = list(keys)
    return ", ".join(map(str, keys[:n])) + (", ..." if len(keys) > n else "")


def unwrap(obj: dict, key: str = "teacher", path: str = "") -> tuple[dict, dict]:
    """(plain state_dict of the network to evaluate, info about where it came from)."""
    check_choice("features.key", key)
    ours = obj.get("format") == FORMAT
    info: dict = {"config": obj.get("config") if ours and isinstance(obj.get("config"), Mapping) else None,
                  "command": obj.get("command") if ours else None,
                  "epoch": obj.get("epoch") if isinstance(obj.get("epoch"), int) else None,
                  "key": None}
    if any(k in obj and isinstance(obj[k], Mapping) for k in DINO_KEYS):
        if not isinstance(obj.get(key), Mapping):
            have = [k for k in DINO_KEYS if isinstance(obj.get(k), Mapping)]
            raise UserError(f"{path} has no {key!r} network (it has {', '.join(have)}); "
                            f"use key={have[0]}")
        sd = _strip(obj[key], "module.")
        info.update(source="dino" if ours else "dino-official", key=key)
        if not any(k.startswith("backbone.") for k in sd):
            raise UserError(f"{path}: the {key!r} state_dict has no backbone.* keys "
                            f"(keys: {_preview(sd)}); is it a DINO checkpoint?")
        sd = {k[len("backbone."):]: v for k, v in sd.items() if k.startswith("backbone.")}
        return sd, info
    for w in _WRAPPERS:
        if w in obj and _is_state_dict(obj[w]):
            info["source"] = ("supervised" if ours else f"state_dict['{w}']")
            if ours and info["command"]:
                info["source"] = str(info["command"])
            return _one_network(_strip(obj[w], "module."), info, key, path)
    if _is_state_dict(obj):
        info["source"] = "state_dict"
        return _one_network(_strip(obj, "module."), info, key, path)
    raise UserError(f"{path} holds no model weights (top-level keys: {_preview(obj)}); pass a "
                    "checkpoint of this project, an official DINO checkpoint or a ResMLP state_dict")


def _one_network(sd: dict, info: dict, key: str, where: str) -> tuple[dict, dict]:
    """A checkpoint of one network: asking for a DINO student would silently get it instead."""
    if key == "student":
        raise UserError(f"{where} holds one network ({info['source']}), not DINO's teacher and student: only "
                        "a DINO checkpoint has a student; leave the key at teacher")
    return sd, info


# --------------------------------------------------------------------------- architecture

def infer_arch(sd: Mapping, config_model: Mapping | None = None, img_size=None) -> tuple[str, dict]:
    """(model name, create_model overrides) for a state_dict in this project's keys.

    config_model: the saved config's `model` section, if any (name and the options the
    weights cannot show, e.g. grid_adapt). img_size: the size to use when the weights do
    not fix it (conv / no cross-patch variants with average pooling).
    """
    from resmlp.models import OVERRIDE_KEYS
    from resmlp.models.resmlp import FUSED_OPTIONS

    w = sd.get("patch_embed.proj.weight")
    if w is None or w.dim() != 4:
        raise UserError(f"not a ResMLP state_dict: no patch embedding weight (keys: {_preview(sd)})")
    cfgm = dict(config_model or {})
    arch = {k: cfgm[k] for k in OVERRIDE_KEYS if k in cfgm and cfgm[k] is not None}
    arch.pop("drop_path_rate", None)   # training-only; eval mode ignores it anyway
    for key in ("fused", *FUSED_OPTIONS):  # training-only: the same weights and function either way
        arch.pop(key, None)
    arch.pop("num_classes", None)
    dim, in_chans, p = int(w.shape[0]), int(w.shape[1]), int(w.shape[2])
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not blocks:
        raise UserError(f"not a ResMLP state_dict: no blocks.* keys (keys: {_preview(sd)})")
    if len(blocks) != max(blocks) + 1:   # before anything is built: the depth is the blocks it holds
        raise UserError(f"not a ResMLP state_dict: its blocks are numbered up to {max(blocks)} but it holds "
                        f"{len(blocks)} of them")
    arch.update(dim=dim, in_chans=in_chans, patch_size=p, depth=max(blocks) + 1)
    fc1 = sd.get("blocks.0.mlp.fc1.weight")
    if fc1 is not None:
        arch["mlp_ratio"] = fc1.shape[0] / dim
    arch["norm"] = "layernorm" if "norm.weight" in sd else "affine"
    arch["pooling"] = "class_mlp" if any(k.startswith("pool.") for k in sd) else "avg"

    kind, n = _token_mixing(sd, dim)
    if kind is not None:
        arch["cross_patch"] = kind
    given = arch.get("img_size", img_size)
    size = _trained_size(n, p, given) if n is not None else given
    if size is not None:
        arch["img_size"] = [int(v) for v in size] if isinstance(size, (list, tuple)) else size
    name = _arch_name(cfgm.get("name"), dim, arch["depth"])
    one = _numbers(lambda: _create(name, {**arch, "depth": 1}))   # a block's worth, on no memory
    per_block = sum(n for k, n in one.items() if k.startswith("blocks.0."))
    _check_held(sum(one.values()) + (arch["depth"] - 1) * per_block, sd, "the weights")
    return name, arch


def _create(name: str, arch: dict) -> nn.Module:
    from resmlp.models import create_model
    return create_model(name, **arch, num_classes=0)


def _numbers(build) -> dict[str, int]:
    """How many numbers each entry of the state_dict of the model `build` makes holds,
    counted on the meta device: nothing allocated, however large it would be."""
    with torch.device("meta"):
        return {k: v.numel() for k, v in build().state_dict().items()}


def _check_held(implied: int, sd: Mapping, where: str) -> None:
    """The model the weights imply (`implied` numbers) must be about what they hold: a file
    claiming a depth or width its tensors do not have (a few KB naming block 9999) is refused
    before the model is built, not after memory runs out."""
    held = sum(v.numel() for v in sd.values() if isinstance(v, torch.Tensor))
    if implied > 2 * held + (1 << 20):
        raise UserError(f"{where} imply a model of {implied:,} numbers but hold {held:,}: a model is built only "
                        "for weights that fill it (a file naming a depth or width its tensors do not have is "
                        "refused)")


def _token_mixing(sd: Mapping, dim: int) -> tuple[str | None, int | None]:
    """(the cross-patch layer's kind, None when its keys tell none; the number of patches a
    token-mixing layer, cross-patch or class-MLP pooling, was trained over, None when no
    layer fixes it)."""
    kind = n = None
    cp = {k[len("blocks.0.cross_patch."):]: v for k, v in sd.items() if k.startswith("blocks.0.cross_patch.")}
    if "weight" in cp and cp["weight"].dim() == 2:
        kind, n = "linear", int(cp["weight"].shape[0])
    elif "fc1.weight" in cp:
        kind, n = "mlp", int(cp["fc1.weight"].shape[1])
    elif "conv.weight" in cp:
        depthwise = cp["conv.weight"].shape[1] == 1 and dim > 1
        kind = ("dwsep3x3" if "pointwise.weight" in cp else "dwconv3x3") if depthwise else "conv3x3"
    elif not cp:
        kind = "none"
    if n is None and "pool.layers.0.mix.weight" in sd:
        n = int(sd["pool.layers.0.mix.weight"].shape[1]) - 1
    return kind, n


def _trained_size(n: int, p: int, given):
    """The image size a token-mixing layer over `n` patches of `p` pixels was trained at:
    `given` when its grid has n patches, else the square grid's side."""
    if given is not None:
        g = (given, given) if isinstance(given, int) else tuple(given)
        if (g[0] // p) * (g[1] // p) == n and g[0] % p == 0 and g[1] % p == 0:
            return given
    side = math.isqrt(n)
    if side * side != n:
        raise UserError(f"cannot tell the patch grid of a cross-patch layer over {n} patches "
                        "(not square); use a checkpoint that carries its config")
    return side * p


def _arch_name(name: str | None, dim: int, depth: int) -> str:
    """The saved config's model name when it is one of ours, else the family member of this
    width and depth (resmlp_s12 when none is)."""
    from resmlp.models import ARCHS
    if name in ARCHS:
        return name
    return next((a for a, spec in ARCHS.items() if spec["dim"] == dim and spec["depth"] == depth), "resmlp_s12")


# --------------------------------------------------------------------------- loading

def _head_classes(sd: Mapping) -> int | None:
    w = sd.get("head.weight")
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _online(host: str = "huggingface.co", port: int = 443, timeout: float = 2.0) -> bool:
    import socket
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_offline_if_unreachable(pretrained: bool):
    """Offline machine: let huggingface_hub serve only its local cache for the duration, so a
    missing file fails at once instead of after a minute of retries."""
    if not pretrained or _online():
        yield
        return
    try:
        from huggingface_hub import constants
    except ImportError:
        yield
        return
    old = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = old


def load_into(model: nn.Module, sd: Mapping, where: str, ignore_head: bool = False) -> None:
    """Load state_dict `sd` into `model`, all or nothing: a UserError names the missing,
    unexpected and shape-mismatched keys. Our ResMLPs take timm's and the official key
    formats too (converted); ignore_head leaves the classifier out on both sides."""
    from resmlp.models import ResMLP, load_pretrained
    if isinstance(model, ResMLP):
        try:
            load_pretrained(model, sd, strict=True, ignore_head=ignore_head)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        return
    own = model.state_dict()
    sd = dict(sd)
    if ignore_head:
        prefix = str(getattr(model, "pretrained_cfg", {}).get("classifier", "head")) + "."
        own = {k: v for k, v in own.items() if not k.startswith(prefix)}
        sd = {k: v for k, v in sd.items() if not k.startswith(prefix)}
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    mismatched = [k for k in sd if k in own and sd[k].shape != own[k].shape]
    if missing or unexpected or mismatched:
        raise UserError(f"{where} does not fit {type(model).__name__}: {len(missing)} missing "
                        f"({_preview(missing, 3)}), {len(unexpected)} unexpected ({_preview(unexpected, 3)}), "
                        f"{len(mismatched)} shape-mismatched ({_preview(mismatched, 3)})")
    model.load_state_dict(sd, strict=not ignore_head)


def resmlp_from_state_dict(sd: Mapping, where: str, config_model: Mapping | None = None,
                           img_size=None) -> tuple[nn.Module, str, dict]:
    """(our ResMLP backbone holding `sd`, its name, its create_model overrides), the
    architecture read off the weights (infer_arch); sd in any key format."""
    from resmlp.models import convert_state_dict, create_model
    sd = convert_state_dict(sd)
    try:
        name, arch = infer_arch({k: v for k, v in sd.items() if not k.startswith("head.")}, config_model, img_size)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    model = create_model(name, **arch, num_classes=0)
    load_into(model, sd, where, ignore_head=True)
    return model, name, arch


def timm_weights(spec: WeightsSpec, pretrained: bool, advice: str, what: str = "", **kwargs) -> nn.Module:
    """timm's model of a timm spec with its pretrained weights, or with random ones seeded
    alike (the same spec, the same weights and cache key). Pretrained weights that cannot
    be had (offline: only the hub's cache is asked) are one line naming `what` and `spec`,
    ending in `advice`."""
    import resmlp.models  # noqa: F401 - registers this project's names with timm too
    try:
        with torch.random.fork_rng(devices=[]), _hub_offline_if_unreachable(pretrained):
            torch.manual_seed(0)
            return create_timm(spec.timm_name, pretrained=pretrained, **kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - no network, no cached file, wrong size, ...
        if not pretrained:
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0]
        first = first if len(first) <= 120 else first[:117] + "..."
        raise UserError(f"cannot get pretrained weights for {what}{spec.plain} ({type(e).__name__}: {first}); "
                        f"this machine may be offline: {advice}") from None


def _timm_backbone(spec: WeightsSpec, pretrained: bool, img_size=None, in_chans=None, offline_advice=None):
    """(timm's model of `spec` as a backbone, info); offline_advice(name): what to do when its
    pretrained weights cannot be had."""
    import timm

    name, pretrained = spec.timm_name, spec.pretrained(pretrained)
    if not name or not timm.is_model(name):
        raise UserError(f"timm has no model {name!r}; see timm.list_models('*resmlp*')")
    kwargs = {"num_classes": 0}
    if in_chans is not None:
        kwargs["in_chans"] = int(in_chans)
    if img_size is not None and not pretrained:
        kwargs["img_size"] = img_size   # random weights: build for the data's size
    advice = offline_advice(name) if offline_advice else \
        f"pass a local checkpoint file, or {timm_spec(name, 'random')} for random weights"
    model = timm_weights(spec, pretrained, advice, **kwargs)
    info = {"source": "timm", "spec": spec.text, "path": None, "run_dir": None, "model": name,
            "arch": {}, "config": None, "key": None, "epoch": None, "pretrained": pretrained,
            "head_num_classes": None, "is_resmlp": False, "cross_patch": None}
    return model, info


@dataclass
class _Source:
    """The weights a spec names, read once: `sd` the network's state_dict (of a DINO
    checkpoint the `key` network's backbone), `info` where it came from; `model` is timm's
    model already holding them, `obj` the checkpoint file's dict (None for timm's)."""
    sd: dict
    info: dict
    what: str                          # for messages: "timm's ResNet", "a dino checkpoint", ...
    model: nn.Module | None = None
    obj: dict | None = None


def _read(spec: WeightsSpec, key: str, pretrained: bool, img_size=None, in_chans=None,
          offline_advice=None) -> _Source:
    """The weights of `spec`: the one place that tells timm's from a checkpoint file."""
    if spec.path is not None:
        path = spec.file
        obj = load_checkpoint(path)
        sd, info = unwrap(obj, key, str(path))
        ours = obj.get("format") == FORMAT
        info.update(spec=spec.text, path=str(path), run_dir=str(path.parent) if ours else None, pretrained=None)
        return _Source(sd, info, f"a {info['source']} checkpoint", obj=obj)
    _one_network({}, {"source": "timm"}, key, spec.text)
    model, info = _timm_backbone(spec, pretrained, img_size, in_chans, offline_advice)
    return _Source(model.state_dict(), info, f"timm's {type(model).__name__}", model=model)


def load_backbone(spec: WeightsSpec | str | os.PathLike, key: str = "teacher", device="cpu",
                  pretrained: bool = True, img_size=None, in_chans=None) -> tuple[nn.Module, dict]:
    """(feature backbone in eval mode on `device`, info dict) for any accepted `spec` (a
    WeightsSpec, or the text of one).

    key: 'teacher' | 'student', for DINO checkpoints (ignored otherwise).
    pretrained: for timm:<name> without a ?flag: request timm's pretrained weights
      (a clear UserError if they cannot be had offline).
    img_size / in_chans: only used where the checkpoint does not fix them (timm ?random
      models are built for them; conv-variant state_dicts without a config).
    info: source ('dino', 'dino-official', 'supervised'/<command>, 'state_dict',
      "state_dict['model']", 'timm'), spec, path, run_dir (this project's run dir or
      None), model (name), arch (create_model overrides), config (saved config or None),
      key, epoch, weights_hash, head_num_classes (the saved classifier's, if any),
      is_resmlp, cross_patch (kind, None for timm models), num_features.
    """
    source = _read(WeightsSpec.parse(spec), key, pretrained, img_size, in_chans)
    model, info = source.model, source.info
    if model is None:
        model = _build(source.sd, info, img_size)
    model.eval().requires_grad_(False)
    info["weights_hash"] = weights_hash(model)
    info["num_features"] = int(getattr(model, "num_features", 0)) or None
    return model.to(device), info


def _build(sd: dict, info: dict, img_size=None) -> nn.Module:
    """The backbone a checkpoint's weights make: our ResMLP with the architecture read off
    them, or the timm architecture its saved config names; `info` completed."""
    from resmlp.models import ARCHS

    cfg_model = (info["config"] or {}).get("model") or {}
    if cfg_model.get("name") and cfg_model["name"] not in ARCHS:
        return _load_timm_arch(sd, cfg_model, info, info["path"])
    head = _head_classes(sd)
    model, name, arch = resmlp_from_state_dict(sd, info["path"], cfg_model, img_size)
    info.update(model=name, arch=arch, head_num_classes=head, is_resmlp=True,
                cross_patch=arch.get("cross_patch", "linear"))
    return model


def _load_timm_arch(sd: dict, cfg_model: Mapping, info: dict, path: str) -> nn.Module:
    """A project checkpoint of a timm architecture (the supervised command trains any)."""
    import timm

    name = cfg_model["name"]
    if not timm.is_model(name):
        raise UserError(f"{path}: its config names model {name!r}, which is neither a ResMLP of "
                        "this project nor a timm model")
    kwargs = {"num_classes": 0}
    if cfg_model.get("img_size"):
        kwargs["img_size"] = cfg_model["img_size"]
    _check_held(sum(_numbers(lambda: create_timm(name, **kwargs)).values()), sd, f"{path}: its config and weights")
    model = create_timm(name, **kwargs)
    head_prefix = str(getattr(model, "pretrained_cfg", {}).get("classifier", "head")) + "."
    w = sd.get(head_prefix + "weight")
    load_into(model, sd, f"{path}: checkpoint", ignore_head=True)
    info.update(model=name, arch={}, is_resmlp=False, cross_patch=None, source=f"{info['source']} (timm)",
                head_num_classes=int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None)
    return model


# --------------------------------------------------------------------------- continuing

# The architecture a backbone's weights fix, with the config key that builds each.
_FIT = (("dim", "width", "model.dim"), ("depth", "depth", "model.depth"),
        ("patch_size", "patch size", "model.patch_size"), ("in_chans", "input channels", "model.in_chans"),
        ("mlp_ratio", "MLP ratio", "model.mlp_ratio"), ("norm", "norm", "model.norm"),
        ("pooling", "pooling", "model.pooling"), ("cross_patch", "cross-patch layer", "model.cross_patch"))


def _built_arch(model) -> dict:
    """What a built ResMLP is, in infer_arch's terms."""
    return {"dim": model.num_features, "depth": len(model.blocks), "patch_size": model.patch_size,
            "in_chans": model.patch_embed.proj.in_channels,
            "mlp_ratio": model.blocks[0].mlp.fc1.out_features / model.num_features if len(model.blocks) else None,
            "norm": model.norm_kind, "pooling": model.pooling, "cross_patch": model.cross_patch_kind}


def _adapt_grid(sd: dict, name: str, arch: dict, grid) -> dict:
    """`sd` with its token-mixing weights (cross-patch, class-MLP pooling) resampled from the
    patch grid they were trained on to `grid`: the evaluators' grid_adapt=interpolate, done
    once on the weights instead of at every forward."""
    from resmlp.models import create_model
    from resmlp.models.resmlp import ClassMLPLayer, CrossPatchLinear
    source = create_model(name, **arch, num_classes=0)
    load_into(source, sd, "the weights")
    source.grid_adapt = "interpolate"
    out = dict(sd)
    with torch.no_grad():
        for prefix, m in source.named_modules():
            if isinstance(m, CrossPatchLinear):
                out[f"{prefix}.weight"], out[f"{prefix}.bias"] = (t.clone() for t in m.weights_for(grid))
            elif isinstance(m, ClassMLPLayer):
                out[f"{prefix}.mix.weight"] = m.mix_weight_for(grid).clone()
    return out


def init_weights(spec: WeightsSpec | str | os.PathLike, model: nn.Module, where: str = "dino.init") -> dict:
    """Load the weights to continue training from into `model` (a freshly built backbone,
    num_classes=0), checked before any work; returns what was loaded (info).

    spec: a checkpoint file or run dir (this project's, an official DINO one, a timm or
    official ResMLP state_dict) or timm:<name> with timm's pretrained weights (?random: its
    random init). Of a DINO checkpoint the teacher is taken. For this project's ResMLP the
    weights must have its width, depth, patch size, channels, MLP ratio, norm, pooling and
    cross-patch kind (a UserError names each that differs and the key that builds it); a
    patch grid of another image size is adapted (the evaluators' interpolate). Any other
    model takes a state_dict with exactly its keys and shapes.
    info: load_backbone's fields (source, path, epoch, ...; weights_hash of the weights as
    given), plus `head` (the teacher's DINO head of this project's checkpoint, else None),
    `center` (its loss center, or None), `config` (its saved config, or None) and `grid`
    ([from, to] when the patch grid was adapted, else None).
    """
    from resmlp.models import ResMLP, convert_state_dict
    spec = WeightsSpec.parse(spec)

    def advice(name: str) -> str:
        return (f"fetch them on a machine that is online and pass the file as {where}=<file>: "
                f"torch.save(timm.create_model('{name}', pretrained=True).state_dict(), '{name}.pth'), "
                f"or this project's `export format=timm` of a run")

    source = _read(spec, "teacher", pretrained=True, offline_advice=advice)
    info = source.info
    if info["path"]:
        info["path"] = str(Path(info["path"]).resolve())
    head, center = _dino_head(source.obj) if info["source"] == "dino" else (None, None)
    sd = {k: v for k, v in source.sd.items() if isinstance(v, torch.Tensor)}
    info.update(head=head, center=center, grid=None, weights_hash=weights_hash(sd))
    info.setdefault("config", None)
    named = f"{where}={spec}"
    if not isinstance(model, ResMLP):
        load_into(model, sd, named, ignore_head=True)
        return info
    sd = {k: v for k, v in convert_state_dict(sd).items() if not k.startswith("head.")}
    if "patch_embed.proj.weight" not in sd or not any(k.startswith("blocks.") for k in sd):
        raise UserError(f"{named} is {source.what} without a ResMLP's patch embedding and blocks "
                        f"(keys: {_preview(sd)}): it does not fit the model's ResMLP backbone; pass ResMLP weights")
    try:
        name, arch = infer_arch(sd, (info["config"] or {}).get("model"))
    except UserError as e:
        raise UserError(f"{named}: {e}") from None
    _check_fit(arch, model, named)
    sd, info["grid"] = _fit_grid(sd, name, arch, tuple(model.grid_size), named)
    load_into(model, sd, named)
    return info


def _dino_head(obj: dict) -> tuple[dict | None, torch.Tensor | None]:
    """(the teacher's DINO head, the loss center) of this project's DINO checkpoint."""
    teacher = _strip(obj["teacher"], "module.")
    head = {k[len("head."):]: v for k, v in teacher.items() if k.startswith("head.")} or None
    return head, obj.get("center") if isinstance(obj.get("center"), torch.Tensor) else None


def _check_fit(arch: dict, model, named: str) -> None:
    """The architecture the weights fix must be the built model's: one line naming each
    difference and the key that builds it."""
    built = _built_arch(model)
    differ = [f"{label} {arch.get(k)} vs the model's {built[k]} ({key})" for k, label, key in _FIT
              if arch.get(k, built[k]) != built[k]]
    if differ:
        raise UserError(f"{named} does not fit the model: its {'; '.join(differ)}; build the model it was "
                        "trained as with those keys, or pass weights of this model")


def _fit_grid(sd: dict, name: str, arch: dict, grid: tuple, named: str) -> tuple[dict, list | None]:
    """(the weights for the model's patch grid, [trained grid, model's grid] when they were
    adapted, else None): the token-mixing layers of weights trained at another image size
    resampled; an MLP cross-patch layer cannot be."""
    size = arch.get("img_size")
    if size is None or not (arch["cross_patch"] in ("linear", "mlp") or arch["pooling"] == "class_mlp"):
        return sd, None
    hw = (size, size) if isinstance(size, int) else tuple(size)
    trained = (hw[0] // arch["patch_size"], hw[1] // arch["patch_size"])
    if trained == grid:
        return sd, None
    if arch["cross_patch"] == "mlp":
        raise UserError(f"{named} has an MLP cross-patch layer for a {trained[0]}x{trained[1]} "
                        f"patch grid, which cannot adapt to the model's {grid[0]}x{grid[1]}: set "
                        f"data.img_size={hw[0]} to continue at the size it was trained at")
    return _adapt_grid(sd, name, arch, grid), [list(trained), list(grid)]


def load_classifier(spec: WeightsSpec | str | os.PathLike, architecture: str | None = None) -> tuple[nn.Module, str]:
    """(a trained classifier with its head, in eval mode without gradients; its name).

    spec: a run dir / checkpoint of this project's supervised, distill or finetune
    commands (its saved config names the architecture), or a foreign classifier
    state_dict with `architecture` naming a timm or ResMLP model."""
    from omegaconf import OmegaConf

    from resmlp.models.resmlp import FUSED_OPTIONS

    spec = WeightsSpec.parse(spec)
    path = spec.file
    obj = load_checkpoint(path)
    if any(isinstance(obj.get(k), Mapping) for k in DINO_KEYS) and "model" not in obj:
        raise UserError(f"{path} is a DINO checkpoint: its networks have no classifier. Fine-tune it first "
                        f"(bash run.sh finetune {spec}) and pass that run as the teacher")
    sd, info = unwrap(obj, "teacher", str(path))
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if info["config"] and "model" in info["config"]:  # as it was trained, but how its blocks ran there
        model_cfg = OmegaConf.create({k: v for k, v in info["config"]["model"].items() if k not in FUSED_OPTIONS})
    elif architecture:
        model_cfg = OmegaConf.create({"name": architecture})
    else:
        raise UserError(f"{path} carries no config that names its architecture; add "
                        "distill.teacher_model=<timm or resmlp model name>")
    _check_config_fits(model_cfg, sd, str(path))
    n = obj.get("num_classes") if obj.get("format") == FORMAT else None
    if not n:
        n = _classifier_rows(build_model(model_cfg, num_classes=1), sd)
    if not n:
        raise UserError(f"{path}: cannot find the classifier's weights (keys: {_preview(sd)})")
    model = build_model(model_cfg, num_classes=int(n))
    load_into(model, sd, str(path))
    return model.eval().requires_grad_(False), str(model_cfg.name)


def _check_config_fits(model_cfg, sd: Mapping, where: str) -> None:
    """A saved config's model, checked against the weights before it is built: the depth it
    names is the blocks they hold, and the model holds about the numbers they do."""
    depth = model_cfg.get("depth")
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if depth is not None and depth != len(blocks):
        raise UserError(f"{where}: its config names depth {depth} but its weights hold {len(blocks)} blocks; "
                        "a model is built only for weights that fill it")
    _check_held(sum(_numbers(lambda: build_model(model_cfg, num_classes=1)).values()), sd,
                f"{where}: its config and weights")


def _classifier_rows(model: nn.Module, sd: Mapping) -> int | None:
    """Classes of a classifier state_dict, read at the model's classifier key (timm's cfg)."""
    key = getattr(model, "pretrained_cfg", {}).get("classifier", "head") if hasattr(model, "pretrained_cfg") \
        else "head"
    for k in (f"{key}.weight", "head.weight", "fc.weight", "head.fc.weight", "classifier.weight"):
        w = sd.get(k)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return int(w.shape[0])
    return None


def model_label(info: Mapping) -> str:
    """The loaded network's name as a reader should see it: the ResMLP's name where its
    weights have that name's width and depth, else its sizes (a dim-64, depth-4 network
    trained as `resmlp_s12 model.dim=64 model.depth=4` is no resmlp_s12)."""
    from resmlp.models import ARCHS

    name, arch = info.get("model", "?"), info.get("arch") or {}
    spec = ARCHS.get(name)
    if not info.get("is_resmlp") or spec is None or "dim" not in arch:
        return str(name)
    if (arch["dim"], arch.get("depth")) == (spec["dim"], spec["depth"]):
        return name
    return f"ResMLP (dim {arch['dim']}, depth {arch.get('depth')})"


def describe(info: Mapping) -> str:
    """One line for reports: what was loaded."""
    bits = [model_label(info), f"from {info.get('source')}"]
    if info.get("key"):
        bits.append(f"({info['key']})")
    if info.get("epoch") is not None:
        bits.append(f"epoch {info['epoch']}")
    bits.append(f"weights {info.get('weights_hash')}")
    return " ".join(str(b) for b in bits)


__all__ = ["describe", "infer_arch", "init_weights", "load_backbone", "load_classifier", "load_into", "model_label",
           "resmlp_from_state_dict", "timm_weights", "unwrap", "weights_hash"]
