"""`bash run.sh bench [model] [key=value ...]`: throughput benchmarks in one process.

A tool for measuring this project, not a command of the package: run.sh puts tools/ on the
import path and runs `python -m bench`, which borrows the package's command line (its config
from bench.yaml beside this file, its checks and one-line errors). Rows (FAMILIES, a module
each): dino, e2e, torchrun, inference, knn, linear, aug, loader (the measured matmul peak
and device-to-device copy rate always run first). Sizes come from one profile of bench.yaml:
gpu (the real models at 224 px), cpu (a small ResMLP at 64 px: what this machine can say)
or tiny (the test's, seconds on a CPU); bench.profile=auto picks gpu when CUDA is visible.
Prints one table per row family and a summary against the goals, and writes
<out>/bench.json (out defaults to runs/bench). A line that fails prints its error in its
table and the others still run; the exit code is then 1. NOTES.md: method, predictions,
and the commands for a GPU machine.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from bench.config import BENCH_YAML
from bench.data import aug_family, loader_family
from bench.dino import dino_family
from bench.e2e import e2e_family
from bench.inference import inference_family
from bench.knn import knn_family
from bench.linear import linear_family
from bench.step import Skip
from bench.timing import copy_rate, matmul_rate, reset_memory
from bench.torchrun_step import torchrun_family
from resmlp.core import cli, dist, preempt
from resmlp.core.config import as_list, to_dict
from resmlp.core.errors import PREEMPTED_EXIT, UserError

FAMILIES = {"dino": dino_family, "e2e": e2e_family, "torchrun": torchrun_family, "inference": inference_family,
            "knn": knn_family, "linear": linear_family, "aug": aug_family, "loader": loader_family}
DEFAULT_MODEL = "resmlp_s12"  # what the CLI fills in when no model is given
GOALS = {"dino_vs_reference": 3.0, "pct_of_peak": 40.0, "e2e_vs_synthetic": 0.8, "torchrun_vs_one_process": 0.9,
         "inference_vs_timm": 1.5, "knn_seconds": 0.5, "loader_per_core": 500.0, "loader_vs_reference": 8.0,
         "linear_seconds": 300.0}


@dataclass
class Context:
    device: torch.device
    profile: str
    p: object                  # the profile's settings (DictConfig)
    models: list
    explicit_models: bool
    seed: int = 0
    peak_tflops: float | None = None
    results: list = field(default_factory=list)
    deadline: float | None = None      # time.perf_counter() after which lines are skipped
    on_row: object = None              # called after each line (writes the partial bench.json)
    previous: dict = field(default_factory=dict)  # line key -> its row from an earlier run (bench.resume)
    run: int = 1                       # this run's number in <out>/bench.json (bench.resume counts on)
    left: int = 0                      # lines left for the time limit or a stop signal

    def inference_models(self) -> list:
        return self.models if self.explicit_models else list(self.p.inference.models)

    def attempt(self, family: str, ident: dict, fn, restorable: bool = True) -> dict:
        """Run fn() -> fields; record a line with status ok / skipped / error. A line an
        earlier run measured (bench.resume) is taken from it instead, unless it only sets
        up what later lines use in this process (restorable=False, e.g. writing files)."""
        key = line_key(family, ident)
        if restorable and key in self.previous:
            row = self.previous.pop(key)
            self.results.append(row)
            print(f"[bench] {progress_line(row)} (run {row.get('run', 1)})", flush=True)
            return row
        t0 = time.perf_counter()
        try:
            if preempt.requested():
                raise Left(f"stopped by {preempt.received()} before this line")
            if self.deadline is not None and t0 > self.deadline:
                raise Left("bench.time_limit_s reached before this line")
            reset_memory(self.device)  # each line's mem_gb is its own peak, not an earlier line's
            row = {"row": family, **ident, "status": "ok", **(fn() or {})}
        except (Left, preempt.StopInEvaluation) as e:
            # a stop signal met inside the line (the evaluators end between batches) leaves it
            # as one met before it does: not measured, for the next run; no failure
            reason = str(e) if isinstance(e, Left) else f"stopped by {e} during this line"
            row = {"row": family, **ident, "status": "skipped", "reason": reason, "left": True}
            self.left += 1
        except Skip as e:
            row = {"row": family, **ident, "status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one line fails, the bench goes on
            traceback.print_exc(file=sys.stderr)
            msg = " ".join(str(e).split())[:300]
            row = {"row": family, **ident, "status": "error", "error": f"{type(e).__name__}: {msg}"}
            reset_memory(self.device)
        row.update(wall_s=round(time.perf_counter() - t0, 2), run=self.run, key=key)
        self.results.append(row)
        print(f"[bench] {progress_line(row)}", flush=True)
        if self.on_row is not None:
            self.on_row()
        return row


class Left(Exception):
    """A line not measured for lack of time (bench.time_limit_s, a stop signal): with
    bench.resume=true the next run measures it."""


def line_key(family: str, ident: dict) -> str:
    return json.dumps([family, ident], sort_keys=True, default=str)


def progress_line(row: dict) -> str:
    who = " ".join(str(row[k]) for k in ("model", "strategy", "backend", "protocol", "impl", "path")
                   if row.get(k) is not None)
    if row["status"] != "ok":
        return f"{row['row']}: {who}: {row['status'].upper()} {row.get('error') or row.get('reason')}"
    for key, unit in (("images_per_s", "img/s"), ("tflops", "TFLOP/s"), ("tb_per_s", "TB/s"), ("seconds", "s"),
                      ("rel_err", "rel err")):
        if row.get(key) is not None:
            return f"{row['row']}: {who}: {row[key]:.4g} {unit} ({row['wall_s']:.1f} s)"
    return f"{row['row']}: {who}: ok ({row['wall_s']:.1f} s)"


# --------------------------------------------------------------------------- setup

def choose(cfg) -> tuple[str, torch.device]:
    profile = str(cfg.bench.profile)
    cuda = torch.cuda.is_available()
    if profile == "auto":
        profile = "gpu" if cuda else "cpu"
    requested = str(cfg.device)
    if requested == "auto":
        requested = "cuda" if profile == "gpu" else "cpu"
    if profile == "gpu" and requested != "cuda":
        raise UserError("bench.profile=gpu measures a GPU; use device=auto or cuda (or bench.profile=cpu)")
    if requested == "cuda" and not cuda:
        raise UserError("no CUDA GPU is visible: use bench.profile=cpu (or auto) on this machine")
    return profile, dist.pick_device(requested)


def choose_models(cfg, p) -> tuple[list, bool]:
    if cfg.bench.models:
        return [str(m) for m in as_list(cfg.bench.models)], True
    if cfg.model.name != DEFAULT_MODEL:
        return [str(cfg.model.name)], True
    return [str(m) for m in p.models], False


def machine_info(device: torch.device) -> dict:
    def version(*names):
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                continue
        return None
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": version("torchvision"), "timm": version("timm"), "lightly": version("lightly"),
            "faiss": version("faiss-gpu", "faiss-cpu", "faiss-gpu-cu12", "faiss"),
            "cpu_cores": dist.cpu_cores(), "cpu": dist.cpu_model(), "device": str(device),
            "torch_threads": torch.get_num_threads(),
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    gpu_memory_gb=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = out.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["nvidia_smi"] = None
    return info


# --------------------------------------------------------------------------- peak

def peak_family(ctx) -> None:
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    size = int(ctx.p.matmul_size)
    row = ctx.attempt("peak", {"impl": "dense matmul", "dtype": str(dtype).replace("torch.", ""), "size": size},
                      lambda: matmul_rate(ctx.device, size, dtype))
    ctx.peak_tflops = row.get("tflops")  # also when an earlier run measured it
    mbytes = int(ctx.p.copy_mb)
    ctx.attempt("peak", {"impl": "device-to-device copy", "dtype": "float32", "size": f"{mbytes} MiB"},
                lambda: copy_rate(ctx.device, mbytes))


# --------------------------------------------------------------------------- summary

def _ok(results, family, **match):
    return [r for r in results if r["row"] == family and r["status"] == "ok"
            and all(r.get(k) == v for k, v in match.items())]


def add_ratios(results: list) -> None:
    """vs_ref on dino lines (same model, batch and strategy), vs_timm on inference lines,
    vs_lightly on augmentation lines."""
    for r in _ok(results, "dino"):
        if r["impl"] != "reference" and "images_per_s" in r:
            same = {"model": r["model"], "batch": r.get("batch")}
            ref = _ok(results, "dino", strategy=r["strategy"], impl="reference", **same)
            r["vs_ref"] = r["images_per_s"] / ref[0]["images_per_s"] if ref else None
            resize = _ok(results, "dino", strategy="resize", impl="reference", **same)
            r["vs_ref_resize"] = r["images_per_s"] / resize[0]["images_per_s"] if resize else None
    for r in _ok(results, "inference"):
        if "images_per_s" in r:
            base = _ok(results, "inference", model=r["model"], impl="timm eager")
            r["vs_timm_eager"] = r["images_per_s"] / base[0]["images_per_s"] if base else None
    lightly = _ok(results, "aug", impl="lightly DINOTransform")
    for r in _ok(results, "aug"):
        if r.get("per_core") and lightly and r["impl"] != "lightly DINOTransform" and r.get("crops") != "-":
            r["vs_lightly"] = r["images_per_s"] / lightly[0]["images_per_s"]


def summarize(results: list, device: torch.device) -> list[dict]:
    """One line per goal: the measured figure next to the goal."""
    lines = []

    def line(what, value, goal, better, fmt, note="", cpu_goal=False):
        met = None if value is None else (value >= goal if better == "higher" else value <= goal)
        if device.type != "cuda" and not cpu_goal:
            met = None  # the goals are GPU goals: on a CPU the figure is only shown
        lines.append({"what": what, "value": value, "goal": goal, "better": better, "met": met,
                      "text": f"{what}: {'-' if value is None else format(value, fmt)} "
                              f"(goal {'>=' if better == 'higher' else '<'} {goal:g}){note}"})

    for model in dict.fromkeys(r["model"] for r in _ok(results, "dino")):
        ours = [r for r in _ok(results, "dino", model=model) if r["impl"] != "reference" and r.get("vs_ref")]
        if ours:
            best = max(ours, key=lambda r: r["vs_ref"])
            each = ", ".join(f"{r['strategy']} {r['impl'].removeprefix('ours ')} b{r.get('batch')} {r['vs_ref']:.2f}x"
                             for r in ours)
            line(f"dino step, ours vs reference loop, {model} (best: {best['strategy']}, {best['impl']}, "
                 f"batch {best.get('batch')})", best["vs_ref"], GOALS["dino_vs_reference"], "higher", ".2f", f"; {each}")
        pct = [r for r in _ok(results, "dino", model=model) if r["impl"] != "reference" and r.get("pct_peak")]
        if pct:
            best = max(pct, key=lambda r: r["pct_peak"])
            line(f"dino step, % of measured matmul peak, {model} (best: {best['strategy']}, {best['impl']}, "
                 f"batch {best.get('batch')})", best["pct_peak"], GOALS["pct_of_peak"], "higher", ".1f")
    for r in _ok(results, "e2e"):
        if r.get("vs_synthetic") is not None:
            line(f"end-to-end from JPEGs vs synthetic input, {r['model']}, {r['path']} ({r['workers']} workers)",
                 r["vs_synthetic"], GOALS["e2e_vs_synthetic"], "higher", ".2f")
    for r in _ok(results, "torchrun"):
        if r.get("vs_one_process") is not None:
            line(f"dino step under a one-process torchrun ({r.get('backend')}) vs in one process, {r['model']}, "
                 f"{r['impl']}, batch {r['batch']}", r["vs_one_process"], GOALS["torchrun_vs_one_process"],
                 "higher", ".2f")
    for r in _ok(results, "inference"):
        if r.get("vs_timm_eager") and r["impl"] == "ours folded compile" or (
                r.get("vs_timm_eager") and r["impl"] == "ours folded eager"
                and not _ok(results, "inference", model=r["model"], impl="ours folded compile")):
            line(f"inference, {r['impl']} vs timm eager, {r['model']} ({r['dtype']}, batch {r['batch']})",
                 r["vs_timm_eager"], GOALS["inference_vs_timm"], "higher", ".2f")
    for r in _ok(results, "loader"):
        if r["impl"].startswith("ours, DINO device path"):
            load = "/".join(f"{x:.1f}" for x in r["load_avg"] if x is not None)
            line(f"loader side per CPU core, DINO device path, {r['image']} JPEGs, img/s (load average {load})",
                 r["images_per_s"], GOALS["loader_per_core"], "higher", ".0f", cpu_goal=True)
            if r.get("vs_reference") is not None:
                line("the same vs the reference DINO transform on the same files and core",
                     r["vs_reference"], GOALS["loader_vs_reference"], "higher", ".1f", cpu_goal=True)
    for r in _ok(results, "knn"):
        if r["backend"] in ("torch", "torch-device", "faiss-gpu") and r.get("device") == device.type:
            line(f"k-NN {r['backend']} on {r['device']}, {r['n_train']} x {r['dim']}, k={r['k']}, "
                 f"seconds for all queries", r["seconds_full"], GOALS["knn_seconds"], "lower", ".2f")
    for r in _ok(results, "linear", protocol="lbfgs"):
        line(f"linear probe (lbfgs, the default) on {r['device']}, {r['n_train']} x {r['dim']}, {r['classes']} "
             f"classes, seconds for the selection over {r['l2s']} L2s and the refit", r["seconds"],
             GOALS["linear_seconds"], "lower", ".1f")
    return lines


# --------------------------------------------------------------------------- tables

COLUMNS = {
    "peak": [("impl", "what", ""), ("dtype", "dtype", ""), ("size", "n", ""), ("tflops", "TFLOP/s", ".4g"),
             ("tb_per_s", "TB/s", ".4g"), ("spread", "spread", ".1%")],
    "dino": [("model", "model", ""), ("strategy", "strategy", ""), ("impl", "impl", ""),
             ("precision", "precision", ""), ("batch", "batch", ""), ("crops", "crops", ""),
             ("images_per_s", "img/s", ".1f"), ("crops_per_s", "crops/s", ".0f"), ("step_ms", "step ms", ".1f"),
             ("gflop_per_image", "GFLOP/img", ".1f"), ("tflops", "TFLOP/s", ".3g"), ("pct_peak", "%peak", ".1f"),
             ("mem_gb", "mem GB", ".2f"), ("first_s", "1st call s", ".1f"), ("spread", "spread", ".0%"),
             ("vs_ref", "vs ref", "x")],
    "e2e": [("model", "model", ""), ("strategy", "strategy", ""), ("impl", "impl", ""), ("path", "path", ""),
            ("workers", "workers", ""), ("batch", "batch", ""), ("images_per_s", "img/s", ".1f"),
            ("loader_only_images_per_s", "loader alone img/s", ".1f"), ("vs_synthetic", "vs synthetic", "x"),
            ("mem_gb", "mem GB", ".2f"), ("wall_s", "wall s", ".1f")],
    "torchrun": [("model", "model", ""), ("strategy", "strategy", ""), ("impl", "impl", ""), ("path", "path", ""),
                 ("batch", "batch", ""), ("crops", "crops", ""), ("images_per_s", "img/s", ".1f"),
                 ("step_ms", "step ms", ".1f"), ("first_s", "1st call s", ".1f"), ("spread", "spread", ".0%"),
                 ("backend", "group", ""), ("mem_gb", "mem GB", ".2f"), ("vs_one_process", "vs one process", "x")],
    "inference": [("model", "model", ""), ("impl", "impl", ""), ("dtype", "dtype", ""), ("batch", "batch", ""),
                  ("images_per_s", "img/s", ".1f"), ("ms", "ms/batch", ".2f"), ("first_s", "1st call s", ".1f"),
                  ("mem_gb", "mem GB", ".2f"), ("vs_timm_eager", "vs timm eager", "x"), ("rel_err", "rel err", ".1e")],
    "knn": [("backend", "backend", ""), ("device", "device", ""), ("n_train", "train", ""), ("dim", "dim", ""),
            ("queries", "queries", ""), ("k", "k", ""), ("seconds", "s", ".3f"),
            ("seconds_full", "s (all queries)", ".2f"),
            ("queries_per_s", "queries/s", ".0f"), ("top1", "top1 %", ".1f"), ("mem_gb", "mem GB", ".2f"),
            ("baseline_seconds", "baseline s", ".3f"), ("vs_baseline", "vs baseline", "x"),
            ("matmul_s", "pass: matmuls s", ".3f"), ("maxima_s", "+ maxima s", ".3f")],
    "linear": [("protocol", "protocol", ""), ("device", "device", ""), ("n_train", "train", ""), ("dim", "dim", ""),
               ("classes", "classes", ""), ("seconds", "s", ".1f"), ("selection_s", "selection s", ".1f"),
               ("refit_s", "refit s", ".1f"), ("seconds_full", "s (all epochs)", ".1f"),
               ("epoch_s", "s/epoch", ".2f"), ("l2s", "L2s", ""), ("iterations", "iterations", ""),
               ("passes", "passes", ""), ("l2", "L2 chosen", ".0e"), ("top1", "top1 %", ".2f"),
               ("mem_gb", "mem GB", ".2f")],
    "aug": [("impl", "impl", ""), ("where", "where", ""), ("threads", "threads", ""), ("crops", "crops", ""),
            ("images_per_s", "img/s", ".1f"), ("vs_lightly", "vs lightly", "x"), ("mem_gb", "mem GB", ".2f")],
    "loader": [("impl", "impl", ""), ("where", "where", ""), ("threads", "threads", ""), ("image", "files", ""),
               ("mean_kb", "KB/file", ".0f"), ("images_per_s", "img/s", ".1f"), ("vs_reference", "vs reference", "x"),
               ("spread", "spread", ".0%"), ("load_avg", "load avg before/after", "pair")],
}


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "pair":
        return "/".join("-" if v is None else f"{v:.1f}" for v in value)
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)


def format_table(family: str, rows: list) -> str:
    cols = COLUMNS[family]
    ok = [r for r in rows if r["status"] == "ok"]
    # drop columns no line of this family fills
    cols = [c for c in cols if any(r.get(c[0]) is not None for r in ok)
            or c[0] in ("model", "impl", "backend", "protocol")]
    cells = [[h for _, h, _ in cols]]
    notes = []
    for r in rows:
        if r["status"] == "ok":
            cells.append([_cell(r.get(k), f) for k, _, f in cols])
        else:
            ident = [_cell(r.get(k), "") if r.get(k) is not None else "" for k, _, _ in cols]
            text = f"{r['status'].upper()}: {r.get('error') or r.get('reason')}"
            first_free = next((i for i, c in enumerate(cols) if r.get(c[0]) is None), len(cols))
            cells.append(ident[:first_free])
            notes.append((len(cells) - 1, text))
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(len(cols))]
    out = []
    for n, row in enumerate(cells):
        text = "  ".join(c.rjust(w) if n and k >= 1 and _numeric(c) else c.ljust(w)
                         for k, (c, w) in enumerate(zip(row, widths)))
        for idx, note in notes:
            if idx == n:
                text += "  " + note
        out.append(text.rstrip())
    return "\n".join(out)


def _numeric(text: str) -> bool:
    return text[:1].isdigit() or text[:1] == "-" and text[1:2].isdigit()


TITLES = {"peak": "measured dense matmul rate (the ceiling for %peak) and device-to-device copy rate",
          "dino": "DINO training step on synthetic crops on the device: images/s (1 image = all its crops)",
          "e2e": "end-to-end: the same step fed from JPEG files by DataLoader workers",
          "torchrun": "the dino step in a one-process torchrun job and in this process",
          "inference": "inference, random weights: images/s",
          "knn": "weighted k-NN (T=0.07): seconds",
          "linear": "the linear probe on cached features, each protocol's grid whole: seconds",
          "aug": "augmentation: images/s (1 image = all its crops); threads 1 = per CPU core",
          "loader": "loader side per CPU core on JPEG files: read, decode, per-image work, collate (images/s)"}


def render(results: list, summary: list, meta: dict, profile: str) -> str:
    load = meta["load_average"][0] if meta.get("load_average") else "?"
    head = (f"bench profile={profile} on {meta.get('gpu') or meta['cpu']} ({meta['cpu_cores']} CPU cores, "
            f"torch threads {meta['torch_threads']}, load average {load} at start), torch {meta['torch']}, "
            f"{meta['date']}")
    parts = [head]
    for family in COLUMNS:
        rows = [r for r in results if r["row"] == family]
        if rows:
            parts += ["", f"== {family}: {TITLES[family]}", format_table(family, rows)]
    if summary:
        gpu = "gpu" in meta
        parts += ["", "== against the goals" + ("" if gpu else " (the GPU goals are for one H100/H200: a CPU run shows "
                                                     "their figures only; the loader goals are per CPU core)")]
        parts += [("  [met]  " if s["met"] else "  [open] " if s["met"] is False else "  ") + s["text"]
                  for s in summary]
    failed = [r for r in results if r["status"] == "error"]
    if failed:
        parts += ["", f"{len(failed)} line(s) failed; tracebacks are on stderr"]
    return "\n".join(parts)


# --------------------------------------------------------------------------- entry

def results_dir(cfg) -> Path:
    return Path(cfg.out).expanduser() if cfg.out else Path("runs") / "bench"


def bench(cfg) -> dict:
    """Run the configured rows; return the report (also written to <out>/bench.json)."""
    profile, device = choose(cfg)
    p = cfg.bench[profile]
    families = [str(f) for f in as_list(cfg.bench.rows)]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UserError(f"bench.rows has {unknown}; choose from {', '.join(FAMILIES)}")
    baseline = p.knn.get("baseline") if "knn" in families else None
    if baseline and not Path(str(baseline)).expanduser().is_file():
        raise UserError(f"bench.{profile}.knn.baseline={baseline}: no such file; give a copy of eval/knn_search.py, "
                        "e.g. git show <commit>:eval/knn_search.py > /tmp/knn_before.py")
    models, explicit = choose_models(cfg, p)
    from resmlp.models import list_models
    bad = [m for m in models if m not in list_models()]
    if bad:
        raise UserError(f"the bench measures the ResMLP presets ({', '.join(list_models())}), not {bad}")
    out_dir = results_dir(cfg)
    torch.manual_seed(int(cfg.seed))
    # As the trainer (core.run.Run) and DINO's main_dino.py do, for ours and the reference alike.
    torch.backends.cudnn.benchmark = device.type == "cuda"
    old_threads = torch.get_num_threads()
    if p.get("threads"):
        torch.set_num_threads(int(p.threads))
    try:
        with warnings.catch_warnings():
            # lightly's head uses the deprecated torch.nn.utils.weight_norm: one warning per build
            warnings.filterwarnings("ignore", message=".*weight_norm.*")
            return _bench(cfg, profile, device, p, families, models, explicit, out_dir)
    finally:
        torch.set_num_threads(old_threads)


def _bench(cfg, profile, device, p, families, models, explicit, out_dir) -> dict:
    meta = machine_info(device)
    print(f"bench: profile {profile} on {meta.get('gpu') or meta['cpu']}, rows {', '.join(families)}, "
          f"models {', '.join(models)}", flush=True)
    load = meta.get("load_average")
    if device.type == "cpu" and load and load[0] > 0.5 * meta["cpu_cores"]:
        print(f"bench: note: load average {load[0]:.1f} on {meta['cpu_cores']} cores before starting: other "
              f"processes share these cores, the CPU timings will be low and noisy", flush=True)
    ctx = Context(device, profile, p, models, explicit, seed=int(cfg.seed))
    t0 = time.perf_counter()
    if cfg.bench.time_limit_s:
        ctx.deadline = t0 + float(cfg.bench.time_limit_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = resume(cfg, ctx, out_dir / "bench.json", profile, families, models)

    def write(summary=None):
        report = {"meta": meta, "profile": profile, "settings": to_dict(p), "rows_requested": families,
                  "models": models, "wall_s": round(time.perf_counter() - t0, 1), "goals": GOALS,
                  "complete": summary is not None, "runs": ctx.run, "left": ctx.left, "families_done": done,
                  "summary": summary or [], "rows": all_rows()}
        tmp = out_dir / "bench.json.tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2, default=str)
        tmp.replace(out_dir / "bench.json")
        return report
    def all_rows():  # an earlier run's lines this one did not reach stay in bench.json
        return ctx.results + list(ctx.previous.values())
    ctx.on_row = write
    for family in ["peak", *families]:
        if family in done:  # every line of it measured by an earlier run (bench.resume)
            continue
        fn = peak_family if family == "peak" else FAMILIES[family]
        left_before = ctx.left
        try:
            fn(ctx)
        except Exception as e:  # noqa: BLE001 - a family that breaks before its lines
            traceback.print_exc(file=sys.stderr)
            ctx.results.append({"row": family, "impl": "(setup)", "status": "error", "run": ctx.run,
                                "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
            continue  # not done: a resumed run tries the lines it did not reach
        if ctx.left == left_before:
            done.append(family)
    rows = all_rows()
    add_ratios(rows)
    summary = summarize(rows, device)
    report = write(summary)
    print()
    print(render(rows, summary, meta, profile))
    print(f"\nwrote {out_dir / 'bench.json'} ({report['wall_s']:.0f} s)", flush=True)
    return report


# Profile keys that only choose which lines run, not how one is measured (each line's key
# names its model, strategy, impl, batch, backend; a lever's impl names the lever): a resumed
# run may choose others.
SELECTION = ("models", "strategies", "compile", "fused", "levers", "graphs", "reference", "largest_batch",
             "knn.backends", "inference.models", "linear.protocols")


def _measuring(settings: dict) -> str:
    """The profile's settings without its SELECTION keys, as comparable text."""
    s = json.loads(json.dumps(settings, default=str))
    for key in SELECTION:
        *parents, last = key.split(".")
        d = s
        for k in parents:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d.pop(last, None)
    return json.dumps(s, sort_keys=True)


