"""`run.sh embed <checkpoint> [data=...] [key=student]`: the pooled features of every image of
a data set's split (`embed.split`), for retrieval, clustering or any tool outside this project.

The rows are the features `knn` and `linear` extract for the same images (eval/features.py:
the same eval transform of the data, the same forward, the same autocast), in the split's
order. The output folder (out=, else <checkpoint's folder>/embed/<result name>/, as viz's) holds:

    embeddings.safetensors   one tensor, "embeddings", N x D (embed.dtype; embed.normalize: L2 rows)
    index.csv | index.jsonl  one line per row: row, the image's path (or its index in the split,
                             for a set held in memory), and its label and class where it has one
    embed.json               the card: what made the rows (checkpoint sha256, weights hash, network,
                             data, transform, precision: eval/features.py's cache key), count, dims

Shards: the split is cut into shards of embed.shard_size images (shard s: rows s*S to (s+1)*S),
each written to shards/<s>.safetensors in one rename once its rows are done, so at most one
shard's rows sit in a process's memory. Under torchrun the processes take the missing shards
in turn (process r the r-th, r+W-th, ...). A run killed at any point keeps its finished shards:
the same command embeds only the others (with any number of processes; an older card's shard
size is kept). Once every shard is there, the first process writes embeddings.safetensors
from them one at a time (the file's header first, then each shard's bytes: never the whole
tensor in memory), and the index, writes the card, then removes shards/.

Refused in one line before any image is embedded: an empty split, image files whose header
cannot be read (named; data.check=true decodes every image first), and a folder holding the
embeddings of other inputs (their card differs; out_ok=true replaces them). An image that
fails later while decoding stops the command, naming it, with the finished shards kept.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from resmlp.core import dist
from resmlp.core.cadence import KILL_AT_ENV
from resmlp.core.checkpoint import atomic_write
from resmlp.core.compiling import uncompiled
from resmlp.core.errors import RunFailed, UserError
from resmlp.core.report import write_json
from resmlp.core.weights import WeightsSpec

EMBEDDINGS = "embeddings.safetensors"
TENSOR = "embeddings"          # the one tensor's name in it
CARD = "embed.json"            # <command>.json: core/outdir.py knows it for this project's
SHARDS = "shards"
INDEX = "index"                # index.csv or index.jsonl
FORMAT = "resmlp-ssl embeddings"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# safetensors' names of those dtypes (its format's header), and their bytes, little-endian
STORED = {torch.float32: ("F32", np.dtype("<f4")), torch.float16: ("F16", np.dtype("<f2"))}
# The card's entries that say what made the rows: another value is another output.
INPUTS = ("features", "key", "dtype", "normalized", "index")


@dataclass(frozen=True)
class Shards:
    """The split's `count` rows cut into shards of `size`."""
    count: int
    size: int

    def __len__(self) -> int:
        return -(-self.count // self.size)

    def rows(self, s: int) -> range:
        return range(s * self.size, min((s + 1) * self.size, self.count))

    @staticmethod
    def path(out: Path, s: int) -> Path:
        return out / SHARDS / f"{s:05d}.safetensors"


# --------------------------------------------------------------------------- the rows

def origin(dataset):
    """(column, row -> value): 'path' and the file of each row for image files, else 'index'
    and the row's index in the split (through data.subset's pick)."""
    from resmlp.data.folder import ImageFiles
    from resmlp.data.subset import SubsetDataset
    base, picked = dataset, None
    if isinstance(dataset, SubsetDataset):
        base, picked = dataset.base, dataset.indices
    at = (lambda r: int(picked[r])) if picked is not None else int
    if isinstance(base, ImageFiles):
        return "path", lambda r: base.path(at(r))
    return "index", at


def _header_problem(path: str) -> str | None:
    from PIL import Image
    try:
        with Image.open(path):   # reads the header only: the format and the size
            return None
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError, ...
        return f"{type(e).__name__}: {' '.join(str(e).split())}"


def check_headers(dataset, rows: list[int]) -> None:
    """UserError naming the first of the images of `rows` whose file does not open as an
    image (missing, unreadable, not an image), and how many; nothing for sets in memory."""
    column, name = origin(dataset)
    if column != "path" or not rows:
        return
    paths = [name(r) for r in rows]
    chunks = [paths[i:i + 4096] for i in range(0, len(paths), 4096)]
    with ThreadPoolExecutor(max(1, min(32, dist.cpu_cores()))) as pool:
        found = [bad for part in pool.map(lambda ps: [(p, _header_problem(p)) for p in ps], chunks)
                 for bad in part if bad[1] is not None]
    if found:
        path, why = found[0]
        raise UserError(f"{len(found)} image file(s) do not open as images, the first {path} ({why}); replace or "
                        "delete them (or set data.skip_corrupt=true to leave them out), then run again")


@torch.no_grad()
def rows_of(bb, x: torch.Tensor, dtype: torch.dtype, normalize: bool) -> torch.Tensor:
    """The stored rows of a batch: eval/features.py's forward and autocast, float32, then
    L2-normalised if asked, in `dtype`, on the CPU."""
    from resmlp.eval.features import forward_features
    x = x.to(bb.device, non_blocking=True)
    amp = bb.device.type == "cuda" and bb.amp_dtype != torch.float32
    with torch.autocast(bb.device.type, dtype=bb.amp_dtype, enabled=amp), uncompiled():
        f = forward_features(bb.model, x).float()
    return (F.normalize(f, dim=1) if normalize else f).to(dtype).cpu()


def write_shard(path: Path, rows: torch.Tensor, labels: torch.Tensor) -> None:
    from safetensors.torch import save
    with atomic_write(path, what="a shard of the embeddings",
                      then="free some space, then run the same command again (the finished shards are kept)") as fh:
        fh.write(save({TENSOR: rows.contiguous(), "labels": labels.contiguous()}))


def shard_shape(path: Path) -> tuple[int, int] | None:
    """(rows, dim) of a finished shard file, read from its header; None where there is none
    (or not a whole one)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    except Exception:  # noqa: BLE001 - missing, cut or foreign: embedded again
        return None
    rows, labels = shapes.get(TENSOR), shapes.get("labels")
    return (rows[0], rows[1]) if rows and len(rows) == 2 and labels == [rows[0]] else None


def shard_done(path: Path, rows: range) -> bool:
    return (shard_shape(path) or (None,))[0] == len(rows)


def embed_shards(cfg, bb, dataset, shards: Shards, mine: list[int], out: Path) -> None:
    """Embed this process's shards `mine`, in batches of its share of features.batch_size
    that never cross a shard's end, writing each shard as it is done."""
    from resmlp.core.preempt import shield_worker
    from resmlp.data.loader import Loader, cap_workers
    from resmlp.eval.features import Progress
    dtype, normalize = DTYPES[str(cfg.embed.dtype)], bool(cfg.embed.normalize)
    step = dist.share(int(cfg.features.batch_size))
    batches = {s: [list(r[i:i + step]) for i in range(0, len(r), step)] for s, r in zip(mine, map(shards.rows, mine))}
    workers = cap_workers(int(cfg.num_workers))
    loader = iter(Loader(dataset, batch_sampler=[b for s in mine for b in batches[s]], num_workers=workers,
                         pin_memory=torch.cuda.is_available(), worker_init_fn=shield_worker if workers else None))
    total = sum(len(shards.rows(s)) for s in mine)
    bar = _bar(total)
    said = Progress("embed", total, enabled=dist.is_main() and bar is None)
    kill_at, done = int(os.environ.get(KILL_AT_ENV, "0")), 0   # the resume tests' fault injection
    for s in mine:
        rows, labels = [], []
        for _ in batches[s]:
            x, y = next(loader)
            said.batch(len(x))
            rows.append(rows_of(bb, x, dtype, normalize))
            labels.append(torch.as_tensor(y).long().reshape(-1))
            if bar is not None:
                bar.update(len(x))
            done += 1
            if done == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        write_shard(shards.path(out, s), torch.cat(rows), torch.cat(labels))
    if bar is not None:
        bar.close()


def _bar(total: int):
    """tqdm's bar of this process's images, with their rate, on the first process's terminal
    (a log file gets Progress's lines instead)."""
    if not (dist.is_main() and sys.stderr.isatty()):
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="embed", unit="img", dynamic_ncols=True)


