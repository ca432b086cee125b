"""Continuing DINO from weights without wrecking them (issue 30, part 5; docs/dino_learning.md).

    python studies/dino_continue.py prepare DIR [N]   # the study's image folders, as PNGs
    python studies/dino_continue.py table RUN [RUN ...]   # the table of the runs

The stand-in for a released checkpoint is the CPU demo's teacher pretrained on the
Fashion-MNIST classes 0-4 only, exported in timm's format; it is then continued on
unlabeled images of all ten classes and judged by k-NN on all ten. `prepare` writes:

    DIR/fm04/train/<class>/*.png, DIR/fm04/val/<class>/*.png   classes 0-4 (an image folder:
        the stand-in's pretraining, `data=imagefolder`)
    DIR/fm10/*.png    the continuation's unlabeled images: the 5000 training images the demo
        takes from all ten classes (data.subset=5000's class-balanced pick), no class folders
        (`data=folder`)
N (a test's size): the first N images of each class in fm04 and an N-image pick in fm10.

The runs themselves are the project's commands (`bash run.sh dino ...`, `export`);
docs/dino_learning.md lists each one. `table` reads their results.json and log.jsonl: the
k-NN at the start, after the head warm-up and at the end, its lowest point (the k-NN of
every epoch: eval_every=1), and the final k-NN with few labels (knn.few_labels).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CLASSES_PRETRAINED = (0, 1, 2, 3, 4)
CONTINUE_IMAGES = 5000   # the demo's data.subset


def _write(images: np.ndarray, folder: Path, stems) -> None:
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for img, stem in zip(images, stems):
        Image.fromarray(img, mode="L").save(folder / f"{stem}.png")


def prepare(out: Path, n: int | None = None) -> None:
    from resmlp.data.fashion_mnist import find_idx_dir, load_split, search_dirs
    from resmlp.data.subset import balanced_subset_indices
    folder = next((f for f in map(find_idx_dir, search_dirs()) if f), None)
    if folder is None:
        sys.exit("Fashion-MNIST not found (apt-get install dataset-fashion-mnist)")
    for split, sub in (("train", "train"), ("test", "val")):
        images, labels = load_split(folder, split)
        for k in CLASSES_PRETRAINED:
            idx = np.flatnonzero(labels == k)[:n]
            _write(images[idx], out / "fm04" / sub / str(k), (f"{i:05d}" for i in idx))
        written = sum(len(list((out / "fm04" / sub / str(k)).iterdir())) for k in CLASSES_PRETRAINED)
        print(f"fm04/{sub}: {written} images of classes {', '.join(map(str, CLASSES_PRETRAINED))}")
    images, labels = load_split(folder, "train")
    idx = balanced_subset_indices(labels, n or CONTINUE_IMAGES, 10)
    _write(images[idx], out / "fm10", (f"{i:05d}" for i in idx))
    print(f"fm10: {len(idx)} unlabeled images of all ten classes (data.subset={n or CONTINUE_IMAGES}'s pick)")


# ---------------------------------------------------------------------------- the table

def _curve(run: Path) -> list[tuple[float, float]]:
    """(epoch, k-NN top-1) of every k-NN the run logged, at init (epoch 0) to the end."""
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["knn_top1"]) for r in rows if "knn_top1" in r]


def row(run: Path) -> dict:
    res = json.loads((run / "results.json").read_text())
    curve = _curve(run)
    start = res.get("init_knn_top1", curve[0][1] if curve else None)
    low = min(curve, key=lambda c: c[1]) if curve else (None, None)
    out = {"run": run.name, "start": start, "after warm-up": res.get("after_warmup_knn_top1"),
           "end": res["knn_top1"], "lowest": low[1], "lowest after epoch": low[0]}
    if "knn_low_shot" in res:   # results.json of a run from before the field's rename
        print(f"error: {run / 'results.json'} names knn_low_shot, now knn_few_labels: rename the field",
              file=sys.stderr)
        sys.exit(2)
    few = (res.get("knn_few_labels") or {}).get("results") or {}
    for n, entry in few.items():   # the trainer's final k-NN with knn.few_labels, at its headline k
        top = entry["k"][str(res["knn_k"])]
        out[f"{n}/class"] = f"{top['top1']:.2f} ± {top['top1_std']:.2f}"
    out["wall s"] = res.get("wall_time_s")
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(runs: list[Path]) -> str:
    rows = [row(r) for r in runs]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "prepare":
        prepare(Path(args[1]), int(args[2]) if len(args) > 2 else None)
    elif len(args) >= 2 and args[0] == "table":
        print(table([Path(a) for a in args[1:]]))
    else:
        sys.exit(__doc__)
