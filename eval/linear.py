"""Linear probe on a frozen backbone (DINO's eval_linear.py protocol, two ways).

The backbone stays frozen in eval mode; one linear layer reads its pooled features
(or, with linear.n_last_blocks = n, the concatenated pooled features of the last n
blocks, as DINO does with the last n class tokens). Init N(0, 0.01), bias 0; SGD with
momentum 0.9, weight decay 0, cosine schedule stepped per epoch to 0.

linear.mode=cached (default): train on the cached eval-transform features (the same
  files k-NN uses, see features.py), one head per learning rate trained side by side
  in one pass over the data (a batched (L, D, C) weight: every head sees the same
  batches, in the same order, from the same init). Fast; no augmentation, so it
  usually lands a little below the augmented protocol.
linear.mode=augmented: DINO's protocol proper: RandomResizedCrop + flip on the train
  split (resmlp.data.build_linear_train_transform), the backbone run under no_grad on
  every batch, lr 0.001 x batch/256 unless linear.lrs says otherwise; several lrs are
  still trained at once (the backbone pass is shared, so they cost almost nothing).

Model selection: the reported result is the best test top-1 over the learning rates,
after the last epoch. DINO too reports the best accuracy measured on the validation
set, which is the test set here (ImageNet val): an optimistic, but standard, number.
"""
from __future__ import annotations

import math
import time
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


def check_lrs(lrs) -> list[float]:
    from resmlp.core.config import as_list
    try:
        out = [float(v) for v in as_list(lrs)]
    except (TypeError, ValueError):
        raise UserError(f"linear.lrs={lrs!r} must be numbers, e.g. linear.lrs=[0.001,0.01]") from None
    if not out or any(not (v > 0 and math.isfinite(v)) for v in out):
        raise UserError(f"linear.lrs={lrs!r} must be positive numbers, e.g. linear.lrs=[0.001,0.01]")
    return out


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
    return {"mode": mode, "epochs": epochs, "batch_size": batch_size,
            "top1": best["top1"], "top5": best["top5"], "lr": best["lr"],
            "lr_effective": best["lr_effective"], "per_lr": per_lr,
            "selection": "best test top-1 over lrs (DINO also selects on val = the test split)"}


