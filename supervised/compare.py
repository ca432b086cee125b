"""Every training path on one dataset and budget, in one table: the paper's Table 3
"Training" block (supervised, distillation, DINO pre-training + evaluations).

    bash run.sh compare resmlp_s12 [data=cifar10] [compare.teacher=regnety_002] [out=...]

Paths, run in-process one after the other, each into its own run dir under the compare
dir (cfg.out, else runs/compare_<model>_<data>/):

    teacher/      the distillation teacher: compare.teacher names a timm model (a small
                  convnet, as DeiT's RegNetY), trained here with the supervised recipe;
                  or a run dir / checkpoint / timm:<name> to use as it is
    supervised/   the model from scratch                      -> top-1 / top-5 on the test split
    distill/      the model distilled from the teacher (hard) -> top-1 / top-5
    dino/         DINO pre-training                           -> k-NN top-1 (k=20, T=0.07)
    linear/       linear probe on dino/'s frozen teacher      -> top-1 / top-5
    finetune/     dino/'s teacher fine-tuned with labels      -> top-1 / top-5

A finished run is reused, not trained again: results.json present and its config.yaml
equal to the config this compare would give it (core.run_folder.settings_differences: run-time
keys such as num_workers or out aside). A finished run with other settings is refused as
the trainers refuse one, naming the first difference and a compare dir beside this one;
an unfinished one (checkpoint, no results.json) is resumed. The budgets (epochs per
path) are in configs/method/compare.yaml; on a machine without a GPU the compare runs
the short demo budgets (demo=auto) and says so.

Writes compare.md (the table), compare.json and compare.png into the compare dir.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from resmlp.core import dist
from resmlp.core.checkpoint import load_checkpoint
from resmlp.core.config import load_config, save_config, to_dict
from resmlp.core.errors import UserError
from resmlp.core.plain_config import read_config_yaml
from resmlp.core.report import write_figure, write_json, write_text
from resmlp.core.run import command
from resmlp.core.run_folder import (INPUT_KEYS, default_run_name, input_changed, other_run, record_inputs,
                                    settings_differences)
from resmlp.core.weights import ANY, WeightsSpec, names_timm
from resmlp.data.datasets import fit_demo_subset

# Training paths of the table, in the paper's order.
PATHS = ("supervised", "distill", "dino_knn", "dino_linear", "finetune")
# The paper's ImageNet-1k top-1 (Tables 1-3) for the same paths, as a reference column.
PAPER = {
    "resmlp_s12": {"supervised": 76.6, "distill": 77.8, "dino_knn": 62.6, "dino_linear": 67.5, "finetune": 76.5},
    "resmlp_s24": {"supervised": 79.4, "distill": 80.8, "dino_knn": 69.4, "dino_linear": 72.8, "finetune": 79.9},
}

@dataclass
class Step:
    key: str                      # teacher | supervised | distill | dino | linear | finetune
    command: str                  # the CLI command it runs
    model: str | None             # positional model (None: from base_dir's saved config)
    dir: Path
    overrides: list = field(default_factory=list)
    base_dir: Path | None = None  # run whose saved model/data this one starts from


# ---- the plan ----------------------------------------------------------------------------------

def compare_dir(cfg) -> Path:
    """out=, else runs/compare_<model>_<data>, with _from_<teacher> when compare.teacher names
    weights rather than a model trained here (core.run_folder.default_run_name)."""
    if cfg.out:
        return Path(cfg.out).expanduser()
    teacher = None if teacher_is_trained_here(cfg) else str(cfg.compare.teacher)
    return Path("runs") / (cfg.name or default_run_name(cfg, teacher))


def teacher_is_trained_here(cfg) -> bool:
    t = str(cfg.compare.teacher)
    return not (names_timm(t) or Path(t).expanduser().exists())


def plan(cfg) -> list[Step]:
    """The runs of this compare, in the order they must happen."""
    root, c = compare_dir(cfg), cfg.compare
    E = c.epochs
    steps = []
    teacher = str(c.teacher)
    if teacher_is_trained_here(cfg):
        import timm
        if not timm.is_model(teacher):
            raise UserError(f"compare.teacher={teacher!r} is neither a timm model to train as the teacher "
                            f"nor existing weights ({ANY})")
        steps.append(Step("teacher", "supervised", teacher, root / "teacher",
                          [f"epochs={E.teacher}", *c.extra.teacher]))
        teacher = str(root / "teacher")
    model = cfg.model.name
    steps += [
        Step("supervised", "supervised", model, root / "supervised", [f"epochs={E.supervised}", *c.extra.supervised]),
        Step("distill", "distill", model, root / "distill",
             [f"epochs={E.distill}", f"distill.teacher={teacher}", *c.extra.distill]),
        Step("dino", "dino", model, root / "dino", [f"epochs={E.dino}", *c.extra.dino]),
        Step("linear", "linear", None, root / "linear",
             [f"checkpoint={root / 'dino'}", f"linear.epochs={E.linear}", f"linear.mode={c.linear_mode}",
              *c.extra.linear], base_dir=root / "dino"),
        Step("finetune", "finetune", None, root / "finetune",
             [f"checkpoint={root / 'dino'}", f"epochs={E.finetune}", *c.extra.finetune], base_dir=root / "dino"),
    ]
    return steps


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def shared_overrides(cfg) -> list[str]:
    """What every path shares: images, model size, batch, seed, precision (+ compare.common)."""
    out = [f"demo={_value(bool(cfg.demo))}", f"seed={cfg.seed}", f"batch_size={cfg.batch_size}",
           f"num_workers={cfg.num_workers}", f"device={cfg.device}", f"precision={cfg.precision}",
           f"data.subset={_value(cfg.data.subset)}"]
    for k in ("dim", "depth"):
        if cfg.model.get(k) is not None:
            out.append(f"model.{k}={cfg.model[k]}")
    return [*out, *cfg.compare.common]


def sub_config(cfg, step: Step, planned: dict | None = None):
    """The config of one path, as `bash run.sh <command> ...` would build it. A path that
    starts from another's run takes that run's saved config, or before it exists `planned`
    (the config that run will save)."""
    if step.base_dir is not None and (step.base_dir / "config.yaml").exists():
        from resmlp.core.checkpoint import saved_config
        base = saved_config(str(step.base_dir))
    elif step.base_dir is not None and planned is not None:
        base = planned
    else:
        base = {"data": to_dict(cfg.data)}
    overrides = [*shared_overrides(cfg), *step.overrides, f"out={step.dir}"]
    return load_config(step.command, step.model, overrides, base=base)


def finished(step: Step, sub_cfg) -> dict | None:
    """The results of a finished run of exactly this config, or None if there is none yet."""
    res_file, cfg_file = step.dir / "results.json", step.dir / "config.yaml"
    if not res_file.exists():
        return None
    if not cfg_file.exists():
        raise UserError(f"{step.dir} has results.json but no config.yaml; delete it or use out=<another dir>")
    saved = read_config_yaml(cfg_file)
    diffs = settings_differences(saved, to_dict(sub_cfg))
    if diffs:
        more = f" and {len(diffs) - 1} more" if len(diffs) > 1 else ""
        raise UserError(other_run(step.dir.parent, f"a finished {step.key} run ({step.dir.name}/) with other settings "
                                                   f"({diffs[0]}{more})"))
    changed = input_changed(step.dir, sub_cfg, weights_key(step))
    if changed:
        raise UserError(other_run(step.dir.parent, f"a finished {step.key} run ({step.dir.name}/) from {changed[1]}"))
    return json.loads(res_file.read_text())


def weights_key(step: Step) -> str:
    """The key naming the weights a path starts from: a trainer's INPUT_KEYS entry, or the
    linear probe's checkpoint= (a command that names none: a key it leaves null)."""
    return INPUT_KEYS.get(step.command, "checkpoint")