# --------------------------------------------------------------------------- the card

def make_card(cfg, bb, transform, shards: Shards) -> dict:
    """What the rows are and what made them (INPUTS compared with a folder's older card)."""
    from resmlp.eval.features import cache_key
    ident = WeightsSpec.parse(cfg.checkpoint).identity() or {}
    index = f"{INDEX}.{cfg.embed.index}"
    return {
        "format": FORMAT, "complete": False, "embeddings": EMBEDDINGS, "tensor": TENSOR, "index": index,
        "count": shards.count, "dim": None, "dtype": str(cfg.embed.dtype), "normalized": bool(cfg.embed.normalize),
        "key": bb.info.get("key"),
        "weights": {"spec": str(cfg.checkpoint), "sha256": ident.get("sha256"), "model": bb.info.get("model"),
                    "epoch": bb.info.get("epoch"), "weights_hash": bb.info["weights_hash"]},
        # eval/features.py's cache key of the same rows: weights, data, split, transform, precision
        "features": cache_key(bb.info["weights_hash"], cfg.data, str(cfg.embed.split), transform, 1, bb.amp_dtype),
        "shards": {"size": shards.size, "count": len(shards)},
        "load": f"safetensors.torch.load_file({EMBEDDINGS!r})[{TENSOR!r}]  # or safe_open(...).get_slice({TENSOR!r})",
    }