def train_linear_on_features(train_features, train_labels, test_features, test_labels,
                             num_classes: int, lrs: Sequence[float] = CACHED_LRS, epochs: int = 100,
                             batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 0.0,
                             seed: int = 0, device=None, scale_lr: bool = True,
                             log: Callable[[str], None] | None = None) -> dict:
    """Linear probes on fixed features, one per learning rate, trained in one pass.

    lrs: base learning rates for a batch of 256; the lr used is lr x batch_size / 256
    when scale_lr (DINO's rule). Features: (N, D) numpy/torch, any device; labels ints.
    Returns {'top1', 'top5', 'lr' (base), 'lr_effective', 'per_lr': [{'lr', 'lr_effective',
    'top1', 'top5', 'diverged'}], 'epochs', 'batch_size', 'mode': 'cached', 'selection'}:
    top1 / top5 (percent, on the test features) of the best lr.
    """
    import numpy as np

    def t(x, dtype):
        x = torch.from_numpy(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
        return x.detach().to("cpu", dtype)

    epochs, batch_size = _check_common(epochs, batch_size)
    lrs = check_lrs(lrs)
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
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
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


def linear_few_labels(train_features, train_labels, test_features, test_labels, num_classes: int,
                      per_class, tries: int, seed: int = 0, lrs: Sequence[float] = CACHED_LRS, epochs: int = 100,
                      batch_size: int = 256, momentum: float = 0.9, weight_decay: float = 0.0, device=None,
                      class_names=None, log: Callable[[str], None] | None = None) -> dict:
    """train_linear_on_features (its lr sweep, the best lr per pick) on `tries`
    class-balanced picks of n training images per class, for each n of per_class
    (linear.few_labels; eval/few_labels.py). The lrs are the whole bank's, scaled by
    linear.batch_size / 256 as there; a pick smaller than a batch trains in one batch of the whole pick (an epoch is
    then one step, so a smaller lr for the smaller batch would leave the head near its init).

    Returns {'per_class', 'tries', 'seed', 'std', 'notes', 'results': {n: {'bank',
    'batch_size', 'top1', 'top1_std', 'top5', 'top5_std', 'tries': [{'top1', 'top5',
    'lr'}]}}} with n as strings (JSON keys)."""
    ytr = torch.as_tensor(train_labels).reshape(-1).cpu()
    xtr = torch.as_tensor(train_features)
    out = {"per_class": few_labels.sizes(per_class), "tries": int(tries), "seed": int(seed),
           "std": "sample standard deviation over the tries (ddof 1; null for one try)", "notes": [],
           "results": {}}
    for n in out["per_class"]:
        short = few_labels.short_classes(ytr, n, class_names)
        if short:
            out["notes"].append(short)
        banks = few_labels.picks(ytr, n, int(tries), seed)
        runs = []
        for t, bank in enumerate(banks):
            r = train_linear_on_features(xtr[bank], ytr[bank], test_features, test_labels, num_classes, lrs, epochs,
                                         batch_size, momentum, weight_decay, seed, device)
            runs.append({"top1": r["top1"], "top5": r["top5"], "lr": r["lr"]})
            if log:
                log(f"linear: n={n} pick {t + 1}/{len(banks)}: top-1 {r['top1']:.2f} at lr {r['lr']:g}")
        out["results"][str(n)] = {"bank": int(banks[0].numel()), "batch_size": min(batch_size, int(banks[0].numel())),
                                  **few_labels.summary(runs)}
    return out


# --------------------------------------------------------------------------- command

def format_report(res: dict) -> str:
    lines = [f"{'lr':>9}  {'lr x bs/256':>11}  {'top-1':>7}  {'top-5':>7}"]
    for r in res["per_lr"]:
        mark = "  <- best" if r["lr"] == res["lr"] else ("  (diverged)" if r.get("diverged") else "")
        lines.append(f"{r['lr']:9.2g}  {r['lr_effective']:11.3g}  {r['top1']:7.2f}  {r['top5']:7.2f}{mark}")
    return "\n".join(lines)


def format_few_labels(res: dict) -> str:
    cell = few_labels.cell
    lines = [f"linear probe with few labels: n training images per class, {res['tries']} seeded class-balanced "
             f"picks each (seed {res['seed']}), the best lr per pick; mean ± sample std over the picks",
             f"{'n':>5}  {'bank':>7}  {'top-1':>6} ± {'std':<5}  {'top-5':>6} ± {'std':<5}  best lrs"]
    for n, r in res["results"].items():
        lrs = ",".join(f"{t['lr']:g}" for t in r["tries"])
        lines.append(f"{n:>5}  {r['bank']:>7}  {cell(r, 'top1')}  {cell(r, 'top5')}  {lrs}")
    return "\n".join(lines + res["notes"])


def check_linear_config(cfg) -> tuple[str, int, int, list, int]:
    """(mode, epochs, batch size, lrs, n_last_blocks), checked before any feature is extracted."""
    from resmlp.data.datasets import check_split_classes
    lc = cfg.linear
    mode = str(lc.mode)
    if few_labels.sizes(lc.few_labels) and mode != "cached":
        raise UserError(f"linear.few_labels trains on cached features: use linear.mode=cached, "
                        f"or drop linear.few_labels for linear.mode={mode}")
    check_split_classes(cfg.data)
    epochs, batch_size = _check_common(lc.epochs, lc.batch_size)
    lrs = check_lrs(lc.lrs if lc.lrs is not None else (CACHED_LRS if mode == "cached" else [DINO_LR]))
    n_last = lc.n_last_blocks
    if int(n_last) != n_last or int(n_last) < 1:
        raise UserError(f"linear.n_last_blocks={n_last} must be a positive integer")
    return mode, epochs, batch_size, lrs, int(n_last)


def linear_command(cfg, bb) -> dict | None:
    """bash run.sh linear <ckpt | run dir | timm:<name>> [linear.mode=cached|augmented] ..."""
    import resmlp.data as rdata
    from resmlp.eval.command import log, split_features

    mode, epochs, batch_size, lrs, n_last = check_linear_config(cfg)
    seed, lc = int(cfg.seed), cfg.linear
    test = split_features(cfg, bb, "test", n_last)
    if mode == "cached" and few_labels.sizes(lc.few_labels):
        train = split_features(cfg, bb, "train", n_last)
        if not dist.is_main():
            return None
        few = linear_few_labels(train["features"], train["labels"], test["features"], test["labels"],
                              test["num_classes"], lc.few_labels, int(lc.tries), seed, lrs, epochs, batch_size,
                              float(lc.momentum), float(lc.weight_decay), bb.device, train["classes"], log=log)
        log(f"linear probe (cached: frozen backbone, SGD momentum 0.9, wd 0, cosine, {epochs} epochs, "
            f"n_last_blocks={n_last}) on {cfg.data.name} test, {test['features'].shape[0]} images")
        log(format_few_labels(few))
        return {"mode": mode, "epochs": epochs, "n_last_blocks": n_last, "few_labels": few,
                "n_train": int(train["features"].shape[0]), "n_test": int(test["features"].shape[0]),
                "feature_dim": int(test["features"].shape[1]),
                "data": {"name": cfg.data.name, "subset": cfg.data.subset, "num_classes": test["num_classes"]},
                "features": {"test_cache": test["cache"], "train_cache": train["cache"]}}
    if mode == "cached":
        train = split_features(cfg, bb, "train", n_last)
        res = None
        if dist.is_main():
            res = train_linear_on_features(
                train["features"], train["labels"], test["features"], test["labels"],
                test["num_classes"], lrs, epochs, batch_size, float(lc.momentum), float(lc.weight_decay), seed,
                bb.device, log=log)
            res["n_train"] = int(train["features"].shape[0])
    else:
        world = dist.world_size()
        if batch_size % world:
            raise UserError(f"linear.batch_size={batch_size} is not divisible by the {world} processes")
        ds = rdata.build_dataset(cfg.data, "train", transform=rdata.build_linear_train_transform(cfg.data))
        if len(ds) == 0:
            raise UserError(f"the train split of {cfg.data.name} is empty; check data.root / data.subset")
        loader = rdata.build_loader(ds, batch_size // world, train=True, num_workers=int(cfg.num_workers),
                                    seed=seed)
        res = train_linear_augmented(
            bb.model, loader, test["features"], test["labels"], test["num_classes"], lrs, epochs,
            batch_size, bb.device, bb.amp_dtype, n_last, float(lc.momentum), float(lc.weight_decay), seed,
            log=log)
        res["n_train"] = len(ds)
    if not dist.is_main():
        return None
    res.update(n_test=int(test["features"].shape[0]), n_last_blocks=n_last,
               feature_dim=int(test["features"].shape[1]))
    log(f"linear probe ({mode}: frozen backbone, SGD momentum 0.9, wd 0, cosine, {epochs} epochs, "
        f"batch {batch_size}, n_last_blocks={n_last}) on {cfg.data.name} test, "
        f"{res['n_test']} images / {res['n_train']} train")
    log(format_report(res))
    log(f"best: top-1 {res['top1']:.2f}  top-5 {res['top5']:.2f}  at lr {res['lr']:g} "
        f"(selected on the test split, as DINO does on val)")
    return {**res, "data": {"name": cfg.data.name, "subset": cfg.data.subset, "num_classes": test["num_classes"]},
            "features": {"test_cache": test["cache"]}}


def run(cfg) -> int:
    require_classes(cfg.data, "a linear probe's accuracy")
    from resmlp.eval.command import eval_command
    check_linear_config(cfg)
    return eval_command(linear_command)(cfg)