# ---- running the paths ---------------------------------------------------------------------

def run_step(step: Step, sub_cfg) -> dict:
    """Train (or probe) one path in this process and return its results."""
    if step.command in ("supervised", "distill", "finetune"):
        from resmlp.supervised import train as sup_train
        return sup_train.train(sub_cfg)[2]
    if step.command == "dino":
        from resmlp.ssl import train as ssl_train
        return ssl_train.train(sub_cfg)[3]
    if step.command == "linear":
        from resmlp.core.run import device_name
        from resmlp.eval import linear as eval_linear
        t0 = time.time()
        eval_linear.run(sub_cfg)
        lin = json.loads((step.dir / "linear.json").read_text()) if dist.is_main() else {}
        # what the protocol chose: lbfgs an L2 and no epochs (it fits to its optimum), dino an lr
        chose = ({"l2": lin.get("l2")} if lin.get("protocol") == "lbfgs"
                 else {"epochs": sub_cfg.linear.epochs, "lr": lin.get("lr")})
        results = {"command": "linear", "protocol": lin.get("protocol"), "mode": sub_cfg.linear.mode, **chose,
                   "top1": lin.get("top1"), "top5": lin.get("top5"),
                   "wall_time_s": round(time.time() - t0, 1), "device": device_name(dist.pick_device(sub_cfg.device))}
        if dist.is_main():
            save_config(sub_cfg, step.dir / "config.yaml")
            record_inputs(step.dir, sub_cfg, weights_key(step))
            write_json(step.dir / "results.json", results)
        dist.barrier()
        return results
    raise AssertionError(step.command)