def read_card(out: Path) -> dict | None:
    try:
        card = json.loads((out / CARD).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) and card.get("format") == FORMAT else None


def differences(old: dict, new: dict) -> list[str]:
    """'entry: old -> new' for each input that differs (the features key's entries one by one)."""
    out = []
    for k in INPUTS:
        a, b = old.get(k), new.get(k)
        if k == "features" and isinstance(a, dict):
            out += [f"{j}: {a.get(j)} -> {b.get(j)}" for j in sorted(set(a) | set(b)) if a.get(j) != b.get(j)]
        elif a != b:
            out.append(f"{k}: {a} -> {b}")
    return out


def clear(out: Path) -> None:
    """Remove an earlier output of this command (out_ok=true replaces it)."""
    for name in (EMBEDDINGS, CARD, f"{INDEX}.csv", f"{INDEX}.jsonl"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / SHARDS, ignore_errors=True)


def prepare(cfg, out: Path, card: dict, dataset) -> dict:
    """The first process, before any image is embedded or any file written: refuse a folder
    holding the embeddings of other inputs (unless out_ok=true: then they are to be
    replaced), find the finished shards and check the others' images open. Returns
    {'finished': True} for a folder that holds these embeddings already, else whether to
    replace, the shard size (an older card's) and the shards still to embed."""
    old = read_card(out)
    there = [n for n in (CARD, EMBEDDINGS, SHARDS) if (out / n).exists()]
    diff = (differences(old, card) if old else [f"{', '.join(there)} without a card of this command"]) if there else []
    if diff and not cfg.out_ok:
        raise UserError(f"{out} holds embeddings made from other inputs or settings ({'; '.join(diff[:3])}); "
                        "choose another out=, or pass out_ok=true to replace them")
    if there and not diff and old.get("complete") and (out / EMBEDDINGS).is_file():
        return {"finished": True}
    resumed = old if there and not diff else {}   # its shards are kept, cut at its size
    size = int((resumed.get("shards") or {}).get("size") or card["shards"]["size"])
    shards = Shards(card["count"], size)
    pending = [s for s in range(len(shards)) if not resumed or not shard_done(shards.path(out, s), shards.rows(s))]
    check_headers(dataset, [r for s in pending for r in shards.rows(s)])
    return {"finished": False, "replace": bool(diff), "size": size, "pending": pending,
            "done": len(shards) - len(pending)}


def start(out: Path, card: dict, replace: bool) -> None:
    """The first process, once nothing is refused: an output replaced goes, the card
    (incomplete) comes."""
    if replace:
        clear(out)
    write_json(out / CARD, card)


def on_first(task):
    """task() on the first process, its result (or its UserError) on every process."""
    result = None
    if dist.is_main():
        try:
            result = ("ok", task())
        except UserError as e:
            result = ("error", str(e))
    kind, value = dist.broadcast_object(result)
    if kind == "error":
        raise UserError(value)
    return value


# --------------------------------------------------------------------------- assembling

def safetensors_header(count: int, dim: int, dtype: torch.dtype, metadata: dict) -> bytes:
    """The header of a safetensors file holding one (count, dim) tensor TENSOR: its byte
    length (u64, little-endian), then the JSON, padded with spaces to 8 bytes as safetensors
    writes it."""
    name, stored = STORED[dtype]
    head = {"__metadata__": {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()},
            TENSOR: {"dtype": name, "shape": [count, dim], "data_offsets": [0, count * dim * stored.itemsize]}}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def assemble(out: Path, shards: Shards, card: dict, dataset) -> dict:
    """embeddings.safetensors and the index from the shards, one shard in memory at a time;
    the card completed. Returns it."""
    from safetensors.torch import load_file
    paths = [shards.path(out, s) for s in range(len(shards))]
    missing = [p for s, p in enumerate(paths) if not shard_done(p, shards.rows(s))]
    if missing:
        raise RunFailed(f"{len(missing)} shard(s) missing once every process was done, the first {missing[0]}: "
                        "out= must be a folder every process writes to (one file system on every node)")
    dtype, dim = DTYPES[card["dtype"]], shard_shape(paths[0])[1]
    classes = list(getattr(dataset, "classes", None) or [])
    column, name = origin(dataset)
    head = safetensors_header(shards.count, dim, dtype, {"format": FORMAT, "card": CARD, "count": shards.count,
                                                          "dim": dim, "normalized": card["normalized"]})
    with atomic_write(out / EMBEDDINGS, what="the embeddings") as emb, \
            atomic_write(out / card["index"], "w", what="the embeddings' index") as idx:
        emb.write(head)
        columns = ["row", column] + (["label", "class"] if classes else [])
        lines = IndexLines(idx, card["index"].endswith(".csv"), columns)
        for s, path in enumerate(paths):
            part = load_file(str(path))
            rows, labels = part[TENSOR], part["labels"].tolist()
            if rows.dtype != dtype or rows.shape != (len(shards.rows(s)), dim):
                raise RunFailed(f"{path} holds {tuple(rows.shape)} {rows.dtype} rows where {len(shards.rows(s))} x "
                                f"{dim} {dtype} belong; delete it and run the same command again")
            emb.write(rows.contiguous().numpy().astype(STORED[dtype][1], copy=False).tobytes())
            for r, y in zip(shards.rows(s), labels):
                lines.add([r, name(r)] + ([y if y >= 0 else None, classes[y] if y >= 0 else None] if classes else []))
    return {**card, "complete": True, "dim": dim}