def resume(cfg, ctx: Context, path: Path, profile: str, families: list, models: list) -> list:
    """bench.resume=true: the lines an earlier run measured with the same profile and
    measuring settings are kept (ctx.previous, by line key; whole families at once when it
    chose the same lines) and only the rest are measured; lines this run does not choose
    stay in bench.json. A line that failed (status error) is measured again when this run
    chooses its family: a failure a window met (a process killed under it, a device fault)
    is not a figure to keep. Returns the families already done."""
    if not cfg.bench.resume or not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"bench.resume=true cannot read {path} ({e}); delete it or pass bench.resume=false") from None
    changed = [k for k, same in (("profile", old.get("profile") == profile),
                                 ("settings", _measuring(old.get("settings") or {}) == _measuring(to_dict(ctx.p))))
               if not same]
    if changed:
        raise UserError(f"{path} was measured with other {', '.join(changed)}: pass the same settings to resume "
                        "it, or bench.resume=false (or out=<another dir>) to start again")
    ctx.run = int(old.get("runs", 1)) + 1
    same_lines = (old.get("rows_requested") == families and old.get("models") == models
                  and json.dumps(old.get("settings"), sort_keys=True, default=str)
                  == json.dumps(to_dict(ctx.p), sort_keys=True, default=str))
    rows = old.get("rows", [])
    retry = {r["row"] for r in rows if r.get("status") == "error" and r["row"] in ("peak", *families)}
    done = [f for f in old.get("families_done", []) if f in ("peak", *families) and f not in retry] \
        if same_lines else []
    for row in rows:
        if row.get("status") == "error" and row["row"] in retry:
            continue
        if row["row"] in done:
            ctx.results.append(row)
        elif "key" in row and not row.get("left"):
            ctx.previous[row["key"]] = row
    if "peak" in done:
        ctx.peak_tflops = next((r["tflops"] for r in ctx.results if r["row"] == "peak" and r["status"] == "ok"
                                and "tflops" in r), None)
    print(f"bench: resuming {path} (run {ctx.run}): {len(ctx.results) + len(ctx.previous)} line(s) measured "
          f"before, families done: {', '.join(done) or 'none'}", flush=True)
    return done