def check_all(cfg, steps: list[Step]) -> None:
    """Every path's config, and its finished run if there is one, checked before the first
    path trains: a bad key for the fifth path fails now, not after four trainings."""
    if not teacher_is_trained_here(cfg) and not names_timm(str(cfg.compare.teacher)):
        load_checkpoint(WeightsSpec.parse(str(cfg.compare.teacher)).file)  # a file refused as not weights only, now
    made: dict[Path, dict] = {}
    for step in steps:
        try:
            sub = sub_config(cfg, step, made.get(step.base_dir))
            if step.command == "dino":
                from resmlp.data.crop_plan import crop_plan
                crop_plan(sub)  # the crop sizes against the model, as the trainer checks them first
        except UserError as e:
            raise UserError(f"the {step.key} path (`{step.command}`, compare.extra.{step.key}): {e}") from None
        made[step.dir] = to_dict(sub)
        finished(step, sub)


def collect(cfg, log=print) -> dict[str, dict]:
    """Results per step key, training what is not finished yet."""
    out = {}
    steps = plan(cfg)
    check_all(cfg, steps)
    for step in steps:
        sub = sub_config(cfg, step)
        res = finished(step, sub)
        if res is not None:
            log(f"compare: {step.key}: reusing the finished run {step.dir}")
        else:
            log(f"compare: {step.key}: training -> {step.dir}")
            res = run_step(step, sub)
        out[step.key] = res
    return out


# ---- the table --------------------------------------------------------------------------------

