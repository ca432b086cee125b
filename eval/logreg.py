"""Multinomial logistic regression at its optimum on fixed features: the linear probe's
default protocol (linear.protocol=lbfgs, see eval/linear.py).

The objective of one fit: the mean cross-entropy over the fitted images plus
l2 / 2 * ||W||^2 (the bias is not penalized), a strictly convex function with one minimum,
which full-batch L-BFGS reaches (torch.optim.LBFGS, strong-Wolfe line search, on the
device). It is scikit-learn's LogisticRegression(C=1 / (l2 * n)) on the same standardized
features, so its answers can be checked against it (tests/test_linear.py).

Standardized features: each dimension is centered and scaled to unit variance with the
statistics of the images being fitted. Frozen features differ in scale between
dimensions by orders of magnitude; unscaled, the problem is badly conditioned and L-BFGS
needs many more passes to reach the same optimum. The L2 is then in those units.

Memory: loss and gradient are summed over chunks of rows (one chunk's logits at a time,
in float64, see DTYPE), and a fit on a subset of rows gathers them a chunk at a time, so
nothing of the size of the features is copied. The training features go to the device
once when they fit its budget (plan_device); else they stay on the host and each pass
sends them a chunk at a time.

Selection (probe): a seeded, class-stratified part of the training split
(linear.holdout) is held out; the L2s of the grid are fitted on the rest, from the
largest to the smallest, each from the previous solution (warm start: same optimum, fewer
passes). A fit that stops at linear.max_iter is not at its optimum: it is not chosen, and
the smaller L2s, worse conditioned still, are not tried. The L2 with the best held-out
top-1 (ties: the lower held-out loss, then the larger L2) is fitted again on the whole
training split, and that model alone is scored on the test split. The test split
chooses nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from resmlp.eval import memory

CHUNK_BYTES = 64 * 2**20   # a chunk's working set: its features and three (rows, C) buffers
HISTORY = 20               # L-BFGS's curvature pairs: twice torch's default, fewer passes on weak L2s
MAX_EVAL = 2               # loss evaluations per iteration at most, on average (line searches)
# Stops: the largest gradient entry of the mean loss below TOLERANCE_GRAD (the objective
# then matches scikit-learn's lbfgs, tests/test_linear.py), or a loss change below what
# float64 still resolves.
TOLERANCE_GRAD = 1e-6
TOLERANCE_CHANGE = 1e-12
# The solver's arithmetic. Near the optimum of a weakly regularized fit, a step lowers the
# mean loss by less than float32 resolves over a split: the line search then stops on
# rounding, not at the optimum. float64 costs twice float32 on a CPU and about the same on
# a datacenter GPU (FP64 tensor cores); the features stay float32, a chunk converted at a time.
DTYPE = torch.float64
HOLDOUT_STREAM = 2**31 - 1  # the held-out draw's numpy stream, apart from few_labels' tries (0, 1, ...)


def holdout_split(labels, fraction: float, seed: int, exclude=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit rows, held-out rows), sorted: of every class round(fraction x its count) images,
    at most all but one, drawn with numpy's generator seeded (seed, HOLDOUT_STREAM).
    `exclude` (rows) are kept out of the held-out part (few labels: the picks)."""
    y = np.asarray(torch.as_tensor(labels).reshape(-1).cpu())
    order = np.random.default_rng([int(seed), HOLDOUT_STREAM]).permutation(y.size)
    if exclude is not None:
        order = order[~np.isin(order, np.asarray(torch.as_tensor(exclude).cpu()))]
    by_class = order[np.argsort(y[order], kind="stable")]
    _, starts, counts = np.unique(y[by_class], return_index=True, return_counts=True)
    rank = np.arange(by_class.size) - np.repeat(starts, counts)
    keep = np.minimum(np.rint(fraction * counts), np.maximum(counts - 1, 0)).astype(np.int64)
    held = by_class[rank < np.repeat(keep, counts)]
    fit = np.setdiff1d(np.arange(y.size), held)
    return torch.from_numpy(fit), torch.from_numpy(np.sort(held))