class IndexLines:
    """The index file's lines: CSV under a header row, or one JSON object each."""

    def __init__(self, fh, as_csv: bool, columns: list[str]):
        self.fh, self.columns = fh, columns
        self.csv = csv.writer(fh, lineterminator="\n") if as_csv else None
        if self.csv is not None:
            self.csv.writerow(columns)

    def add(self, values: list) -> None:
        if self.csv is not None:
            self.csv.writerow(["" if v is None else v for v in values])
        else:
            self.fh.write(json.dumps(dict(zip(self.columns, values))) + "\n")


# --------------------------------------------------------------------------- the command

def embed_command(cfg, bb) -> dict | None:
    """bash run.sh embed <ckpt | run dir | timm:<name>> [data=...] [key=student] [embed.dtype=fp16]
    [embed.normalize=true] [out=...]"""
    import resmlp.data as rdata
    from resmlp.data.folder import FileLists
    from resmlp.eval.command import log
    from resmlp.eval.features import extract_features
    transform = rdata.build_eval_transform(cfg.data)
    split = str(cfg.embed.split)
    dataset = rdata.build_dataset(cfg.data, split, transform=transform, lists=FileLists())
    if len(dataset) == 0:
        raise UserError(f"the {split} split of data={cfg.data.name} holds no images; check data.root / data.files")
    card, out = make_card(cfg, bb, transform, Shards(len(dataset), int(cfg.embed.shard_size))), bb.out_dir
    plan = on_first(lambda: prepare(cfg, out, card, dataset))
    if plan["finished"]:
        log(f"{out} holds these embeddings already ({out / EMBEDDINGS}, {card['count']} rows); nothing to do")
        return None
    # the first image through the network before any other: a size it cannot take is one line now
    extract_features(bb.model, [(dataset[0][0][None], torch.zeros(1))], bb.device, bb.amp_dtype, desc="embed")
    shards = Shards(len(dataset), plan["size"])
    card = {**card, "shards": {"size": shards.size, "count": len(shards)}}
    if dist.is_main():
        start(out, card, plan["replace"])
    if plan["done"]:
        log(f"embed: {plan['done']} of {len(shards)} shards were done ({out / SHARDS}); embedding the other "
            f"{len(plan['pending'])}")
    log(f"embed: {shards.count} images of {cfg.data.name} {split} in {len(shards)} shard(s) of {shards.size}, "
        f"{dist.world_size()} process(es), to {out}")
    embed_shards(cfg, bb, dataset, shards, plan["pending"][dist.rank()::dist.world_size()], out)
    dist.barrier()
    if not dist.is_main():
        return None
    card = assemble(out, shards, card, dataset)
    write_json(out / CARD, card)
    shutil.rmtree(out / SHARDS, ignore_errors=True)
    log(f"wrote {out / EMBEDDINGS} ({card['count']} x {card['dim']} {card['dtype']}"
        f"{', L2-normalised' if card['normalized'] else ''}) and {out / card['index']}")
    return card


def results_dir(cfg) -> Path:
    """Where the CLI checks it may write before any work: out=, else embed/ beside the checkpoint."""
    from resmlp.eval.command import results_dir as under
    return under(cfg, "embed")


def run(cfg) -> int:
    import resmlp.data as rdata
    from resmlp.eval.command import eval_command
    splits = rdata.dataset_splits(cfg.data)
    if cfg.embed.split not in splits:
        raise UserError(f"data={cfg.data.name} has the split(s) {', '.join(splits)}, "
                        f"not embed.split={cfg.embed.split}")
    return eval_command(embed_command, sub_dir="embed")(cfg)
