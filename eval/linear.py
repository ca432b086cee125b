"""The linear probe on a frozen backbone: two protocols, two ways to read the images.

The backbone stays frozen in eval mode; one linear layer reads its pooled features
(or, with linear.n_last_blocks = n, the concatenated pooled features of the last n
blocks, as DINO does with the last n class tokens).

linear.protocol (docs/evaluation.md says which number to quote when):
- lbfgs (the default on cached features, eval/logreg.py): multinomial logistic
  regression at its optimum, full-batch L-BFGS over a grid of L2 strengths; the L2
  chosen on a held-out part of the training split (linear.holdout, seeded), refitted on
  the whole training split, the test split scored once.
- dino: DINO's eval_linear.py. Init N(0, 0.01), bias 0; SGD with momentum 0.9, weight
  decay 0, cosine schedule stepped per epoch to 0, linear.epochs epochs, one head per
  learning rate; the reported result is the best test top-1 over the learning rates.
  DINO too reports the best accuracy measured on its validation set, which is the test
  set here (ImageNet val): optimistic, but the number published results are.

linear.mode:
- cached (default): the cached eval-transform features (the files k-NN uses, see
  features.py). Under dino, the heads of every learning rate are trained side by side in
  one pass (a batched (L, D, C) weight: every head sees the same batches, in the same
  order, from the same init).
- augmented: DINO's protocol proper, always under dino (the features change every step,
  so there is no fixed problem for L-BFGS to solve): RandomResizedCrop + flip on the train
  split (resmlp.data.build_linear_train_transform), the backbone run under no_grad on
  every batch, lr 0.001 x batch/256 unless linear.lrs says otherwise.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from resmlp.core import dist
from resmlp.core.errors import UserError
from resmlp.data.datasets import require_classes
from resmlp.eval import few_labels
from resmlp.eval.knn import topk_correct

CACHED_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # base lrs (batch 256)
DINO_LR = 1e-3                                                    # eval_linear.py default


class LinearHeads:
    """L linear classifiers D -> C trained side by side, one learning rate each.

    The cross-entropy gradient is written out ((softmax - onehot) / batch) instead of
    going through autograd: the heads are independent, so one batched matmul per step
    serves all of them. SGD momentum follows torch.optim.SGD (buf = m * buf + grad + wd * w).
    """

    def __init__(self, dim: int, num_classes: int, lrs: Sequence[float], device, seed: int = 0,
                 momentum: float = 0.9, weight_decay: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(dim, num_classes, generator=g) * 0.01        # N(0, 0.01), shared init
        self.w = w.expand(len(lrs), dim, num_classes).clone().to(device)
        self.b = torch.zeros(len(lrs), num_classes, device=device)
        self.buf_w = torch.zeros_like(self.w)
        self.buf_b = torch.zeros_like(self.b)
        self.lrs = torch.tensor(list(lrs), dtype=torch.float32, device=device)
        self.momentum, self.weight_decay = momentum, weight_decay
        self.num_classes = num_classes

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(L, B, C) logits of every head."""
        return torch.baddbmm(self.b.unsqueeze(1), x.unsqueeze(0).expand(self.w.shape[0], -1, -1), self.w)

    def grads(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.softmax(self.logits(x), dim=-1)
        p[:, torch.arange(y.shape[0], device=y.device), y] -= 1.0
        p /= y.shape[0]
        return torch.einsum("bd,lbc->ldc", x, p), p.sum(1)

    def step(self, gw: torch.Tensor, gb: torch.Tensor, lr_scale: float) -> None:
        if self.weight_decay:
            gw = gw + self.weight_decay * self.w
            gb = gb + self.weight_decay * self.b
        self.buf_w.mul_(self.momentum).add_(gw)
        self.buf_b.mul_(self.momentum).add_(gb)
        lr = self.lrs * lr_scale
        self.w.sub_(lr.view(-1, 1, 1) * self.buf_w)
        self.b.sub_(lr.view(-1, 1) * self.buf_b)

    def finite(self) -> torch.Tensor:
        """(L,) bool: heads whose weights did not blow up."""
        return torch.isfinite(self.w).flatten(1).all(1) & torch.isfinite(self.b).all(1)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> list[dict]:
        """[{'top1': %, 'top5': %}] per head on (x, y); a diverged head scores 0."""
        scores = [[] for _ in range(self.w.shape[0])]
        for s in range(0, x.shape[0], chunk):
            lo = self.logits(x[s:s + chunk].to(self.w.device)).float().cpu()
            for i in range(lo.shape[0]):
                scores[i].append(lo[i])
        ok = self.finite().cpu()
        out = []
        for i, parts in enumerate(scores):
            if not ok[i]:
                out.append({"top1": 0.0, "top5": 0.0, "diverged": True})
                continue
            out.append({**topk_correct(torch.cat(parts), y.cpu()), "diverged": False})
        return out


def cosine_factor(epoch: int, epochs: int) -> float:
    """CosineAnnealingLR(T_max=epochs, eta_min=0) at the start of `epoch` (per-epoch steps)."""
    return 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


def positive_numbers(value, key: str, example: str) -> tuple[float, ...]:
    """A key's list of positive finite numbers (linear.lrs, linear.l2), or one line."""
    from resmlp.core.config import as_list
    try:
        out = tuple(float(v) for v in as_list(value))
    except (TypeError, ValueError):
        raise UserError(f"{key}={value!r} must be numbers, e.g. {key}={example}") from None
    if not out or any(not (v > 0 and math.isfinite(v)) for v in out):
        raise UserError(f"{key}={value!r} must be positive numbers, e.g. {key}={example}")
    return out


def check_lrs(lrs) -> list[float]:
    return list(positive_numbers(lrs, "linear.lrs", "[0.001,0.01]"))


def _check_common(epochs, batch_size) -> tuple[int, int]:
    if int(epochs) != epochs or int(epochs) < 1:
        raise UserError(f"linear.epochs={epochs} must be a positive integer")
    if int(batch_size) != batch_size or int(batch_size) < 1:
        raise UserError(f"linear.batch_size={batch_size} must be a positive integer")
    return int(epochs), int(batch_size)


def _report(per_head: list[dict], base_lrs: Sequence[float], scale: float, epochs: int,
            batch_size: int, mode: str) -> dict:
    per_lr = [{"lr": lr, "lr_effective": lr * scale, **r} for lr, r in zip(base_lrs, per_head)]
    # best test top-1; ties -> the smaller lr (listed first after sorting)
    best = max(sorted(per_lr, key=lambda r: r["lr"]), key=lambda r: r["top1"])
    return {"protocol": "dino", "mode": mode, "epochs": epochs, "batch_size": batch_size,
            "top1": best["top1"], "top5": best["top5"], "lr": best["lr"],
            "lr_effective": best["lr_effective"], "per_lr": per_lr,
            "selection": "best test top-1 over lrs (DINO also selects on val = the test split)"}


def as_features(train_features, train_labels, test_features, test_labels, num_classes: int):
    """(train x, train y, test x, test y) as float32 / int64 tensors where they are,
    checked: (n, dim) of one dim, not empty, labels in 0..num_classes - 1."""
    import numpy as np

    def t(x, dtype):
        x = torch.from_numpy(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
        return x.detach().to(dtype=dtype)

    xtr, ytr = t(train_features, torch.float32), t(train_labels, torch.int64).reshape(-1)
    xte, yte = t(test_features, torch.float32), t(test_labels, torch.int64).reshape(-1)
    if xtr.ndim != 2 or xte.ndim != 2 or xtr.shape[1] != xte.shape[1]:
        raise UserError(f"features must be (n, dim) with the same dim, got {tuple(xtr.shape)} and {tuple(xte.shape)}")
    if xtr.shape[0] == 0 or xte.shape[0] == 0:
        raise UserError("empty train or test features: the split has no images")
    if xtr.shape[0] != ytr.shape[0] or xte.shape[0] != yte.shape[0]:
        raise UserError("features and labels differ in length")
    for y, what in ((ytr, "train"), (yte, "test")):
        if int(y.min()) < 0 or int(y.max()) >= num_classes:
            raise UserError(f"{what} labels outside 0..{num_classes - 1}; check num_classes")
    return xtr, ytr, xte, yte


def default_device(device=None) -> torch.device:
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def train_linear_on_features(train_features, train_labels, test_features, test_labels,
                             num_classes: int, lrs: Sequence[float] = CACHED_LRS, epochs: int = 100,
                             batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 0.0,
                             seed: int = 0, device=None, scale_lr: bool = True,
                             log: Callable[[str], None] | None = None) -> dict:
    """DINO's protocol on fixed features: linear probes, one per learning rate, trained in one pass.

    lrs: base learning rates for a batch of 256; the lr used is lr x batch_size / 256
    when scale_lr (DINO's rule). Features: (N, D) numpy/torch, any device; labels ints.
    Returns {'protocol': 'dino', 'top1', 'top5', 'lr' (base), 'lr_effective', 'per_lr': [{'lr',
    'lr_effective', 'top1', 'top5', 'diverged'}], 'epochs', 'batch_size', 'mode': 'cached',
    'selection'}: top1 / top5 (percent, on the test features) of the best lr.
    """
    epochs, batch_size = _check_common(epochs, batch_size)
    lrs = check_lrs(lrs)
    xtr, ytr, xte, yte = as_features(train_features, train_labels, test_features, test_labels, num_classes)
    device = default_device(device)
    xtr, ytr = xtr.to(device), ytr.to(device)
    scale = batch_size / 256 if scale_lr else 1.0
    heads = LinearHeads(xtr.shape[1], num_classes, lrs, device, seed, momentum, weight_decay)
    g = torch.Generator().manual_seed(seed + 1)
    n = xtr.shape[0]
    t0 = time.time()
    for epoch in range(epochs):
        lr_scale = scale * cosine_factor(epoch, epochs)
        perm = torch.randperm(n, generator=g).to(device)
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            gw, gb = heads.grads(xtr[idx], ytr[idx])
            heads.step(gw, gb, lr_scale)
        if log and (epoch + 1 == epochs or (epoch + 1) % max(1, epochs // 5) == 0):
            log(f"linear: epoch {epoch + 1}/{epochs} ({time.time() - t0:.0f}s)")
    return _report(heads.evaluate(xte, yte), lrs, scale, epochs, batch_size, "cached")


def lbfgs_on_features(train_features, train_labels, test_features, test_labels, num_classes: int,
                      l2: Sequence[float], holdout: float, max_iter: int, seed: int = 0, device=None,
                      memory_gb=None, log: Callable[[str], None] | None = None) -> dict:
    """The lbfgs protocol on fixed features (eval/logreg.py): logistic regression at its
    optimum for every L2 of `l2` on all but a held-out `holdout` of the training split, the
    best there refitted on the whole split and scored once on the test split. Returns
    {'protocol': 'lbfgs', 'mode': 'cached', 'top1', 'top5', 'l2', 'holdout', 'n_fit',
    'n_holdout', 'per_l2', 'refit', 'selection', ...}."""
    from resmlp.eval import logreg
    l2 = positive_numbers(l2, "linear.l2", "[1e-6,1e-4]")
    xtr, ytr, xte, yte = as_features(train_features, train_labels, test_features, test_labels, num_classes)
    res = logreg.probe(xtr, ytr, xte, yte, num_classes, l2, float(holdout), int(seed), int(max_iter),
                       default_device(device), memory_gb, log)
    return {"mode": "cached", **res}


def train_linear_augmented(model, train_loader, test_features, test_labels, num_classes: int,
                           lrs: Sequence[float] = (DINO_LR,), epochs: int = 100, global_batch: int = 256,
                           device="cpu", amp_dtype=None, n_last_blocks: int = 1, momentum: float = 0.9,
                           weight_decay: float = 0.0, seed: int = 0,
                           log: Callable[[str], None] | None = None) -> dict:
    """DINO eval_linear: heads on features recomputed every step from augmented images.

    train_loader: this rank's shard of the augmented train split (per-process batches);
    gradients are averaged over ranks. test_features: eval-transform features (cached).
    """
    from resmlp.data import set_epoch
    from resmlp.eval.features import default_amp_dtype, forward_features

    device = torch.device(device)
    amp_dtype = default_amp_dtype(device) if amp_dtype is None else amp_dtype
    use_amp = device.type == "cuda" and amp_dtype != torch.float32
    lrs = check_lrs(lrs)
    scale = global_batch / 256
    model.eval()
    heads = None
    t0 = time.time()
    for epoch in range(epochs):
        set_epoch(train_loader, epoch)
        lr_scale = scale * cosine_factor(epoch, epochs)
        for batch in train_loader:
            x, y = batch[0].to(device, non_blocking=True), torch.as_tensor(batch[1]).to(device).long()
            with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=use_amp):
                f = forward_features(model, x, n_last_blocks).float()
            if heads is None:
                heads = LinearHeads(f.shape[1], num_classes, lrs, device, seed, momentum, weight_decay)
            gw, gb = heads.grads(f, y)
            if dist.world_size() > 1:
                dist.all_reduce_mean(gw)
                dist.all_reduce_mean(gb)
            heads.step(gw, gb, lr_scale)
        if log and (epoch + 1 == epochs or (epoch + 1) % max(1, epochs // 10) == 0):
            log(f"linear: epoch {epoch + 1}/{epochs} ({time.time() - t0:.0f}s)")
    if heads is None:
        raise UserError("the train split has no images")
    return _report(heads.evaluate(test_features, torch.as_tensor(test_labels)), lrs, scale, epochs,
                   global_batch, "augmented")


# --------------------------------------------------------------------------- the settings

@dataclass(frozen=True)
class Probe:
    """A linear probe's settings, checked (linear.* of configs/method/linear.yaml)."""
    protocol: str                    # lbfgs | dino: linear.protocol with auto resolved
    mode: str                        # cached | augmented
    l2: tuple[float, ...]            # lbfgs
    holdout: float
    max_iter: int
    lrs: tuple[float, ...]           # dino
    epochs: int
    batch_size: int
    momentum: float
    weight_decay: float
    n_last_blocks: int

    def describe(self) -> str:
        """The protocol in a few words, for the result lines."""
        if self.protocol == "lbfgs":
            return (f"lbfgs: logistic regression at its optimum, the L2 chosen on a held-out {self.holdout:g} "
                    "of the train split, refitted on all of it")
        return (f"dino: SGD momentum {self.momentum:g}, wd {self.weight_decay:g}, cosine, {self.epochs} epochs, "
                f"batch {self.batch_size}, the best of {len(self.lrs)} lrs on the test split")


def probe_settings(lc) -> Probe:
    """linear.* checked, before any feature is extracted: the protocol resolved (auto: lbfgs
    on cached features, dino for the augmented probe, which has no fixed features to fit)."""
    protocol, mode = str(lc.protocol), str(lc.mode)
    if protocol == "lbfgs" and mode == "augmented":
        raise UserError("linear.protocol=lbfgs fits fixed features, and the augmented probe sees new crops every "
                        "step: it is DINO's protocol; use linear.protocol=dino (or auto) with linear.mode=augmented, "
                        "or linear.mode=cached")
    if protocol == "auto":
        protocol = "lbfgs" if mode == "cached" else "dino"
    if protocol == "lbfgs" and lc.lrs is not None:
        raise UserError("linear.lrs are the dino protocol's learning rates; linear.protocol=lbfgs tries the L2 "
                        "strengths of linear.l2: drop linear.lrs, or add linear.protocol=dino")
    epochs, batch_size = _check_common(lc.epochs, lc.batch_size)
    lrs = check_lrs(lc.lrs if lc.lrs is not None else (CACHED_LRS if mode == "cached" else [DINO_LR]))
    n_last = lc.n_last_blocks
    if int(n_last) != n_last or int(n_last) < 1:
        raise UserError(f"linear.n_last_blocks={n_last} must be a positive integer")
    return Probe(protocol, mode, positive_numbers(lc.l2, "linear.l2", "[1e-6,1e-4]"), float(lc.holdout),
                 int(lc.max_iter), tuple(lrs), epochs, batch_size, float(lc.momentum), float(lc.weight_decay),
                 int(n_last))


def default_probe() -> Probe:
    """The linear command's default probe (configs/method/linear.yaml): the DINO trainer's
    final probe (dino.final_linear), whose config has no linear.* keys."""
    from omegaconf import OmegaConf
    from resmlp.core.config import CONFIG_DIR
    return probe_settings(OmegaConf.load(CONFIG_DIR / "method" / "linear.yaml").linear)


def probe_cached(train_features, train_labels, test_features, test_labels, num_classes: int, probe: Probe,
                 seed: int = 0, device=None, memory_gb=None, log: Callable[[str], None] | None = None) -> dict:
    """The probe on fixed features under its protocol (memory_gb: features.memory_gb, the
    lbfgs solver's budget, eval/logreg.py's plan_device)."""
    if probe.protocol == "lbfgs":
        return lbfgs_on_features(train_features, train_labels, test_features, test_labels, num_classes,
                                 probe.l2, probe.holdout, probe.max_iter, seed, device, memory_gb, log)
    return train_linear_on_features(train_features, train_labels, test_features, test_labels, num_classes,
                                    probe.lrs, probe.epochs, probe.batch_size, probe.momentum,
                                    probe.weight_decay, seed, device, log=log)


def chosen(res: dict) -> str:
    """What a result's protocol chose, and on which split: for its line."""
    if res["protocol"] == "lbfgs":
        return f"lbfgs, L2 {res['l2']:g} chosen on a held-out {res['holdout']:g} of the train split"
    return f"dino, best lr {res['lr']:g} chosen on the test split"


# --------------------------------------------------------------------------- few labels

def linear_few_labels(train_features, train_labels, test_features, test_labels, num_classes: int,
                      per_class, tries: int, probe: Probe, seed: int = 0, device=None,
                      class_names=None, memory_gb=None, log: Callable[[str], None] | None = None) -> dict:
    """The probe on `tries` class-balanced picks of n training images per class, for each
    n of per_class (linear.few_labels; eval/few_labels.py).

    lbfgs: every L2 fitted on the pick, the one with the best top-1 on a held-out part of
    the training images outside every pick (linear.holdout of them, class-stratified)
    scored on the test split; the features standardized with the whole training split's
    statistics (eval/logreg.py's probe_pick). dino: its lr sweep on the pick, the lrs
    scaled by linear.batch_size / 256 as on the whole bank; a pick smaller than a batch
    trains in one batch of the whole pick (an epoch is then one step, so a smaller lr for
    the smaller batch would leave the head near its init).

    Returns {'protocol', 'per_class', 'tries', 'seed', 'std', 'notes', 'results': {n:
    {'bank', 'top1', 'top1_std', 'top5', 'top5_std', 'tries': [{'top1', 'top5', 'lr' | 'l2'}]}}}
    with n as strings (JSON keys); lbfgs adds 'holdout' and 'n_holdout'."""
    xtr, ytr, xte, yte = as_features(train_features, train_labels, test_features, test_labels, num_classes)
    sizes = few_labels.sizes(per_class)
    banks = {n: few_labels.picks(ytr, n, int(tries), seed) for n in sizes}
    out = {"protocol": probe.protocol, "per_class": sizes, "tries": int(tries), "seed": int(seed),
           "std": "sample standard deviation over the tries (ddof 1; null for one try)", "notes": [], "results": {}}
    if probe.protocol == "lbfgs":
        pick_one, held = _lbfgs_picks(xtr, ytr, xte, yte, num_classes, banks, probe, seed, default_device(device),
                                      memory_gb)
        out.update(holdout=probe.holdout, n_holdout=held)
    else:
        def pick_one(bank):
            r = train_linear_on_features(xtr[bank], ytr[bank], xte, yte, num_classes, probe.lrs, probe.epochs,
                                         probe.batch_size, probe.momentum, probe.weight_decay, seed, device)
            return {"top1": r["top1"], "top5": r["top5"], "lr": r["lr"]}
    for n in sizes:
        short = few_labels.short_classes(ytr, n, class_names)
        if short:
            out["notes"].append(short)
        runs = []
        for t, bank in enumerate(banks[n]):
            runs.append(pick_one(bank))
            if log:
                what = f"L2 {runs[-1]['l2']:g}" if "l2" in runs[-1] else f"lr {runs[-1]['lr']:g}"
                log(f"linear: n={n} pick {t + 1}/{len(banks[n])}: top-1 {runs[-1]['top1']:.2f} at {what}")
        bank_size = int(banks[n][0].numel())
        out["results"][str(n)] = {"bank": bank_size, **few_labels.summary(runs),
                                  **({"batch_size": min(probe.batch_size, bank_size)}
                                     if probe.protocol == "dino" else {})}
    return out


def _lbfgs_picks(xtr, ytr, xte, yte, num_classes: int, banks: dict, probe: Probe, seed: int, device, memory_gb):
    """(the lbfgs probe of one pick, the held-out count): the held-out rows are drawn once,
    outside every pick of every n, so that all picks choose their L2 on the same images."""
    from resmlp.eval import logreg
    x, y = logreg.on_device(xtr, ytr, device, num_classes, memory_gb)
    every = torch.cat([b for picks in banks.values() for b in picks]).unique()
    _, held_rows = logreg.holdout_split(y, probe.holdout, seed, exclude=every)
    if held_rows.numel() == 0:
        raise UserError(f"linear.holdout={probe.holdout:g} of the training images outside the picks is none: "
                        "raise linear.holdout, or pick fewer images per class")
    stats = logreg.Rows(x, y, device).standardize()
    held = logreg.Rows(x, y, device, held_rows).standardize(stats)
    test = logreg.Rows(xte, yte, device).standardize(stats)

    def pick_one(bank):
        return logreg.probe_pick(stats, bank, held, test, num_classes, probe.l2, probe.max_iter)
    return pick_one, int(held_rows.numel())


# --------------------------------------------------------------------------- command

def format_report(res: dict) -> str:
    if res["protocol"] == "lbfgs":
        lines = [f"{'l2':>9}  {'held-out top-1':>14}  {'loss':>7}  {'iterations':>10}"]
        for r in res["per_l2"]:
            if "skipped" in r:
                lines.append(f"{r['l2']:9.2g}  {r['skipped']}")
                continue
            mark = "  <- chosen" if r["l2"] == res["l2"] else ("  (max_iter)" if not r["converged"] else "")
            lines.append(f"{r['l2']:9.2g}  {r['holdout_top1']:14.2f}  {r['holdout_loss']:7.4f}  "
                         f"{r['iterations']:10d}{mark}")
        return "\n".join(lines)
    lines = [f"{'lr':>9}  {'lr x bs/256':>11}  {'top-1':>7}  {'top-5':>7}"]
    for r in res["per_lr"]:
        mark = "  <- best" if r["lr"] == res["lr"] else ("  (diverged)" if r.get("diverged") else "")
        lines.append(f"{r['lr']:9.2g}  {r['lr_effective']:11.3g}  {r['top1']:7.2f}  {r['top5']:7.2f}{mark}")
    return "\n".join(lines)


def format_few_labels(res: dict) -> str:
    cell = few_labels.cell
    which = "L2" if res["protocol"] == "lbfgs" else "lr"
    where = (f"on {res['n_holdout']} held-out training images outside the picks" if res["protocol"] == "lbfgs"
             else "on the test split")
    lines = [f"linear probe with few labels ({res['protocol']}): n training images per class, {res['tries']} "
             f"seeded class-balanced picks each (seed {res['seed']}), the {which} of each pick chosen {where}; "
             "mean ± sample std over the picks",
             f"{'n':>5}  {'bank':>7}  {'top-1':>6} ± {'std':<5}  {'top-5':>6} ± {'std':<5}  chosen {which}s"]
    for n, r in res["results"].items():
        values = ",".join(f"{t[which.lower()]:g}" for t in r["tries"])
        lines.append(f"{n:>5}  {r['bank']:>7}  {cell(r, 'top1')}  {cell(r, 'top5')}  {values}")
    return "\n".join(lines + res["notes"])


def check_linear_config(cfg) -> Probe:
    """The probe's settings, checked before any feature is extracted."""
    from resmlp.data.datasets import check_split_classes
    probe = probe_settings(cfg.linear)
    if few_labels.sizes(cfg.linear.few_labels) and probe.mode != "cached":
        raise UserError(f"linear.few_labels trains on cached features: use linear.mode=cached, "
                        f"or drop linear.few_labels for linear.mode={probe.mode}")
    check_split_classes(cfg.data)
    return probe


def linear_command(cfg, bb) -> dict | None:
    """bash run.sh linear <ckpt | run dir | timm:<name>> [linear.protocol=lbfgs|dino] [linear.mode=cached|augmented]"""
    from resmlp.eval.command import log, split_features

    probe = check_linear_config(cfg)
    seed, lc, n_last = int(cfg.seed), cfg.linear, probe.n_last_blocks
    test = split_features(cfg, bb, "test", n_last)
    data = {"name": cfg.data.name, "subset": cfg.data.subset, "num_classes": test["num_classes"]}
    if probe.mode == "cached" and few_labels.sizes(lc.few_labels):
        train = split_features(cfg, bb, "train", n_last)
        if not dist.is_main():
            return None
        few = linear_few_labels(train["features"], train["labels"], test["features"], test["labels"],
                                test["num_classes"], lc.few_labels, int(lc.tries), probe, seed, bb.device,
                                train["classes"], cfg.features.get("memory_gb"), log=log)
        log(f"linear probe (cached, {probe.describe()}; n_last_blocks={n_last}) on {cfg.data.name} test, "
            f"{test['features'].shape[0]} images")
        log(format_few_labels(few))
        return {"protocol": probe.protocol, "mode": probe.mode, "n_last_blocks": n_last, "few_labels": few,
                **({"epochs": probe.epochs} if probe.protocol == "dino" else {}),
                "n_train": int(train["features"].shape[0]), "n_test": int(test["features"].shape[0]),
                "feature_dim": int(test["features"].shape[1]), "data": data,
                "features": {"test_cache": test["cache"], "train_cache": train["cache"]}}
    if probe.mode == "cached":
        train = split_features(cfg, bb, "train", n_last)
        res = None
        if dist.is_main():
            res = probe_cached(train["features"], train["labels"], test["features"], test["labels"],
                               test["num_classes"], probe, seed, bb.device, cfg.features.get("memory_gb"), log=log)
            res["n_train"] = int(train["features"].shape[0])
    else:
        res = _augmented(cfg, bb, probe, test, seed, log)
    if not dist.is_main():
        return None
    res.update(n_test=int(test["features"].shape[0]), n_last_blocks=n_last,
               feature_dim=int(test["features"].shape[1]))
    log(f"linear probe ({probe.mode}, {probe.describe()}; n_last_blocks={n_last}) on {cfg.data.name} test, "
        f"{res['n_test']} images / {res['n_train']} train")
    log(format_report(res))
    log(f"linear top1={res['top1']:.2f} top5={res['top5']:.2f} ({chosen(res)})")
    return {**res, "data": data, "features": {"test_cache": test["cache"]}}


def _augmented(cfg, bb, probe: Probe, test: dict, seed: int, log) -> dict:
    """DINO's augmented probe (every rank): crops and flips of the train split."""
    import resmlp.data as rdata
    world, batch_size = dist.world_size(), probe.batch_size
    if batch_size % world:
        raise UserError(f"linear.batch_size={batch_size} is not divisible by the {world} processes")
    ds = rdata.build_dataset(cfg.data, "train", transform=rdata.build_linear_train_transform(cfg.data))
    if len(ds) == 0:
        raise UserError(f"the train split of {cfg.data.name} is empty; check data.root / data.subset")
    loader = rdata.build_loader(ds, batch_size // world, train=True, num_workers=int(cfg.num_workers), seed=seed)
    res = train_linear_augmented(
        bb.model, loader, test["features"], test["labels"], test["num_classes"], probe.lrs, probe.epochs,
        batch_size, bb.device, bb.amp_dtype, probe.n_last_blocks, probe.momentum, probe.weight_decay, seed,
        log=log)
    res["n_train"] = len(ds)
    return res


def run(cfg) -> int:
    require_classes(cfg.data, "a linear probe's accuracy")
    from resmlp.eval.command import eval_command
    check_linear_config(cfg)
    return eval_command(linear_command)(cfg)
