"""`run.sh data data=... data.preview=N`: the DINO views of N training images, drawn by
the trainer's own data path (data.crop_plan.build_views, data.resumable.build_train_loader,
GpuMultiCrop), written into the run folder (out=) as

- crops.png: one row per image: the image with every crop's box outlined, then its two
  global and its local crops as the model receives them (de-normalized; small crops
  enlarged by whole pixels so they stay visible);
- crops.json: {"images": [{"path", "width", "height", "crops": [{"view": "global1" |
  "global2" | "local1" ..., "box": [x0, y0, x1, y1], "size", "flip", "ops"}]}]} with each
  box in the file's own pixels (x1, y1 exclusive; rounded when the image was shrunk
  while decoding) and "ops" the photometric ops applied, of jitter, gray, blur, solarize.

The images are the first N of the trainer's epoch-0 order, and their crops are those
the trainer draws for them (the device augmentation draws by (seed, sample key) only).
"""
from __future__ import annotations

import json
import math
import os

import torch
from PIL import Image, ImageDraw

from resmlp.core.checkpoint import atomic_write
from resmlp.core.errors import UserError
from resmlp.core.report import write_text

OPS = ("jitter", "gray", "blur", "solarize")
COLOURS = [(255, 60, 60), (60, 140, 255)] + [(255, 200, 0), (0, 200, 120), (200, 80, 255), (255, 130, 0),
                                               (0, 210, 210), (240, 90, 170), (150, 200, 40), (120, 120, 255)]
MIN_SHOWN = 96  # crops smaller than this many pixels are enlarged by a whole factor


def view_names(n_views: int) -> list[str]:
    return ["global1", "global2"] + [f"local{i + 1}" for i in range(n_views - 2)]


def image_label(dataset, index: int, data_name: str, split: str) -> str:
    """The file behind dataset[index], or '<data> <split> #<index>' for in-memory sets."""
    while hasattr(dataset, "indices") and hasattr(dataset, "base"):  # data.subset
        index, dataset = int(dataset.indices[index]), dataset.base
    paths = getattr(dataset, "_paths", None)
    if paths is not None:
        return os.fsdecode(paths[index])
    return f"{data_name} {split} #{index}"


def file_box(params: dict, i: int, size, file_size) -> list[int]:
    """The i-th box of a view in the file's pixels, [x0, y0, x1, y1], x1 and y1 exclusive."""
    (h, w), (fh, fw) = size, file_size
    sx, sy = fw / w, fh / h
    top, left, bh, bw = (float(params[k][i]) for k in ("top", "left", "h", "w"))
    return [round(left * sx), round(top * sy), round((left + bw) * sx), round((top + bh) * sy)]


def describe(batch, drawn: list[dict], labels: list[str], sizes: list[int]) -> dict:
    names = view_names(len(drawn))
    images = []
    for i in range(len(labels)):
        size = [int(v) for v in batch.sizes[i]]
        fh, fw = (int(v) for v in batch.file_sizes[i])
        crops = []
        for name, params, s in zip(names, drawn, sizes):
            crops.append({"view": name, "box": file_box(params, i, size, (fh, fw)), "size": int(s),
                          "flip": bool(params["flip"][i]), "ops": [op for op in OPS if bool(params[op][i])]})
        images.append({"path": labels[i], "width": fw, "height": fh, "crops": crops})
    return {"images": images}


def _to_pil(x: torch.Tensor, mean, std) -> Image.Image:
    """A normalized crop (3, S, S) back to an RGB image."""
    m = torch.tensor(mean).view(3, 1, 1)
    s = torch.tensor(std).view(3, 1, 1)
    rgb = (x.float().cpu() * s + m).clamp(0, 1).mul(255).round().to(torch.uint8)
    return Image.fromarray(rgb.permute(1, 2, 0).numpy())