# --------------------------------------------------------------------------- the problem

class Rows:
    """Features (N, D) and labels, or the subset `rows` of them, read a chunk at a time on
    `device`, standardized with the statistics set by `standardize`."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device, rows: torch.Tensor | None = None):
        self.x, self.y, self.device = x, y, torch.device(device)
        self.rows = rows.to(x.device) if rows is not None else None
        self.n = int(rows.numel()) if rows is not None else int(x.shape[0])
        self.mu = torch.zeros(x.shape[1], dtype=DTYPE, device=self.device)
        self.inv_s = torch.ones(x.shape[1], dtype=DTYPE, device=self.device)

    def chunk_rows(self, classes: int) -> int:
        return max(1, CHUNK_BYTES // (DTYPE.itemsize * (self.x.shape[1] + 3 * classes)))

    def chunks(self, classes: int):
        """(standardized features, labels) of each chunk, on the device."""
        step = self.chunk_rows(classes)
        for s in range(0, self.n, step):
            idx = self.rows[s:s + step] if self.rows is not None else slice(s, s + step)
            x = self.x[idx].to(self.device, DTYPE, non_blocking=True)
            yield (x - self.mu) * self.inv_s, self.y[idx].to(self.device, non_blocking=True)

    def standardize(self, other: "Rows | None" = None) -> "Rows":
        """Take `other`'s statistics, or compute these rows' own (float64 sums; a constant
        dimension keeps scale 1, as scikit-learn's StandardScaler)."""
        if other is not None:
            self.mu, self.inv_s = other.mu, other.inv_s
            return self
        self.mu, self.inv_s = torch.zeros_like(self.mu), torch.ones_like(self.inv_s)
        s1 = torch.zeros(self.x.shape[1], dtype=torch.float64, device=self.device)
        s2 = torch.zeros_like(s1)
        for x, _ in self.chunks(1):
            s1 += x.sum(0, dtype=torch.float64)
            s2 += (x.double() ** 2).sum(0)
        mean = s1 / self.n
        std = (s2 / self.n - mean ** 2).clamp_min(0).sqrt()
        self.mu = mean.to(DTYPE)
        self.inv_s = torch.where(std > 0, 1.0 / std, torch.ones_like(std)).to(DTYPE)
        return self


def loss_grad(data: Rows, w: torch.Tensor, b: torch.Tensor, l2: float):
    """The objective at (w, b) and its gradient: mean cross-entropy + l2/2 ||w||^2."""
    classes = w.shape[1]
    loss = torch.zeros((), dtype=torch.float64, device=w.device)
    gw = torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    gb = torch.zeros(classes, dtype=torch.float64, device=w.device)
    for x, y in data.chunks(classes):
        logits = torch.addmm(b, x, w)
        lse = torch.logsumexp(logits, 1)
        rows = torch.arange(y.shape[0], device=y.device)
        loss += (lse - logits[rows, y]).sum(dtype=torch.float64)
        g = torch.exp(logits - lse[:, None])
        g[rows, y] -= 1.0
        gw += x.T @ g
        gb += g.sum(0, dtype=torch.float64)
    n = data.n
    loss = loss / n + 0.5 * l2 * (w.double() ** 2).sum()
    return loss, (gw / n + l2 * w.double()).to(w.dtype), (gb / n).to(w.dtype)


@dataclass
class Fit:
    w: torch.Tensor
    b: torch.Tensor
    l2: float
    iterations: int
    evaluations: int
    loss: float
    grad_max: float     # the largest gradient entry at the end: how near the optimum it stopped
    converged: bool     # stopped by a tolerance, not by max_iter

    def summary(self) -> dict:
        return {"l2": self.l2, "iterations": self.iterations, "evaluations": self.evaluations,
                "loss": self.loss, "grad_max": self.grad_max, "converged": self.converged}


def fit(data: Rows, classes: int, l2: float, max_iter: int, start: Fit | None = None) -> Fit:
    """The minimum of the objective on `data` by full-batch L-BFGS, from `start` or zero."""
    dim = data.x.shape[1]
    w = (start.w.clone() if start else torch.zeros(dim, classes, dtype=DTYPE, device=data.device)).requires_grad_()
    b = (start.b.clone() if start else torch.zeros(classes, dtype=DTYPE, device=data.device)).requires_grad_()
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=max_iter, max_eval=MAX_EVAL * max_iter, history_size=HISTORY,
                            tolerance_grad=TOLERANCE_GRAD, tolerance_change=TOLERANCE_CHANGE,
                            line_search_fn="strong_wolfe")

    def closure():
        loss, w.grad, b.grad = loss_grad(data, w.detach(), b.detach(), l2)
        return loss

    opt.step(closure)
    state = opt.state[w]
    with torch.no_grad():
        loss, gw, gb = loss_grad(data, w, b, l2)
    iterations, evaluations = int(state.get("n_iter", 0)), int(state.get("func_evals", 0))
    return Fit(w.detach(), b.detach(), float(l2), iterations, evaluations, float(loss),
               float(max(gw.abs().max(), gb.abs().max())), iterations < max_iter and evaluations < MAX_EVAL * max_iter)


