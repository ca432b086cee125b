"""The tests' own kit: the package's folders, a DINO step at a precision, the crops it takes,
a small DINO config, and folders of photo-like JPEGs, for the tests that only need those. The bench (tools/bench)
has its own step kit; only its tests import it. The step is the trainer's
(resmlp.ssl.step.build_dino_step), built as the bench builds it: a test of the step tests the
step the trainer runs and the bench times."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from PIL import Image

from resmlp.core.dist import AMP_DTYPES
from resmlp.ssl.step import StepValues

# The folders of the installed package's code (pyproject.toml's package-dir but configs/,
# tests/test_packaging.py holds them equal); tools/ and studies/ use the package, outside it.
PRODUCT = ("core", "models", "data", "ssl", "eval", "supervised")
# One point of the schedules for every step a test calls, and its epoch (after the
# frozen-last-layer one).
VALUES, EPOCH = StepValues(lr=1e-4, wd=0.04, momentum=0.996, teacher_temp=0.04), 1
# A small DINO step: width 16, depth 2, 32 px global crops in patches of 8, two local crops
# of 16 px (dino.local_crops: small_dino_config's strategy), a small head, batch 4.
SMALL_DINO = ["demo=false", "data=imagefolder", "data.img_size=32", "model.patch_size=8", "data.local_size=16",
              "dino.n_local_crops=2", "model.drop_path_rate=0.1", "dino.out_dim=64", "dino.hidden_dim=32",
              "dino.bottleneck_dim=16", "batch_size=4", "model.dim=16", "model.depth=2"]


def small_dino_config(strategy: str = "interpolate", extra=()):
    """The `dino` config of SMALL_DINO with dino.local_crops=`strategy` and `extra` overrides."""
    from resmlp.core.config import load_config
    return load_config("dino", "resmlp_s12", [*SMALL_DINO, f"dino.local_crops={strategy}", *extra])


def synthetic_crops(plan, batch: int, device, seed: int = 0) -> list[torch.Tensor]:
    """Seeded random crops of every size of the crop plan, `batch` each, on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(batch, 3, s, s, device=device, generator=g) for s in plan.sizes]


def autocast_for(device, precision: str):
    """The autocast a step at `precision` runs its forward under (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(torch.device(device).type, dtype=AMP_DTYPES[precision])


def dino_step(cfg, device, precision: str = "fp32", compile: bool | str = False, graphs: bool = False):
    """The trainer's step for a world of one at `precision` (fp16 with a GradScaler):
    compile=True compiles by region (or a word of `compile`, e.g. whole); graphs:
    dino.cuda_graphs."""
    from resmlp.data.crop_plan import crop_plan
    from resmlp.ssl.step import build_dino_step
    merged = OmegaConf.merge(cfg, {"compile": "regions" if compile is True else compile,
                                   "dino": {"cuda_graphs": bool(graphs)}})
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=precision == "fp16")
    return build_dino_step(merged, crop_plan(merged), device, scaler=scaler, autocast=autocast_for(device, precision))


def call_step(step, crops):
    """One call of the step at VALUES: its loss."""
    out = step(crops, VALUES, EPOCH)
    return out[0] if isinstance(out, tuple) else out


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like RGB picture: a random 6 x 6 colour grid resized smoothly, plus noise (it
    compresses and decodes like a photograph, unlike white noise)."""
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = np.asarray(grid, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def make_jpeg_folder(root, n: int, min_px: int, max_px: int, classes: int = 10, seed: int = 0) -> Path:
    """n photo-like JPEGs of random sides in [min_px, max_px] in root/train/c<class>/, the
    classes in turn, and one more per class in root/val/c<class>/. Returns root."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    for i in range(n + classes):
        split, c = ("train", i % classes) if i < n else ("val", i - n)
        width, height = (int(side) for side in rng.integers(min_px, max_px + 1, 2))
        folder = root / split / f"c{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        synthetic_image(width, height, int(rng.integers(2**31))).save(folder / f"{i:06d}.jpg", quality=90)
    return root
