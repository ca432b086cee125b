"""`export format=onnx`: the backbone as one ONNX file for runtimes outside Python.

The model written is fold_affine's inference copy (every Aff and LayerScale merged into the
next linear layer: the same function, fewer operations), traced by torch.onnx's exporter on
torch.export (dynamo=True, torch's default since 2.9; the TorchScript one it replaces warns that it
will be removed), with the batch axis dynamic and the image size fixed, as the patch grid fixes
it. The file's metadata_props say what to feed it: the input size, the normalization and the
eval transform's resize and crop. Before the file is kept, onnxruntime runs it beside torch on
a batch of another size than the traced one, and the card keeps the largest difference.
"""
from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from resmlp.core.errors import RunFailed, UserError
from resmlp.models.fold import fold_affine
from resmlp.models.load import model_label

# torch.onnx's exporter writes through onnxscript (and onnx); onnxruntime checks what it wrote
PACKAGES = ("onnx", "onnxscript", "onnxruntime")
INPUT, OUTPUT = "images", "features"
# fp32 through the same weights in another order: far below this, or the export is wrong
TOLERANCE = 1e-4
ONE_FILE = 2 ** 31  # protobuf's limit on one message: a larger model would need its weights beside the file


def require_onnx() -> None:
    """UserError, before any work, when a package format=onnx needs is not installed."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"format=onnx needs {', '.join(missing)}, not installed in this environment: "
                        f"pip install {' '.join(missing)} (requirements.txt pins the versions tested)")


def metadata(info: Mapping, data: Mapping) -> dict[str, str]:
    """The model's metadata_props: strings, lists as JSON."""
    return {
        "model": model_label(info), "weights_hash": str(info.get("weights_hash")),
        "network": info.get("key") or "backbone",
        "input": f"{INPUT}: float32 (batch, channels, height, width)" + (", RGB" if data["input_size"][0] == 3 else ""),
        "input_size": json.dumps(data["input_size"]),
        "normalization": "pixels / 255, then (x - mean) / std per channel",
        "mean": json.dumps(data["mean"]), "std": json.dumps(data["std"]),
        "resize": f"shorter side to input size / crop_pct ({data['interpolation']}), then the center crop",
        "crop_pct": json.dumps(data["crop_ratio"]), "interpolation": data["interpolation"],
        "output": f"{OUTPUT}: float32 (batch, {info.get('num_features')}), the pooled features (no head)",
    }


def write_onnx(model: torch.nn.Module, info: Mapping, data: Mapping, path: Path, opset: int) -> dict:
    """Write `model` (a ResMLP backbone, num_classes=0) to `path`; the card's fields."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if weight_bytes >= ONE_FILE:
        raise UserError(f"{model_label(info)} has {weight_bytes / 2**30:.1f} GiB of weights: one ONNX file holds "
                        "under 2 GiB; export it with format=safetensors")
    folded = fold_affine(model)
    g = torch.Generator().manual_seed(0)
    traced, checked = (torch.randn(n, *data["input_size"], generator=g) for n in (2, 3))
    try:
        program = torch.onnx.export(folded, (traced,), dynamo=True, opset_version=opset, verbose=False,
                                    input_names=[INPUT], output_names=[OUTPUT],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},))
    except Exception as e:  # noqa: BLE001 - the exporter's own errors have no common type
        raise RunFailed(f"torch.onnx could not export {model_label(info)}: {str(e).splitlines()[0]}") from None
    program.model.metadata_props.update(metadata(info, data))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        program.save(tmp, external_data=False)
        diff = _check(tmp, model, checked)
        if diff > TOLERANCE:
            raise RunFailed(f"the ONNX model of {model_label(info)} differs from torch's by {diff:.2e} "
                            f"(more than {TOLERANCE:g}): nothing was written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return {"onnx": {"opset": opset, "input": INPUT, "output": OUTPUT, "dynamic_axes": {INPUT: "batch",
                                                                                         OUTPUT: "batch"},
                     "input_size": data["input_size"], "folded": True, "checked": {
                         "runtime": "onnxruntime (CPU)", "batch": int(checked.shape[0]), "max_abs_diff": diff}},
            "load": f"onnxruntime.InferenceSession({path.name!r}).run(None, {{{INPUT!r}: images}})[0]: "
                    f"(batch, {info.get('num_features')}) features of images normalized as `data` says"}


def _check(path: Path, model: torch.nn.Module, x: torch.Tensor) -> float:
    """The largest difference between onnxruntime's features of `x` and the unfolded model's."""
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {INPUT: x.numpy()})[0]
    with torch.no_grad():
        want = model(x)
    return float((torch.from_numpy(got) - want).abs().max())