@torch.no_grad()
def score(data: Rows, model: Fit) -> dict:
    """{'top1', 'top5' (percent), 'loss' (mean cross-entropy)} of the model on `data`;
    equal logits rank the lower class first (knn.topk_correct's order)."""
    from resmlp.eval.knn import topk_correct
    classes = model.w.shape[1]
    hits = {"top1": 0.0, "top5": 0.0}
    loss = 0.0
    for x, y in data.chunks(classes):
        logits = torch.addmm(model.b, x, model.w)
        loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        for k, v in topk_correct(logits, y).items():
            hits[k] += v * y.shape[0]
    return {k: v / data.n for k, v in hits.items()} | {"loss": loss / data.n}


# --------------------------------------------------------------------------- memory and the protocol

def state_bytes(dim: int, classes: int) -> int:
    """The solver's own memory: L-BFGS's curvature pairs, the weights, their gradient and
    the few other vectors of their size it keeps, and a chunk's work (twice, for the
    float32 rows gathered beside their float64 copy)."""
    return (2 * HISTORY + 6) * (dim + 1) * classes * DTYPE.itemsize + 2 * CHUNK_BYTES


def plan_device(n: int, dim: int, classes: int, device, memory_gb=None) -> tuple[bool, str | None]:
    """(whether the training features go to the device whole, the line that says they do
    not), or a UserError when not even the solver's state fits. The budget is
    features.memory_gb, else memory.BUDGET_FRACTION of the memory available (a GPU's free
    memory there). The state: L-BFGS's curvature pairs, the weights and their gradients,
    and a chunk's work. The features take n x dim float32 more when they go whole; on the
    CPU they are used where they already are."""
    from resmlp.core.errors import UserError
    device = torch.device(device)
    state = state_bytes(dim, classes)
    if memory_gb is not None:
        budget = int(float(memory_gb) * 2**30)
    else:
        have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else memory.host_available()
        budget = None if have is None else int(have * memory.BUDGET_FRACTION)
    if budget is not None and state > budget:
        raise UserError(f"the linear probe's solver state for {dim} features x {classes} classes would take "
                        f"{memory.gb(state)}, over the budget of {memory.gb(budget)} "
                        f"({memory.where_budget(budget, memory_gb)}): use linear.protocol=dino, or a machine with "
                        "more memory")
    if device.type != "cuda":
        return False, None
    features = n * dim * memory.FLOAT_BYTES
    if budget is None or state + features <= budget:
        return True, None
    return False, (f"linear: the {n} training features ({dim} wide, {memory.gb(features)}) do not fit beside the "
                   f"solver's state within {memory.gb(budget)} of the GPU ({memory.where_budget(budget, memory_gb)}): "
                   "they stay in host memory and go to the GPU a chunk at a time each pass (slower, same result)")


