"""The DINO trainer's judge: the teacher's k-NN (and linear probe) on a labeled set, run at
the trainer's sync points (ssl/train.py), which calls it the same way whether or not the
run has labels.

`build_judge(cfg)` resolves `eval.data` before any work (`eval_data`: the set eval.data,
eval.root and eval.subset name, else the training set when it has labels) and returns

- `Judge`: the k-NN (DINO's protocol, knn.k at knn.temperature) of the teacher's backbone at
  init (for the demo, with eval_every or from dino.init), every `eval_every` epochs, after the
  head warm-up of a run continued from weights, and at the end with the few-label banks
  (knn.few_labels) and the linear probe (dino.final_linear: the linear command's default
  protocol, configs/method/linear.yaml's); the demo's raw-pixel k-NN on the
  same bank, the bar the features must clear;
- `HealthOnly`: a run with no labeled set. It reports no accuracy and says so at the start
  and in results.json; the loss, the teacher's entropy and KL and the collapse watch still
  tell the run's health.

The calls, in the trainer's order:
    judge = build_judge(cfg)          # eval.* checked first
    judge.check(dataset)              # the k-NN's k fits its bank, before any work
    judge.warn(run)                   # what its accuracy cannot say, once at the start
    judge.begin(run, cadence, teacher.backbone, results, start, start_it)   # the k-NN at init
    judge.after_epoch(epoch, it)      # <- sync point: every eval_every epochs, the warm-up's end
    judge.end(it)                     # the final k-NN; the note again
    judge.summary()                   # results.json's fields of the evaluation
Every evaluation runs inside the cadence's `evaluating()` (timed apart from training); all
ranks call each method (extraction is sharded, the search runs on rank 0, dist.broadcast).
"""
from __future__ import annotations

import os
import time

import torch
from omegaconf import OmegaConf

from resmlp.core import dist
from resmlp.core.config import as_list
from resmlp.core.errors import UserError
from resmlp.data import build_dataset, num_classes, train_split_for_ssl
from resmlp.data import fashion_mnist, imagefolder
from resmlp.data.datasets import DATASETS, LABELED, dataset_info, one_class_problem
from resmlp.eval.knn_search import check_ks
from resmlp.eval.memory import pixel_baseline


def eval_data(cfg):
    """The labeled set the DINO trainer's k-NN and linear probe read: `eval.data` (with
    `eval.root`, `eval.subset`) when named, else the training set when it has labels, else
    None (no accuracy can be had). A named set is read at the training image size with the
    training normalization (what the network was trained on); its own file says the rest
    (crop ratio, where its files are found)."""
    from resmlp.core.config import CONFIG_DIR
    judge = cfg.eval
    name = judge.data
    if name is None:
        if judge.root is not None or judge.subset is not None:
            raise UserError(f"eval.root / eval.subset are set but eval.data is not; name the labeled set too: "
                            f"eval.data=<{'|'.join(LABELED)}>")
        return cfg.data if dataset_info(cfg.data).labeled else None
    own = OmegaConf.load(CONFIG_DIR / "data" / f"{name}.yaml").data
    root = judge.root
    if root is None and DATASETS[name].build is imagefolder.build:
        raise UserError(f"eval.data={name} needs eval.root=DIR, the folder with train/<class>/ and val/<class>/")
    if root is not None and not os.path.isdir(os.path.expanduser(str(root))):
        raise UserError(f"eval.root={root} is {'a file' if os.path.exists(os.path.expanduser(str(root))) else 'not there'}"
                        f"; give the folder that holds eval.data={name}'s files")
    base = OmegaConf.load(CONFIG_DIR / "defaults.yaml").data
    labeled = OmegaConf.merge(base, own, {
        "name": name, "root": judge.root, "subset": judge.subset,
        "img_size": cfg.data.img_size, "mean": cfg.data.mean, "std": cfg.data.std,
        "download": cfg.data.download, "skip_corrupt": cfg.data.skip_corrupt})
    # its folder's layout now, in errors that name eval.root (the set is read as data.root later)
    if DATASETS[name].build is imagefolder.build:
        imagefolder.check_layout(labeled, "eval.root")
    elif DATASETS[name].build is fashion_mnist.build and root is not None:
        fashion_mnist.locate(labeled, "eval.root")
    return labeled


def no_labels_note(cfg) -> str:
    """What a DINO run on images without labels says once at its start and in results.json."""
    return (f"data={cfg.data.name} has no labels and no labeled set was named: this run reports its health "
            f"(loss, teacher entropy, KL, the collapse watch) but no k-NN or linear accuracy; name one with "
            f"eval.data=<{'|'.join(LABELED)}> eval.root=DIR")