def run(cfg) -> int:
    """Exit 0: every line measured; 1: some failed; 75 (PREEMPTED_EXIT): lines were left for
    bench.time_limit_s or a stop signal (SIGTERM / SIGUSR1 end the run after the current
    line, or within it where an evaluator stops between batches, leaving it), which the same
    command with bench.resume=true measures next."""
    with preempt.watch():
        report = bench(cfg)
    if report["left"]:
        print(f"bench: {report['left']} line(s) left for lack of time: run the same command with "
              "bench.resume=true to measure them", file=sys.stderr)
        return PREEMPTED_EXIT
    failed = sum(r["status"] == "error" for r in report["rows"])
    if failed:
        print(f"error: {failed} benchmark line(s) failed (see the table)", file=sys.stderr)
        return 1
    return 0


# Not a command of the package (core/cli.py): a tool for measuring this project, which
# borrows the command line's config (its own YAML), checks and one-line errors.
COMMAND = cli.Command("bench.bench:run", "GPU/CPU throughput benchmarks", "model", writes="bench.bench:results_dir",
                      ignores=cli.NO_WEIGHTS, method=str(BENCH_YAML))


def main(argv: list[str] | None = None) -> int:
    """`python -m bench [model] [key=value ...]` (run.sh's `bench`)."""
    return cli.main(["bench", *(sys.argv[1:] if argv is None else argv)], commands={"bench": COMMAND})