def _minutes(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def rows(cfg, res: dict[str, dict]) -> list[dict]:
    """One row per training path (the paper's order)."""
    sup, dis, dino, lin, ft = (res[k] for k in ("supervised", "distill", "dino", "linear", "finetune"))
    t = res.get("teacher")
    teacher_name = (t or {}).get("model") or dis.get("teacher", {}).get("model") or str(cfg.compare.teacher)
    teacher_top1 = (t or {}).get("top1", dis.get("teacher", {}).get("top1"))
    teacher_txt = f"{teacher_name}" + (f", {teacher_top1:.1f}% top-1" if teacher_top1 is not None else "")
    dino_wall = dino.get("wall_time_s")

    def add(a, b):
        return None if a is None or b is None else a + b

    paper = PAPER.get(cfg.model.name, {})
    table = [
        dict(path="supervised", label="supervised, from scratch", params=sup.get("params"),
             epochs=f"{sup.get('epochs')}", top1=sup.get("top1"), top5=sup.get("top5"),
             wall_s=sup.get("wall_time_s"), note="", device=sup.get("device")),
        dict(path="distill", label=f"distillation ({dis.get('distill_type', 'hard')}, teacher {teacher_txt})",
             params=dis.get("params"), epochs=f"{dis.get('epochs')}", top1=dis.get("top1"), top5=dis.get("top5"),
             wall_s=add(dis.get("wall_time_s"), (t or {}).get("wall_time_s", 0)),
             note=f"incl. {_minutes(t['wall_time_s'])} teacher training" if t else "", device=dis.get("device")),
        dict(path="dino_knn", label=f"pre-trained SSL (DINO) + k-NN (k={dino.get('knn_k', 20)}, "
                                    f"T={dino.get('knn_T', 0.07)})", params=dino.get("params"),
             epochs=f"{dino.get('epochs')}", top1=dino.get("knn_top1"), top5=dino.get("knn_top5"),
             wall_s=dino_wall, note="", device=dino.get("device")),
        dict(path="dino_linear", **probe_cells(dino, lin), params=dino.get("params"), top1=lin.get("top1"),
             top5=lin.get("top5"), wall_s=add(dino_wall, lin.get("wall_time_s")), note="incl. DINO",
             device=lin.get("device")),
        dict(path="finetune", label="pre-trained SSL (DINO) + fine-tuning", params=ft.get("params"),
             epochs=f"{dino.get('epochs')} + {ft.get('epochs')}", top1=ft.get("top1"), top5=ft.get("top5"),
             wall_s=add(dino_wall, ft.get("wall_time_s")), note="incl. DINO", device=ft.get("device")),
    ]
    for r in table:
        r["paper_top1"] = paper.get(r["path"])
    return table


def probe_cells(dino: dict, lin: dict) -> dict:
    """The linear path's label and epochs, saying what ran, from its results: lbfgs on
    cached features names the L2 it chose (on held-out training images) and has no epochs
    of its own (it fits to its optimum); DINO's protocol has its epochs after DINO's. A
    run from before linear.protocol ran DINO's."""
    if lin.get("protocol") == "lbfgs":
        l2 = lin.get("l2")
        return {"label": f"pre-trained SSL (DINO) + linear probe (lbfgs on {lin.get('mode')} features"
                         + ("" if l2 is None else f", L2 {l2:g}") + ")", "epochs": f"{dino.get('epochs')}"}
    return {"label": f"pre-trained SSL (DINO) + linear probe (DINO's protocol, {lin.get('mode')})",
            "epochs": f"{dino.get('epochs')} + {lin.get('epochs')}"}


def _pct(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(cfg, table: list[dict], root: Path) -> str:
    paper_col = f"paper, ImageNet ({cfg.model.name})"
    sub = OmegaConf.select(cfg, "data.subset")
    lines = [f"# Training paths: {cfg.model.name} on {cfg.data.name}", ""]
    if cfg.demo:
        lines += ["**CPU demo**: short budgets on a small model and a subset of the images, to show the "
                  "pipeline end to end. The numbers are not comparable to the paper's; run on a GPU "
                  "(demo=false) for the real budgets.", ""]
    lines += [f"Data: {cfg.data.name}" + (f" ({sub} training images)" if sub else "") + ", top-1 / top-5 on its "
              f"test split. Model: {cfg.model.name}"
              + (f" (dim {cfg.model.dim}, depth {cfg.model.depth})" if cfg.model.get("dim") else "")
              + f". Runs: {root}/<path>.", "",
              f"| Training path | Params (M) | Epochs | Top-1 | Top-5 | Wall time | Hardware | {paper_col} |",
              "|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in table:
        params = "-" if r["params"] is None else f"{r['params'] / 1e6:.2f}"
        wall = _minutes(r["wall_s"]) + (f" ({r['note']})" if r["note"] else "")
        paper = "-" if r["paper_top1"] is None else f"{r['paper_top1']:.1f}"
        lines.append(f"| {r['label']} | {params} | {r['epochs']} | {_pct(r['top1'])} | {_pct(r['top5'])} | "
                     f"{wall} | {r['device'] or '-'} | {paper} |")
    lines += ["", "Epochs `a + b`: DINO pre-training epochs + probe / fine-tuning epochs (the lbfgs linear probe "
              "has none: it fits to its optimum, the L2 in its label chosen on held-out training images); "
              "wall times include "
              "the runs a path depends on. The paper's column is ImageNet-1k val top-1 (400 epochs supervised "
              "and distilled, 300 DINO epochs; Tables 2-3), for the shape of the comparison only.", ""]
    return "\n".join(lines)


def plot(cfg, table: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = ["supervised", "distilled", "DINO + k-NN", "DINO + linear", "DINO + fine-tune"]
    top1 = [r["top1"] or 0.0 for r in table]
    top5 = [r["top5"] or 0.0 for r in table]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(table))
    ax.bar([i - 0.2 for i in x], top1, width=0.4, label="top-1")
    ax.bar([i + 0.2 for i in x], top5, width=0.4, label="top-5", alpha=0.5)
    for i, v in enumerate(top1):
        ax.text(i - 0.2, v + 0.5, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(f"{cfg.data.name} test accuracy (%)")
    ax.set_ylim(0, 118)
    ax.set_title(f"{cfg.model.name} on {cfg.data.name}" + (" (CPU demo budgets)" if cfg.demo else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    write_figure(fig, path, dpi=120)
    plt.close(fig)


def write_report(cfg, res: dict[str, dict]) -> Path:
    root = compare_dir(cfg)
    root.mkdir(parents=True, exist_ok=True)
    table = rows(cfg, res)
    md = markdown(cfg, table, root)
    write_text(root / "compare.md", md)
    write_text(root / "compare.json", json.dumps(
        {"model": cfg.model.name, "data": cfg.data.name, "demo": bool(cfg.demo),
         "budget": {"epochs": to_dict(cfg.compare.epochs), "linear_mode": cfg.compare.linear_mode,
                    "batch_size": cfg.batch_size, "data_subset": cfg.data.subset, "common": list(cfg.compare.common)},
         "rows": table, "runs": {k: v for k, v in res.items()}}, indent=2, default=str))
    plot(cfg, table, root / "compare.png")
    return root


def compare(cfg) -> None:
    fitted = fit_demo_subset(cfg)  # before the paths' configs are made: each gets the same images
    if fitted and dist.is_main():
        print(f"compare: {fitted}", flush=True)
    if cfg.demo and dist.is_main():
        e = cfg.compare.epochs
        print(f"CPU demo: every path at a short budget (supervised {e.supervised}, distill {e.distill}, DINO "
              f"{e.dino} (+ linear {e.linear}, fine-tune {e.finetune}) epochs, teacher {e.teacher}) on a small "
              f"{cfg.model.name} (dim {cfg.model.dim}, depth {cfg.model.depth}) and {cfg.data.subset or 'all'} images. "
              "On a GPU the compare runs the budgets of configs/method/compare.yaml; demo=false forces them.",
              flush=True)
    res = collect(cfg, log=lambda m: dist.is_main() and print(m, flush=True))
    if dist.is_main():
        root = write_report(cfg, res)
        print((root / "compare.md").read_text(), flush=True)
        print(f"compare: wrote {root}/compare.md, compare.json, compare.png", flush=True)
    dist.barrier()


# The CLI's entry, as the trainers': a stop signal ends the path in training with a checkpoint,
# and the same command again resumes it (finished paths are reused).
run = command(compare)
