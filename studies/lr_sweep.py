"""The learning rate, swept (issue 35; docs/dino_learning.md, "The learning rate, swept").

    python studies/lr_sweep.py run RECIPE [--lr A,B,...] [--out DIR] [key=value ...]
    python studies/lr_sweep.py table [--out DIR] [--figure PNG]
    python studies/lr_sweep.py preset [--lr 0.0005] [--epochs 45] [--warmup 10] [--eval-every 10]

`run` trains one point per rate of the list (default: the recipe's grid), each the
project's own command, `bash run.sh dino resmlp_s12 <the recipe's keys> optim.lr=<rate>
<key=value ...> eval_every=... out=DIR/RECIPE/<point>` (run as `python -m resmlp.core.cli`
in a subprocess), so that every point is repeated by the command it prints. A point is
named by its rate and the keys that tell points apart (`lr0.032_w2_s1`: optim.warmup_epochs=2,
seed=1; `b`: batch_size, `e`: epochs); any other key=value goes into the command but not the
name, and a point is refused when its folder holds a run of another command. The study is
resumable: a finished point (its results.json) is not run again; a killed one continues from
its checkpoint (resume=auto). Beside each run dir, <point>.log holds its output and
<point>.json its command, rc, start, wall and the machine's load average while it ran.

The recipes (each point adds optim.lr and whatever the command line gives):
    demo       the CPU demo as it was before this study (DINOv2's Sinkhorn-Knopp and KoLeo 0.1,
               dim 64, depth 4, 5000 images, 8 epochs, batch 64, warm-up 1 epoch), demo=true
    published  the same with DINO as published: dino.centering=mean dino.koleo_weight=0
    standin    a CPU-sized stand-in for the Fashion-MNIST GPU preset (STANDIN below): its crops
               (2 x 32 px + 8 x 16 px), head (16384 prototypes, 2048 hidden, 256 bottleneck),
               DINO as published, teacher momentum 0.996 and drop path 0.1, on a narrower and
               shallower ResMLP and fewer images, with its warm-up a tenth of the schedule as
               the preset's

`table` reads every point under DIR (default runs/lr_sweep): its results.json (final k-NN
and linear, wall), log.jsonl (the k-NN of every epoch, the teacher's KL to the batch-mean
target at every log line, from which the collapse watch is replayed with the run's own
threshold and patience: the trainer prints its warning but records only the KL) and
config.yaml (the rate, warm-up, batch and seed the run really had). It prints markdown
tables and draws docs/figures/lr_sweep.png: the final k-NN against the rate per recipe, and
the k-NN curves per epoch.

Compute plan (2-core machine shared with other work; two points at a time, each pinned to
one core, `taskset -c 0` / `taskset -c 1`, so that each trains on one thread: torch takes as
many threads as the cores it may use, and the same command on one core gives the same
numbers): every recipe on a x4 grid from its default rate up past the rate where learning
stops or the watch warns, x2 steps around the best, then the warm-up (0, 1, 2, 4 epochs)
at the best rate, a second seed at the chosen points, and batch 128 against 64 at the same
rate per 256 images (and at the square-root rule's) for the scaling check.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path("runs/lr_sweep")
FIGURE = ROOT / "docs" / "figures" / "lr_sweep.png"

DEMO = ["demo=true", "optim.warmup_epochs=1"]
# The Fashion-MNIST preset (configs/recipe/dino_fashion_mnist.yaml: S12 at dim 384, depth 12,
# 60k images, batch 512, 100 epochs, warm-up 10 of them, teacher momentum 0.996) cut to about
# 20 minutes per point on one loaded CPU core: its crops, head, drop path and centering as they
# are (demo=false), a third of its width and depth, 2560 images, batch 64, 6 epochs with the
# warm-up the same tenth of the schedule, and the demo's teacher momentum (0.996 follows the
# student over ~250 iterations: the stand-in's whole run).
STANDIN = ["demo=false", "model.dim=128", "model.depth=4", "data.subset=2560", "batch_size=64", "epochs=6",
           "optim.warmup_epochs=0.6", "dino.momentum_teacher=0.99", "num_workers=0"]
RECIPES = {
    "demo": {"keys": DEMO, "grid": [0.002, 0.008, 0.032, 0.128, 0.512], "eval_every": 1},
    "published": {"keys": [*DEMO, "dino.centering=mean", "dino.koleo_weight=0"],
                  "grid": [0.002, 0.008, 0.032, 0.128, 0.512], "eval_every": 1},
    "standin": {"keys": STANDIN, "grid": [0.0005, 0.002, 0.008, 0.032, 0.128], "eval_every": 2},
}
# the keys that name a point, and their letter
TAGS = {"optim.warmup_epochs": "w", "seed": "s", "batch_size": "b", "epochs": "e"}


def refuse(message: str):
    """Bad input to the study: one line, exit 2 (the project's rule for its commands)."""
    print(message, file=sys.stderr)
    sys.exit(2)


def beside(run_dir: Path, suffix: str) -> Path:
    """<point>.json or <point>.log next to the point's run dir (its name has dots: lr0.002)."""
    return run_dir.parent / (run_dir.name + suffix)


def point_name(lr: float, overrides: list[str]) -> str:
    name = f"lr{lr:g}"
    for o in overrides:
        key, value = o.split("=", 1)
        if key in TAGS:
            name += f"_{TAGS[key]}{value}"
    return name


def command(recipe: str, lr: float, overrides: list[str], run_dir: Path) -> list[str]:
    r = RECIPES[recipe]
    return ["dino", "resmlp_s12", *r["keys"], f"optim.lr={lr:g}", f"eval_every={r['eval_every']}", *overrides,
            f"out={run_dir}"]


def run_point(recipe: str, lr: float, overrides: list[str], out: Path) -> int:
    """Train one point unless it finished; its output into <point>.log, its record into <point>.json."""
    run_dir = out / recipe / point_name(lr, overrides)
    argv = command(recipe, lr, overrides, run_dir)
    shown = "bash run.sh " + " ".join(argv)
    record_path = beside(run_dir, ".json")
    if record_path.exists():
        before = json.loads(record_path.read_text())["command"]
        if before != shown:
            refuse(f"{run_dir} holds a run of another command ({before}); choose another --out")
    if (run_dir / "results.json").exists():
        print(f"{run_dir}: finished, not run again")
        return 0
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"{run_dir}: {shown}", flush=True)
    loads, t0 = [], time.time()
    with open(beside(run_dir, ".log"), "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "resmlp.core.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONSAFEPATH": "1"})
        try:
            while True:  # the machine's load while the point runs (its wall time means nothing without it)
                loads.append(os.getloadavg()[0])
                try:
                    rc = proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:  # the study stopped: the run checkpoints and stops too (resume=auto continues it)
            proc.terminate()
            proc.wait()
            raise
    record = {"command": shown, "rc": rc, "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
              "wall_s": round(time.time() - t0, 1), "cores": len(os.sched_getaffinity(0)),
              "load_mean": round(sum(loads) / len(loads), 2), "load_max": round(max(loads), 2)}
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{run_dir}: rc {rc}, {record['wall_s']:.0f} s, load {record['load_mean']:.1f}", flush=True)
    return rc


# ---------------------------------------------------------------------------- the table

def lr_sums(cfg, ipe: int):
    """Σ lr after each epoch (index e: the sum of the per-iteration rates of epochs 1..e), from
    the trainer's own schedule (ssl/train.py: the linear rule, warm-up, cosine): the distance
    AdamW's steps can go, which a rate and a length trade against each other."""
    import numpy as np

    from resmlp.core.optim import scaled_lr
    from resmlp.core.schedules import cosine_schedule
    o = cfg.optim
    lr = cosine_schedule(scaled_lr(o, cfg.batch_size), o.min_lr, cfg.epochs, ipe, o.warmup_epochs)
    return np.concatenate([[0.0], np.cumsum(lr)[ipe - 1::ipe]])


def read_point(run: Path) -> dict | None:
    """What the table shows of one run dir (None: no run there yet)."""
    from omegaconf import OmegaConf

    from resmlp.ssl.health import CollapseWatch, collapse_kl
    if not (run / "config.yaml").exists() or not (run / "log.jsonl").exists():
        return None
    cfg = OmegaConf.load(run / "config.yaml")
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    curve = {int(r["epoch"]): r["knn_top1"] for r in rows if "knn_top1" in r}
    kls = [(r.get("iteration"), r["teacher_kl_mean"]) for r in rows if "teacher_kl_mean" in r]
    watch = CollapseWatch(collapse_kl(cfg.dino), int(cfg.dino.collapse_patience))
    warned = None
    for it, kl in kls:  # the trainer's watch, replayed on the KL it logged
        if watch.update(kl) and warned is None:
            warned = it
    res = json.loads((run / "results.json").read_text()) if (run / "results.json").exists() else {}
    extra = beside(run, ".json")
    rec = json.loads(extra.read_text()) if extra.exists() else {}
    scaled = float(cfg.optim.lr) * int(cfg.batch_size) / float(cfg.optim.lr_batch)
    ipe = next((round(r["iteration"] / r["epoch"]) for r in rows if r.get("iteration") and r.get("epoch")), None)
    sums = lr_sums(cfg, ipe) if ipe else None
    return {"point": run.name, "lr": float(cfg.optim.lr), "peak lr": scaled, "warm-up": cfg.optim.warmup_epochs,
            "batch": int(cfg.batch_size), "seed": int(cfg.seed), "epochs": int(cfg.epochs),
            "init": curve.get(0), "k-NN": res.get("knn_top1"), "linear": res.get("linear_top1"),
            "curve": curve, "Σlr": {e: float(sums[e]) for e in curve} if sums is not None else {},
            "Σlr end": float(sums[-1]) if sums is not None else None, "KL lowest": min((kl for _, kl in kls), default=None),
            "watch": ("-" if not kls else f"warned at {warned}" if warned is not None else "no"),
            "threshold": collapse_kl(cfg.dino), "wall s": res.get("wall_time_s"),
            "resumed": len((res.get("timing") or {}).get("starts", [])) > 1, "load": rec.get("load_mean"),
            "finished": bool(res)}


def points(out: Path) -> dict[str, list[dict]]:
    found = {}
    for recipe_dir in sorted(p for p in out.iterdir() if p.is_dir()) if out.is_dir() else []:
        rows = [r for r in map(read_point, sorted(p for p in recipe_dir.iterdir() if p.is_dir())) if r]
        if rows:
            found[recipe_dir.name] = sorted(rows, key=lambda r: (r["lr"], r["warm-up"], r["batch"], r["seed"],
                                                                   r["epochs"]))
    return found


DIGITS = {"KL lowest": 3, "wall s": 0, "load": 1, "Σlr end": 3}  # every other float: 2 decimals, or 3 significant under 0.1


def _fmt(v, col: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if col in ("lr", "peak lr"):
            return f"{v:g}"
        if col in DIGITS:
            return f"{v:.{DIGITS[col]}f}"
        return f"{v:.3g}" if abs(v) < 0.1 else f"{v:.2f}"
    return str(v)


def markdown(found: dict[str, list[dict]]) -> str:
    cols = ["point", "lr", "peak lr", "warm-up", "batch", "seed", "epochs", "Σlr end", "init", "k-NN", "linear", "KL lowest",
            "watch", "wall s", "load"]
    out = []
    for recipe, rows in found.items():
        out += [f"### {recipe}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [_fmt(r[c], c) for c in cols]
            if not r["finished"]:
                cells[cols.index("k-NN")] = "(running)"
            if r["resumed"]:
                cells[cols.index("wall s")] += " (last start)"
            out.append("| " + " | ".join(cells) + " |")
        epochs = sorted({e for r in rows for e in r["curve"]})
        out += ["", f"k-NN per epoch ({recipe}):", "", "| point | " + " | ".join(map(str, epochs)) + " |",
                "|---|" + "---:|" * len(epochs)]
        out += ["| " + r["point"] + " | " + " | ".join(_fmt(r["curve"].get(e)) for e in epochs) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def figure(found: dict[str, list[dict]], path: Path) -> None:
    """Top: the final k-NN against the rate per 256 images (seed 0 at each recipe's own warm-up
    and batch: filled; other points: hollow); the k-NN of every epoch of every point against
    Σ lr so far (the end of each run: a larger marker); the final linear probe against the rate.
    Below, one panel per recipe: the k-NN per epoch of its rate grid."""
    from resmlp.eval.figure import new_figure
    n = max(len(found), 2)
    fig = new_figure(4.6 * n, 7.6)
    grid = fig.subplots(2, n, squeeze=False)
    axes = [grid[0][0], grid[0][1], *grid[1]]
    for ax in grid[0][3:]:
        ax.set_axis_off()
    if n > 2:  # the linear probe beside the k-NN
        ax = grid[0][2]
        for i, (recipe, rows) in enumerate(found.items()):
            base = [r for r in rows if r["finished"] and _is_base(recipe, r) and r["linear"] is not None]
            ax.plot([r["lr"] for r in base], [r["linear"] for r in base], "s-", color=f"C{i}", label=recipe)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="optim.lr (per 256 images)", ylabel="final linear top-1", title="linear probe against the rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1]
    for i, (recipe, rows) in enumerate(found.items()):
        for r in rows:
            es = [e for e in sorted(r["curve"]) if e in r["Σlr"] and e > 0]
            ax.plot([r["Σlr"][e] for e in es], [r["curve"][e] for e in es], ".-", color=f"C{i}", alpha=0.5, lw=0.8,
                    label=recipe if r is rows[0] else None)
            if r["finished"] and es:
                ax.plot([r["Σlr"][es[-1]]], [r["curve"][es[-1]]], "o", color=f"C{i}")
    ax.set_xscale("log")
    ax.set(xlabel="Σ lr so far (per-iteration rates summed)", ylabel="k-NN top-1", title="k-NN against Σ lr")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[0]
    for i, (recipe, rows) in enumerate(found.items()):
        color = f"C{i}"
        done = [r for r in rows if r["finished"]]
        base = [r for r in done if _is_base(recipe, r)]
        ax.plot([r["lr"] for r in base], [r["k-NN"] for r in base], "o-", color=color, label=recipe)
        other = [r for r in done if not _is_base(recipe, r)]
        ax.plot([r["lr"] for r in other], [r["k-NN"] for r in other], "o", mfc="none", color=color)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="optim.lr (per 256 images)", ylabel="final k-NN top-1", title="k-NN against the rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for ax, (recipe, rows) in zip(axes[2:], found.items()):
        base = [r for r in rows if _is_base(recipe, r)]
        for j, r in enumerate(base):
            es = sorted(r["curve"])
            ax.plot(es, [r["curve"][e] for e in es], ".-", color=f"C{j}", label=f"lr {r['lr']:g}")
        ax.set(xlabel="epoch", ylabel="k-NN top-1", title=f"{recipe}: k-NN per epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _is_base(recipe: str, r: dict) -> bool:
    """A point of the recipe's rate grid: seed 0 and the recipe's own warm-up, batch and epochs."""
    keys = dict(k.split("=", 1) for k in RECIPES.get(recipe, {}).get("keys", []))
    return (r["seed"] == 0 and float(keys.get("optim.warmup_epochs", r["warm-up"])) == r["warm-up"]
            and int(keys.get("batch_size", 64)) == r["batch"] and int(keys.get("epochs", 8)) == r["epochs"])


# ---------------------------------------------------------------------------- the preset's budget

# The preset on one H100, compiled, checkpoints every 10 epochs (the GPU campaign's command),
# read off its 2026-11-26 log (issue 34; ../shared/bench-h100-2026-11-26/preset_log.jsonl): the
# first log line (iteration 50) at 87.6 s, which holds start-up, the k-NN at init and the
# compilation; 1100 iterations from 182.0 s to 268.7 s; 95.2 s from the k-NN of epoch 10 to
# that of epoch 20 (1170 iterations, one k-NN and one checkpoint).
H100_FIRST_LINE_S, H100_FIRST_LINE_IT = 87.6, 50
H100_S_PER_IT = (268.7 - 182.0) / 1100
H100_EVAL_S = 95.2 - 1170 * H100_S_PER_IT        # a periodic k-NN and a checkpoint
FINAL_S = 15.0  # the final k-NN (~3 s, as the periodic ones) and linear probe: not measured, an allowance
PRESET_IPE = 60000 // 512


def preset_seconds(epochs: int, eval_every: int = 10) -> float:
    """The preset's wall time on one H100 at the 2026-11-26 rates, compilation and the final
    k-NN and linear probe included: what the budget of one call (9 minutes) is checked against."""
    periodic = len([e for e in range(eval_every, epochs, eval_every)]) if eval_every else 0
    return (H100_FIRST_LINE_S + (epochs * PRESET_IPE - H100_FIRST_LINE_IT) * H100_S_PER_IT
            + periodic * H100_EVAL_S + FINAL_S)


def preset_report(lr: float, epochs: int, warmup: float, eval_every: int, budget_s: float = 540.0) -> str:
    from omegaconf import OmegaConf
    lines = [f"the preset on one H100 at the 2026-11-26 rates ({H100_S_PER_IT * 1000:.2f} ms per iteration of "
             f"{PRESET_IPE} per epoch, {H100_FIRST_LINE_S} s to iteration {H100_FIRST_LINE_IT}, {H100_EVAL_S:.2f} s "
             f"per periodic k-NN and checkpoint, {FINAL_S:g} s allowed for the final k-NN and linear probe), "
             f"eval_every={eval_every}:"]
    fits = [e for e in range(30, 61) if preset_seconds(e, eval_every) <= budget_s]
    for e in sorted({*range(40, 51), epochs}):
        t = preset_seconds(e, eval_every)
        lines.append(f"  {e} epochs: {t:.1f} s ({t / 60:.2f} min){'' if t <= budget_s else '  over ' + str(budget_s) + ' s'}")
    lines.append(f"the most epochs within {budget_s:g} s: {max(fits) if fits else None}")

    def sums(lr_, epochs_, warmup_):
        cfg = OmegaConf.create({"batch_size": 512, "epochs": epochs_, "optim": {"lr": lr_, "lr_batch": 256,
                                "min_lr": 1e-6, "warmup_epochs": warmup_}})
        return lr_sums(cfg, PRESET_IPE)
    now, new = sums(0.0005, 100, 10), sums(lr, epochs, warmup)
    at = int((now <= new[-1]).sum()) - 1
    lines.append(f"Σ lr of optim.lr={lr:g} epochs={epochs} optim.warmup_epochs={warmup:g}: {new[-1]:.3f}; the measured "
                 f"schedule (0.0005, 100 epochs, warm-up 10) has it after epoch {at} (its Σ lr at 10, 20, 100: "
                 f"{now[10]:.3f}, {now[20]:.3f}, {now[100]:.3f})")
    curve = h100_curve()
    if curve:
        fits = extrapolate(curve, epochs)
        lines.append(f"the measured k-NN at optim.lr=0.0005 ({H100_CURVE.relative_to(ROOT)}): " +
                     ", ".join(f"{k:.2f} at {e:g}" for e, k in sorted(curve.items())))
        lines.append(f"extrapolated to epoch {epochs} of that schedule, fitted on epochs >= {FIT_FROM}: " +
                     "; ".join(f"{name} {v:.2f} (asymptote {a:.2f})" for name, (v, a) in fits.items()))
    return "\n".join(lines)


H100_CURVE = ROOT / "docs" / "bench" / "h100-2026-11-23" / "preset_log.jsonl"
FIT_FROM = 8  # the warm-up's last epochs on: before them the rate is still rising


def h100_curve(path: Path = H100_CURVE) -> dict[float, float]:
    """The preset's k-NN per epoch on the H100 (2026-11-23, eval_every=2, 100-epoch schedule)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {float(r["epoch"]): r["knn_top1"] for r in rows if "knn_top1" in r}


def extrapolate(curve: dict[float, float], epoch: float) -> dict[str, tuple[float, float]]:
    """Two ways to carry a rising curve past its last point, fitted by least squares on the
    epochs from FIT_FROM: a - b exp(-t / tau) (saturates fast) and a - b t^-c (saturates slowly).
    Returns {name: (value at `epoch`, asymptote a)}; the truth is expected between them."""
    import numpy as np
    t = np.array([e for e in sorted(curve) if e >= FIT_FROM])
    y = np.array([curve[e] for e in t])
    out = {}
    for name, shape, grid in (("exponential", lambda t, p: np.exp(-t / p), np.linspace(1, 100, 3961)),
                              ("power law", lambda t, p: t ** -p, np.linspace(0.05, 5, 3961))):
        best = None
        for p in grid:  # a and b by linear least squares for each shape parameter
            X = np.stack([np.ones_like(t), -shape(t, p)], 1)
            (a, b), *_ = np.linalg.lstsq(X, y, rcond=None)
            err = float(((X @ np.array([a, b]) - y) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, a, b, p)
        _, a, b, p = best
        out[name] = (float(a - b * shape(np.array(float(epoch)), p)), float(a))
    return out


# ---------------------------------------------------------------------------- the command line

def _option(args: list[str], name: str, default):
    if name in args:
        i = args.index(name)
        if i + 1 >= len(args):
            refuse(f"{name} needs a value")
        value = args[i + 1]
        del args[i:i + 2]
        return value
    return default


def main(argv: list[str]) -> int:
    args = list(argv)
    out = Path(_option(args, "--out", OUT))
    if args[:1] == ["run"] and len(args) >= 2:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # stops the point's run as well (run_point)
        recipe = args[1]
        if recipe not in RECIPES:
            refuse(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        lrs = _option(args, "--lr", None)
        grid = [float(v) for v in lrs.split(",")] if lrs else RECIPES[recipe]["grid"]
        overrides = args[2:]
        bad = [o for o in overrides if "=" not in o or re.match(r"^(out|optim\.lr|eval_every)=", o)]
        if bad:
            refuse(f"{bad[0]!r}: give key=value overrides other than out=, optim.lr= (--lr) and eval_every=")
        failed = [lr for lr in grid if run_point(recipe, lr, overrides, out) != 0]
        if failed:
            print(f"failed: {', '.join(map(str, failed))} (their .log beside the run dir says why)")
        return 1 if failed else 0
    if args[:1] == ["table"]:
        found = points(out)
        if not found:
            refuse(f"no sweep points under {out}")
        print(markdown(found))
        path = Path(_option(args, "--figure", FIGURE))
        figure(found, path)
        print(f"figure: {path}")
        return 0
    if args[:1] == ["preset"]:
        print(preset_report(float(_option(args, "--lr", 0.0005)), int(_option(args, "--epochs", 45)),
                            float(_option(args, "--warmup", 10)), int(_option(args, "--eval-every", 10))))
        return 0
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