def on_device(x, y, device, classes: int, memory_gb=None, log=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The training features and labels where the solver reads them (plan_device)."""
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.int64).reshape(-1)
    whole, line = plan_device(x.shape[0], x.shape[1], classes, device, memory_gb)
    if line and log:
        log(line)
    return (x.to(device), y.to(device)) if whole else (x, y)


def sweep(train: Rows, held: Rows, classes: int, l2s, max_iter: int, log=None) -> tuple[Fit, list[dict]]:
    """The L2s fitted on `train` (largest first, warm-started) and scored on `held`:
    (the chosen L2's fit, one row per L2 fitted). A fit that ends at max_iter is not at its
    optimum: it is not chosen (unless none is), and the smaller L2s are not tried, since
    their problems are worse conditioned still (the rows say so)."""
    rows, fits, start = [], {}, None
    for l2 in sorted({float(v) for v in l2s}, reverse=True):
        if start is not None and not start.converged:
            rows.append({"l2": l2, "skipped": f"not tried: l2 {start.l2:g} ended at max_iter={max_iter}"})
            continue
        start = fits[l2] = fit(train, classes, l2, max_iter, start)
        rows.append({**start.summary(), **{f"holdout_{k}": v for k, v in score(held, start).items()}})
        if log:
            r = rows[-1]
            log(f"linear: l2 {l2:g}: held-out top-1 {r['holdout_top1']:.2f} ({r['iterations']} iterations"
                f"{'' if r['converged'] else ', max_iter'})")
    tried = [r for r in rows if "skipped" not in r]
    best = max([r for r in tried if r["converged"]] or tried,
               key=lambda r: (r["holdout_top1"], -r["holdout_loss"], r["l2"]))
    return fits[best["l2"]], sorted(rows, key=lambda r: r["l2"])


def probe(x, y, test_x, test_y, classes: int, l2s, holdout: float, seed: int, max_iter: int, device,
          memory_gb=None, log=None) -> dict:
    """The lbfgs protocol on checked features: the L2 chosen on the held-out part of the
    training split, refitted on the whole split, scored once on the test split."""
    from resmlp.core.errors import UserError
    x, y = on_device(x, y, device, classes, memory_gb, log)
    fit_rows, held_rows = holdout_split(y, holdout, seed)
    if held_rows.numel() == 0:
        raise UserError(f"linear.holdout={holdout:g} holds out no image of the {y.numel()} training images "
                        "(every class needs two or more): raise linear.holdout, or use a larger train split")
    part = Rows(x, y, device, fit_rows).standardize()
    chosen, per_l2 = sweep(part, Rows(x, y, device, held_rows).standardize(part), classes, l2s, max_iter, log)
    l2 = chosen.l2
    whole = Rows(x, y, device).standardize()
    model = fit(whole, classes, l2, max_iter, start=chosen)
    test = score(Rows(test_x, torch.as_tensor(test_y), device).standardize(whole), model)
    return {"protocol": "lbfgs", "top1": test["top1"], "top5": test["top5"], "l2": l2, "holdout": float(holdout),
            "n_fit": int(fit_rows.numel()), "n_holdout": int(held_rows.numel()), "seed": int(seed),
            "max_iter": int(max_iter), "refit": model.summary(), "per_l2": per_l2,
            "standardized": "each feature centered and scaled to unit variance on the images fitted",
            "selection": f"the L2 with the best top-1 on a held-out {holdout:g} of the train split (class-stratified, "
                         f"seed {seed}); refitted on the whole train split; the test split scored once"}


def probe_pick(stats: Rows, pick: torch.Tensor, held: Rows, test: Rows, classes: int, l2s, max_iter: int) -> dict:
    """The lbfgs protocol on a few-label pick (rows of the training features `stats`
    holds): each L2 fitted on the pick, the one best on `held` (rows outside every pick)
    scored once on `test`. `stats` is the whole training split, standardized: its
    statistics need no labels, and a pick of one image per class has none worth the name;
    `held` and `test` take them too."""
    model, _ = sweep(Rows(stats.x, stats.y, stats.device, pick).standardize(stats), held, classes, l2s, max_iter)
    res = score(test, model)
    return {"top1": res["top1"], "top5": res["top5"], "l2": model.l2, "iterations": model.iterations}