def knn_report(run, teacher_backbone, cfg, tag: str, linear: bool = False, cache: dict | None = None,
               picture_step: int | None = None, few_labels: bool = False) -> dict:
    """k-NN (knn.k, DINO's protocol) and optionally a linear probe of the teacher's features;
    with picture_step (and dino.tensorboard_neighbours) the neighbours grid goes to TensorBoard;
    with few_labels (and knn.few_labels) the k-NN on knn.tries banks of n images per class too.
    cache: the run's dict of eval images kept between calls (eval.knn.online_knn). The images
    are eval_data's: the training set, or the labeled set eval.data names."""
    from resmlp.eval.few_labels import sizes
    from resmlp.eval.knn import online_knn
    temp = float(cfg.knn.temperature)
    picture = picture_step is not None and bool(cfg.dino.tensorboard_neighbours)
    data = eval_data(cfg)
    few = few_labels and bool(sizes(cfg.knn.few_labels))
    res = online_knn(teacher_backbone, data, run.device, ks=as_list(cfg.knn.k), temperature=temp,
                     batch_size=cfg.features.batch_size, num_workers=cfg.num_workers,
                     backend=cfg.knn.backend, amp_dtype=run.amp_dtype or torch.float32,
                     keep_features=linear or picture or few, cache=cache, memory_gb=cfg.features.memory_gb)
    k = res["knn_k"]
    out = {"knn_top1": res["knn_top1"], "knn_top5": res["knn_top5"], "knn_k": k, "knn_T": temp}
    run.print(f"[{tag}] knn top1={out['knn_top1']:.2f} top5={out['knn_top5']:.2f} (k={k}, T={temp:g})")
    if picture and run.is_main:
        from resmlp.eval.neighbours import online_grid
        run.log_image("knn_neighbours", online_grid(res, data, f"teacher, {tag}: k-NN top-1 "
                                                    f"{out['knn_top1']:.2f}", seed=int(cfg.seed),
                                                    backend=cfg.knn.backend), picture_step)
    if few:
        out["knn_few_labels"] = dist.broadcast_object(few_labels_report(run, res, cfg, tag) if run.is_main else None)
    if linear:
        lin = {}
        if run.is_main:
            from resmlp.eval.linear import chosen, default_probe, probe_cached
            (trf, trl), (tef, tel) = res["features"]["train"], res["features"]["test"]
            lin = probe_cached(trf, trl, tef, tel, num_classes(data), default_probe(), int(cfg.seed), run.device,
                               cfg.features.memory_gb)
            run.print(f"[{tag}] linear top1={lin['top1']:.2f} top5={lin['top5']:.2f} "
                      f"(cached features, {chosen(lin)})")
        lin = dist.broadcast_object(lin)
        out.update(linear_top1=lin["top1"], linear_top5=lin["top5"], linear_protocol=lin["protocol"],
                   **({"linear_l2": lin["l2"], "linear_holdout": lin["holdout"]} if lin["protocol"] == "lbfgs"
                      else {"linear_lr": lin["lr"]}))
    return out


def few_labels_report(run, res: dict, cfg, tag: str) -> dict:
    """knn_report's few-label k-NN (rank 0) on the features online_knn kept: printed as a
    table, returned for results.json."""
    from resmlp.eval.knn import format_few_labels, knn_few_labels
    (trf, trl), (tef, tel) = res["features"]["train"], res["features"]["test"]
    few = knn_few_labels(trf, trl, tef, tel, res["num_classes"], as_list(cfg.knn.k), float(cfg.knn.temperature),
                         cfg.knn.few_labels, int(cfg.knn.tries), int(cfg.seed), cfg.knn.backend, device=run.device,
                         class_names=getattr(res["datasets"]["train"], "classes", None))
    run.print(f"[{tag}] " + format_few_labels(few, res["knn"], res["n_train"]))
    return few


# --------------------------------------------------------------------------- the judges

class HealthOnly:
    """The judge of a run with no labeled set: it evaluates nothing, and its note says so
    at the start and the end (results.json's `warning`, `"eval_data": null`). `Judge`
    evaluates at the same calls."""
    data = None

    def __init__(self, cfg):
        self.cfg, self.note = cfg, no_labels_note(cfg)

    def check(self, dataset) -> None:
        """Before any work: what the evaluation needs of the training set (`dataset`)."""

    def warn(self, run) -> None:
        if self.note:
            run.print(f"warning: {self.note}")

    def describe(self) -> str:
        """What the run's first line says of the set it is judged on, after the data set's name."""
        return ""

    def begin(self, run, cadence, backbone, results: dict, start, start_it: int) -> None:
        """Right before the loop: the run, its cadence, the network to judge (the teacher's
        backbone), the run's results (restored), where it started (ssl.init.Start or None)
        and the iteration it continues from."""
        self.run, self.cadence, self.backbone, self.results = run, cadence, backbone, results

    def after_epoch(self, epoch: int, it: int) -> None:
        """After `epoch` (1-based) ended at iteration `it`."""

    def end(self, it: int) -> None:
        self.close({}, None)

    def close(self, final: dict, data_name: str | None) -> None:
        """results' `final` and `eval_data` (the judging set's name); the note said again, and kept."""
        self.results["final"], self.results["eval_data"] = final, data_name
        if self.note:
            self.results["warning"] = self.note
            self.run.print(f"warning: {self.note}")

    def summary(self) -> dict:
        """Print the k-NN from init to the end (and raw pixels' beside it); results.json's
        fields of the evaluation."""
        run, cfg, results = self.run, self.cfg, self.results
        init, final = results.get("init"), results["final"]
        if init and final and run.is_main:
            side = results.get("pixels", {}).get("side", cfg.data.img_size)
            pixels = (f"; raw pixels on the same bank: {results['pixels']['knn_top1']:.2f}"
                      + (f" (at {side} px)" if side != cfg.data.img_size else "") if "pixels" in results else "")
            warm = results.get("after_warmup")
            warm = f"{warm['knn_top1']:.2f} after the head warm-up -> " if warm else ""
            run.print(f"k-NN top-1: {init['knn_top1']:.2f} at init -> {warm}{final['knn_top1']:.2f} after "
                      f"{cfg.epochs} epochs ({final['knn_top1'] - init['knn_top1']:+.2f}){pixels}")
        if final and run.is_main:
            print(f"knn top1={final['knn_top1']:.2f} top5={final['knn_top5']:.2f} "
                  f"(k={final['knn_k']}, T={float(cfg.knn.temperature):g})")
        return {**{f"after_warmup_{k}": v for k, v in results.get("after_warmup", {}).items()},
                **{f"init_{k}": v for k, v in results.get("init", {}).items()},
                **{f"pixels_{k}": v for k, v in results.get("pixels", {}).items()}, **final,
                "eval_data": results.get("eval_data"),
                **({"warning": results["warning"]} if "warning" in results else {})}