def grid(images: torch.Tensor, batch, crops: list[torch.Tensor], info: dict, mean, std) -> Image.Image:
    """One row per image: the decoded image with the boxes, then the crops (see module doc)."""
    factor = max(1, math.ceil(MIN_SHOWN / max(c.shape[-1] for c in crops)))
    shown = [c.shape[-1] * factor for c in crops]
    row_h = max(shown)
    gap = 6
    rows = []
    for i, entry in enumerate(info["images"]):
        h, w = (int(v) for v in batch.sizes[i])
        src = Image.fromarray(images[i, :, :h, :w].permute(1, 2, 0).cpu().numpy())
        scale = row_h / max(h, w)
        src = src.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
        draw = ImageDraw.Draw(src)
        fh, fw = entry["height"], entry["width"]
        for k, crop in enumerate(entry["crops"]):
            x0, y0, x1, y1 = crop["box"]
            sx, sy = src.width / fw, src.height / fh
            draw.rectangle([x0 * sx, y0 * sy, x1 * sx - 1, y1 * sy - 1], outline=COLOURS[k % len(COLOURS)],
                           width=2 if k < 2 else 1)
        tiles = [src] + [_to_pil(c[i], mean, std).resize((s, s), Image.NEAREST) for c, s in zip(crops, shown)]
        row = Image.new("RGB", (sum(t.width for t in tiles) + gap * len(tiles), row_h + 5), (255, 255, 255))
        x = 0
        for k, t in enumerate(tiles):
            row.paste(t, (x, 0))
            if k:  # the view's colour under its tile, as on the boxes
                ImageDraw.Draw(row).rectangle([x, t.height + 1, x + t.width - 1, t.height + 3],
                                              fill=COLOURS[(k - 1) % len(COLOURS)])
            x += t.width + gap
        rows.append(row)
    out = Image.new("RGB", (max(r.width for r in rows), sum(r.height + gap for r in rows)), (255, 255, 255))
    y = 0
    for r in rows:
        out.paste(r, (0, y))
        y += r.height + gap
    return out


def run_preview(cfg, n: int) -> dict:
    """Draw the DINO views of n training images and write crops.png and crops.json into
    the run folder; returns {'png', 'json', 'images', 'views'}."""
    from resmlp.core.run_folder import run_dir
    from resmlp.data import build_dataset, train_split_for_ssl
    from resmlp.data.resumable import build_train_loader
    from resmlp.data.transforms import mean_std
    from resmlp.data.crop_plan import build_views, crop_plan

    if cfg.dino.augment != "device":
        raise UserError("data.preview draws the device augmentation (dino.augment=device, the default); "
                        f"dino.augment={cfg.dino.augment} has no boxes to report")
    device = torch.device("cuda" if cfg.data.decode == "gpu" and torch.cuda.is_available()
                          else "cpu")
    plan = crop_plan(cfg)
    views = build_views(cfg, plan, device=device)
    split = train_split_for_ssl(cfg.data)
    dataset = build_dataset(cfg.data, split)
    if n > len(dataset):
        raise UserError(f"data.preview={n} asks for more images than the {len(dataset)} of the {split} split")
    loader, sampler = build_train_loader(dataset, views.transform, n, int(cfg.seed), 0, keyed=True,
                                         collate_fn=views.collate)
    sampler.set_epoch(0)
    batch = next(iter(loader))
    crops, drawn = views.draw(batch, device)
    labels = [image_label(dataset, int(k) % len(dataset), cfg.data.name, split) for k in batch.keys]
    info = describe(batch, drawn, labels, plan.sizes)
    mean, std = mean_std(cfg.data)
    folder = run_dir(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    png, js = folder / "crops.png", folder / "crops.json"
    with atomic_write(png, what="the crops' picture") as f:   # never through a link at its name
        grid(batch.decode_on(device).cpu(), batch, crops, info, mean, std).save(f, format="PNG")
    write_text(js, json.dumps(info, indent=1), what="the crops' record")
    return {"png": str(png), "json": str(js), "images": n, "views": plan.n_crops}