class Judge(HealthOnly):
    """The k-NN of the teacher on `data`, the labeled set eval_data resolved (see the module
    docstring for when). The eval images are loaded and transformed once for every k-NN of
    the run (online_knn's cache)."""

    def __init__(self, cfg, data):
        self.cfg, self.data, self.note = cfg, data, None
        self.images: dict = {}
        self.warmup_epoch = None

    def check(self, dataset) -> None:
        # the k-NN's bank is the train split of the labeled set: its k must fit before any work
        cfg, data = self.cfg, self.data
        same = data is cfg.data and train_split_for_ssl(cfg.data) == "train"
        check_ks(cfg.knn.k, len(dataset) if same else len(build_dataset(data, "train")))
        # DINO needs no labels, so one class is a valid training set; only its k-NN says nothing
        self.note = one_class_problem(data, "the teacher's k-NN (and linear) accuracy")

    def describe(self) -> str:
        return "" if self.data is self.cfg.data else f", judged on {self.data.name} ({self.data.root or 'found'})"

    def begin(self, run, cadence, backbone, results: dict, start, start_it: int) -> None:
        """The k-NN at init (the demo, eval_every or dino.init ask for it; a resumed run has
        it), and the demo's raw-pixel k-NN."""
        super().begin(run, cadence, backbone, results, start, start_it)
        cfg = self.cfg
        self.warmup_epoch = start.warmup_epochs if start is not None else None
        with cadence.evaluating():
            if not start_it and (cfg.demo or cfg.eval_every or start is not None):
                results["init"] = knn_report(run, backbone, cfg, "teacher at init", cache=self.images,
                                             picture_step=0 if cfg.eval_every else None)
                run.log({"epoch": 0, **results["init"]}, step=0)  # the k-NN curve in log.jsonl starts here
            if cfg.demo and "pixels" not in results:  # the bar features must clear: the same k-NN on raw pixels
                pixels = pixel_baseline(self.data, cfg.data.img_size, cfg.features.memory_gb, run.device)  # sized to the memory
                if pixels.line:
                    run.print(pixels.line)
                if pixels.side is not None:
                    results["pixels"] = {**knn_report(run, pixels.model(), cfg, "raw pixels", cache=self.images),
                                         "side": pixels.side}

    def after_epoch(self, epoch: int, it: int) -> None:
        """The k-NN every eval_every epochs, and where the head warm-up ends (results'
        `after_warmup`)."""
        warmed = epoch == self.warmup_epoch
        if not (self.cadence.eval_due(epoch) or warmed):
            return
        run = self.run
        with self.cadence.evaluating():
            res = knn_report(run, self.backbone, self.cfg, f"epoch {epoch}", cache=self.images, picture_step=it)
        run.log({"epoch": epoch, **res, "elapsed_s": round(time.time() - run.started, 1)}, step=it)
        if warmed:
            self.results["after_warmup"] = res

    def end(self, it: int) -> None:
        """The final k-NN of the teacher on the test split, with the few-label banks and the
        linear probe (dino.final_linear)."""
        cfg = self.cfg
        with self.cadence.evaluating(final=True):
            final = knn_report(self.run, self.backbone, cfg, "teacher after training", linear=cfg.dino.final_linear,
                               cache=self.images, picture_step=it if cfg.eval_every else None, few_labels=True)
        self.run.log({"epoch": cfg.epochs, **final}, step=it)
        self.close(final, self.data.name)


def build_judge(cfg) -> HealthOnly:
    """The run's judge: a Judge on eval_data's labeled set, or HealthOnly where there is none.
    Call it first: a bad eval.* is one line before any work."""
    data = eval_data(cfg)
    return HealthOnly(cfg) if data is None else Judge(cfg, data)
