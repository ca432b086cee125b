"""Weighted k-NN classification of frozen features (DINO's eval_knn.py protocol).

Protocol: features are L2-normalised (callers pass raw features), similarity is the
cosine, the k most similar training features vote for their label with weight
exp(sim / T), votes are summed per class; top-1 / top-5 of those scores. DINO's defaults:
k = 20 (also 10, 100, 200), T = 0.07.

The neighbours come from eval/knn_search.py (exact, backend-independent, ties to the
lower train index, memory-bounded). The vote is ranked by its logarithm, the log-sum-exp
of sim / T over the class's neighbours, computed as max + log(sum exp(. - max)) per class
in float64: exp(sim / T) itself overflows float64 once T < 1/710 (and float32's much
sooner), which would rank every class alike. Equal scores go to the lower class index.

Few labels (knn.few_labels, knn.tries; eval/few_labels.py): the same evaluation with banks
of n images per class, drawn `tries` times from features extracted once; mean and
standard deviation over the tries for each n and k, a k larger than a bank clipped to it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from resmlp.core import dist
from resmlp.core.errors import UserError
from resmlp.data.subset import make_subset
from resmlp.eval import few_labels, memory
from resmlp.eval.knn_search import as_tensor, backend_name, check_ks, knn_search, phase


def check_temperature(temperature) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise UserError(f"T={temperature!r} is not a number; use e.g. T=0.07") from None
    if not t > 0 or not math.isfinite(t):
        raise UserError(f"T={temperature} must be a positive number (DINO uses 0.07)")
    if not math.isfinite(1.0 / t):
        raise UserError(f"T={temperature} is too small: sim / T overflows; use T=1e-300 or more (DINO uses 0.07)")
    return t


def _labels(y, n: int, num_classes: int, name: str) -> torch.Tensor:
    y = as_tensor(y, name, torch.int64).reshape(-1)
    if y.shape[0] != n:
        raise UserError(f"{name} has {y.shape[0]} labels for {n} features")
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise UserError(f"{name} holds labels outside 0..{num_classes - 1}; check num_classes")
    return y


# --------------------------------------------------------------------------- votes

def _vote(sims: torch.Tensor, idx: torch.Tensor, train_labels: torch.Tensor, num_classes: int,
          temperature: float) -> torch.Tensor:
    """(n, C) float64 on the CPU: the log of each class's vote, log sum over its neighbours
    of exp(sim / T), -inf for a class without one. Each class's largest sim / T is taken out
    before the exp, so every exp lies in (0, 1] and the largest is 1: nothing overflows,
    and the sum is at least 1, so its log is accurate.
    Computed where the neighbours are, in slices of rows whose temporaries and table stay
    within 128 MiB of float64 on that device, each slice copied to the host table as it is
    done. A neighbour's class sum runs over the neighbours of its own row that share its
    label (a k x k mask), and one neighbour per class writes it: no atomic adds, so a GPU
    gives the same scores every time, and the table is written once."""
    labels = train_labels.to(idx.device)[idx]
    out = torch.full((idx.shape[0], num_classes), float("-inf"), dtype=torch.float64)
    k = max(1, idx.shape[1])
    rows = max(1, 2**24 // max(k * k, num_classes))
    for s in range(0, idx.shape[0], rows):
        logits = sims[s:s + rows].double() / temperature
        lab = labels[s:s + rows]
        same = lab.unsqueeze(2) == lab.unsqueeze(1)                                # (r, k, k)
        peak = logits.unsqueeze(1).expand(-1, k, -1).masked_fill(~same, float("-inf")).amax(2)
        total = torch.bmm(same.double(), (logits - peak).exp().unsqueeze(2)).squeeze(2)
        r, j = (~same.tril(-1).any(2)).nonzero(as_tuple=True)   # each class's first neighbour
        part = out[s:s + rows] if idx.device.type == "cpu" else torch.full(
            (lab.shape[0], num_classes), float("-inf"), dtype=torch.float64, device=idx.device)
        part[r, lab[r, j]] = (peak + total.log())[r, j]
        with phase("copy back"):
            if part.device != out.device:
                out[s:s + rows].copy_(part)
    return out


def knn_classify(train_features, train_labels, test_features, num_classes: int, k: int = 20,
                 temperature: float = 0.07, backend: str = "auto",
                 chunk_size: int | None = None, device=None, search=knn_search) -> torch.Tensor:
    """DINO weighted k-NN vote scores, shape (n_test, num_classes).

    Inputs may be numpy arrays or torch tensors (any device, any float dtype); features
    are L2-normalised inside, so pass them raw. The result is a float64 CPU tensor: the
    log of each class's vote (log sum of exp(sim/T), -inf for a class no neighbour votes
    for), which ranks the classes as the vote does for any T; its argmax is the
    prediction, ties going to the lower class index (torch.argmax). backend: auto | faiss
    | torch (same neighbours and scores either way, see eval/knn_search.py). search: the
    neighbour search, called as eval/knn_search.py's knn_search (the bench passes another
    version's to time it against this one).
    """
    temperature = check_temperature(temperature)
    sims, idx = search(train_features, test_features, k, backend, chunk_size, device, on_host=False)
    with phase("vote"):   # where the search ran: only the table crosses to the host
        labels = _labels(train_labels, len(train_features), num_classes, "train labels")
        return _vote(sims, idx, labels, num_classes, temperature)


def topk_correct(scores: torch.Tensor, labels: torch.Tensor, ks: Sequence[int] = (1, 5)) -> dict:
    """Percent of rows whose label is among the top-k scores (k capped at the class count),
    ranking by a stable sort so equal scores go to the lower class index."""
    order = scores.sort(dim=1, descending=True, stable=True).indices
    hits = order == labels.view(-1, 1)
    return {f"top{k}": 100.0 * hits[:, :min(k, scores.shape[1])].any(1).float().mean().item() for k in ks}


def knn_evaluate(train_features, train_labels, test_features, test_labels, num_classes: int,
                 ks=(10, 20, 100, 200), temperature: float = 0.07, backend: str = "auto",
                 chunk_size: int | None = None, device=None) -> dict:
    """{k: {'top1': %, 'top5': %}} for every k, from one search for max(k).

    top5 is top-min(5, num_classes). Neighbours are sorted canonically (see
    knn_search), so the first k of the max(k) neighbours are exactly the k nearest.
    Classes are ranked on the float64 log-votes; equal scores go to the lower class.
    """
    temperature = check_temperature(temperature)
    n_train = len(train_features)
    if n_train == 0:
        raise UserError("train features are empty: the train split has no images")
    ks = check_ks(ks, n_train)
    sims, idx = knn_search(train_features, test_features, max(ks), backend, chunk_size, device, on_host=False)
    ytr = _labels(train_labels, n_train, num_classes, "train labels")
    yte = _labels(test_labels, idx.shape[0], num_classes, "test labels")
    return {k: topk_correct(_vote(sims[:, :k], idx[:, :k], ytr, num_classes, temperature), yte)
            for k in ks}


# --------------------------------------------------------------------------- few labels

def knn_few_labels(train_features, train_labels, test_features, test_labels, num_classes: int, ks,
                   temperature: float, per_class, tries: int, seed: int = 0, backend: str = "auto",
                   chunk_size: int | None = None, device=None, class_names=None) -> dict:
    """knn_evaluate on `tries` class-balanced picks of n training images per class, for
    each n of per_class (knn.few_labels; eval/few_labels.py), the features given once.

    Returns {'per_class', 'tries', 'seed', 'std': ..., 'notes': [one line per n whose
    k were clipped or whose classes ran short], 'results': {n: {'bank': images per pick,
    'k': {k: {'k_used', 'top1', 'top1_std', 'top5', 'top5_std', 'tries': [{'top1',
    'top5'}]}}}}} with n and k as strings (JSON keys)."""
    ns = few_labels.sizes(per_class)
    ks = check_ks(ks, 2**62)
    ytr = torch.as_tensor(train_labels).reshape(-1).cpu()
    out = {"per_class": ns, "tries": int(tries), "seed": int(seed),
           "std": "sample standard deviation over the tries (ddof 1; null for one try)", "notes": [],
           "results": {}}
    for n in ns:
        banks = few_labels.picks(ytr, n, int(tries), seed)
        size = int(banks[0].numel())
        used = {k: min(k, size) for k in ks}
        clipped = [k for k in ks if used[k] < k]
        short = few_labels.short_classes(ytr, n, class_names)
        if clipped:
            out["notes"].append(f"n={n}: k={','.join(map(str, clipped))} clipped to the bank's {size} images")
        if short:
            out["notes"].append(short)
        runs = [knn_evaluate(train_features[bank], ytr[bank], test_features, test_labels, num_classes,
                             sorted(set(used.values())), temperature, backend, chunk_size, device)
                for bank in banks]
        out["results"][str(n)] = {"bank": size, "k": {
            str(k): {"k_used": used[k], **few_labels.summary([r[used[k]] for r in runs])} for k in ks}}
    return out


def format_few_labels(res: dict, whole: dict | None = None, n_train: int | None = None) -> str:
    """The few-label table: a row per (n, k), mean ± std over the tries; the whole bank's
    rows after them where given."""
    lines = [f"k-NN with few labels: n training images per class, {res['tries']} seeded class-balanced "
             f"picks each (seed {res['seed']}); mean ± sample std over the picks",
             f"{'n':>5}  {'bank':>7}  {'k':>5}  {'top-1':>6} ± {'std':<5}  {'top-5':>6} ± {'std':<5}"]
    for n, r in res["results"].items():
        for k, c in r["k"].items():
            k_shown = f"{k}*" if c["k_used"] != int(k) else k
            lines.append(f"{n:>5}  {r['bank']:>7}  {k_shown:>5}  {few_labels.cell(c, 'top1')}  "
                         f"{few_labels.cell(c, 'top5')}")
    for k, c in (whole or {}).items():
        lines.append(f"{'all':>5}  {n_train if n_train is not None else '':>7}  {k:>5}  {c['top1']:6.2f}{'':10}"
                     f"{c['top5']:6.2f}")
    if any(c["k_used"] != int(k) for r in res["results"].values() for k, c in r["k"].items()):
        lines.append("* k clipped to the bank (all of its images vote)")
    return "\n".join(lines + res["notes"])


# --------------------------------------------------------------------------- online (training)

# The eval images a trainer's k-NN keeps between calls (`online_knn(cache=...)`), at most:
# Fashion-MNIST and CIFAR fit (70k x 3 x 32 x 32 float32: 0.9 GB), ImageNet does not.
_CACHE_BYTES = 2 * 2**30


class _Caching:
    """The loader's batches on `device` as they pass to the extraction, kept in `cache[key]`
    once all n images have passed, when they fit in `budget` bytes (else cache[key] = False:
    do not try again). Kept while they pass, not before: the extraction's progress lines and
    stop checks come with the first batch."""

    def __init__(self, loader, n: int, device, cache: dict, key: str, budget: int):
        self.loader, self.n, self.device, self.cache, self.key, self.budget = loader, n, device, cache, key, budget
        self.sampler = getattr(loader, "sampler", None)  # extract_features counts its images

    def __iter__(self):
        kept = []
        for batch in self.loader:
            x = batch[0].to(self.device, non_blocking=True)
            y = torch.as_tensor(batch[1]).to(self.device, non_blocking=True)
            if kept is not None and not kept and x[:1].nbytes * self.n > self.budget:
                self.cache[self.key], kept = False, None
            if kept is not None:
                kept.append((x, y))
            yield x, y
        if kept is not None:  # every batch passed: an extraction cut short keeps nothing
            self.cache[self.key] = kept


def online_knn(model, data_cfg, device, ks=(20,), temperature: float = 0.07, batch_size: int = 256,
               num_workers: int = 0, backend: str = "auto", amp_dtype=None,
               train_split: str = "train", keep_features: bool = False, cache: dict | None = None,
               memory_gb=None) -> dict:
    """k-NN accuracy of a model being trained (e.g. the DINO teacher backbone), no cache.

    model: the backbone returning pooled features (num_classes=0), not DDP-wrapped;
    its train/eval mode is restored. batch_size is global (each process extracts its
    shard: dist.share). Every rank must call it (extraction is sharded);
    the search runs on rank 0 and the result is broadcast to all. Returns
    {'knn': {k: {'top1': %, 'top5': %}}, 'knn_k': the headline k (the largest k <= 20,
    DINO's k=20 by default), 'knn_top1', 'knn_top5' (at knn_k), 'n_train', 'n_test',
    'num_classes'}:
    log 'knn_top1' with the epoch in log.jsonl, which the viz command plots.
    keep_features: rank 0's result also holds 'features': {'train': (f, y), 'test': (f, y)}
    (CPU tensors, for a linear probe or a neighbours grid on the same extraction) and
    'datasets': {'train': ..., 'test': ...} (eval-transformed, the features' order); they
    are not broadcast.
    cache: a dict the caller keeps between calls (one process only): the first call puts
    each split's eval images there, on `device`, as the loader made them (when they fit in
    _CACHE_BYTES and the memory budget), and later calls extract from them in the same
    batches, with no dataset, workers or transforms: the same features, without the
    loader's cost at every call.
    memory_gb: features.memory_gb. The bank is planned before any feature is extracted
    (eval/memory.py): where the training split's features and the queries would pass the
    budget, the bank is a class-balanced subset of the training split (one line says so,
    once per cache), built afresh at every call rather than cached.
    """
    import resmlp.data as rdata
    from resmlp.eval.features import extract_features

    temperature = check_temperature(temperature)
    transform = rdata.build_eval_transform(data_cfg)
    device = torch.device(device)
    out, datasets = {}, {}
    keep = cache is not None and dist.world_size() == 1
    budget = memory.budget_bytes(memory_gb, device)
    splits = (train_split, "test")
    cached = {split: cache.get(split) if keep else None for split in splits}
    built = {split: rdata.build_dataset(data_cfg, split, transform=transform) for split in splits if not cached[split]}
    n_bank, n_train = _plan_bank(model, device, splits, ks, budget, memory_gb, cache, built, cached)
    for split in splits:
        sized = split == train_split and n_bank < n_train  # a subset: not the images a cache holds
        batches, ds = (None if sized else cached[split]), built.get(split)
        if not batches:
            ds = ds if ds is not None else rdata.build_dataset(data_cfg, split, transform=transform)
            if sized:
                ds = make_subset(ds, n_bank)
            batches = rdata.build_loader(ds, dist.share(batch_size), train=False, num_workers=num_workers, seed=0)
            if keep and not sized and split not in cache:
                room = _CACHE_BYTES if budget is None else min(_CACHE_BYTES, budget)
                batches = _Caching(batches, len(ds), device, cache, split, room)
        if keep_features:  # the pictures index the images themselves, cached batches or not
            datasets[split] = ds if ds is not None else rdata.build_dataset(data_cfg, split, transform=transform)
        out[split] = extract_features(model, batches, device, amp_dtype, desc=f"knn {split}")
    result = None
    if dist.is_main():
        (ftr, ytr), (fte, yte) = out[train_split], out["test"]
        ks = check_ks(ks, ftr.shape[0])
        n_cls = int(rdata.num_classes(data_cfg))
        res = knn_evaluate(ftr, ytr, fte, yte, n_cls, ks, temperature, backend)
        head = max([k for k in ks if k <= 20] or ks[:1])
        result = {"knn": res, "knn_k": head, "knn_top1": res[head]["top1"], "knn_top5": res[head]["top5"],
                  "n_train": int(ftr.shape[0]), "n_test": int(fte.shape[0]), "num_classes": n_cls}
    result = dist.broadcast_object(result)
    if keep_features and dist.is_main():
        result["features"] = {"train": out[train_split], "test": out["test"]}
        result["datasets"] = {"train": datasets[train_split], "test": datasets["test"]}
    return result


def _plan_bank(model, device, splits, ks, budget, memory_gb, cache: dict | None, built: dict,
               cached: dict) -> tuple[int, int]:
    """online_knn's bank before extraction (eval/memory.py): (the training images it keeps,
    the training split's images). `built`: the splits' datasets online_knn made, `cached`:
    their batches a cache kept. The split sizes are counted at the first call with a cache;
    the features' width is asked of every model (the same images serve the teacher and the
    raw pixels)."""
    counts = cache.get("counts") if cache is not None else None
    if counts is None:  # the first call: nothing cached yet, both splits built
        counts = tuple(len(built[split]) for split in splits)
        if cache is not None:
            cache["counts"] = counts
    n_train, n_test = counts
    if budget is None:
        return n_train, n_train
    image = built["test"][0][0] if "test" in built else cached["test"][0][0][0]
    from resmlp.eval import features
    width = features.feature_width(model, image, device)
    n_bank, line = memory.plan_bank(n_train, n_test, width, budget, memory_gb, least=max(check_ks(ks, 2**62)))
    said = cache.setdefault("said", set()) if cache is not None else set()
    if line and line not in said and dist.is_main():
        print(line, flush=True)
        said.add(line)
    return n_bank, n_train


# --------------------------------------------------------------------------- command

def protocol_line(temperature: float, data_name: str, split: str, n_test: int, n_train: int,
                  backend: str) -> str:
    return (f"k-NN (DINO protocol: cosine, T={temperature:g}, weighted votes) on {data_name} {split}, "
            f"{n_test} queries / {n_train} train, backend={backend}")


def format_table(results: dict) -> str:
    lines = [f"{'k':>5}  {'top-1':>7}  {'top-5':>7}"]
    for k, r in results.items():
        lines.append(f"{k:>5}  {r['top1']:7.2f}  {r['top5']:7.2f}")
    return "\n".join(lines)


def knn_command(cfg, bb) -> dict | None:
    """bash run.sh knn <ckpt | run dir | timm:<name>> [data=...] [k=10,20] [T=0.07] [key=teacher]
    [knn.few_labels=[1,5,10] knn.tries=5]"""
    from resmlp.core import dist
    from resmlp.eval.command import log, split_features

    train = split_features(cfg, bb, "train")
    test = split_features(cfg, bb, "test")
    if not dist.is_main():
        return None
    temperature, backend = check_temperature(cfg.knn.temperature), str(cfg.knn.backend)
    ks = check_ks(cfg.knn.k, train["features"].shape[0])
    bname = backend_name(backend, bb.device)
    res = knn_evaluate(train["features"], train["labels"], test["features"], test["labels"],
                       test["num_classes"], ks, temperature, backend, cfg.knn.chunk_size, bb.device)
    header = protocol_line(temperature, cfg.data.name, "test", test["features"].shape[0],
                           train["features"].shape[0], bname)
    log(header)
    log(format_table(res))
    report = {
        "protocol": {"name": "dino-knn", "similarity": "cosine (L2-normalised features)",
                     "votes": "sum of exp(sim/T) per class, ranked by its log (log-sum-exp)",
                     "temperature": temperature, "ks": ks, "backend": bname},
        "header": header,
        "data": {"name": cfg.data.name, "train": train["features"].shape[0],
                 "test": test["features"].shape[0], "num_classes": test["num_classes"],
                 "subset": cfg.data.subset},
        "features": {"dim": train["features"].shape[1], "train_cache": train["cache"],
                     "test_cache": test["cache"]},
        "results": {str(k): v for k, v in res.items()},
    }
    if few_labels.sizes(cfg.knn.few_labels):
        few = knn_few_labels(train["features"], train["labels"], test["features"], test["labels"],
                           test["num_classes"], ks, temperature, cfg.knn.few_labels, cfg.knn.tries,
                           int(cfg.seed), backend, cfg.knn.chunk_size, bb.device, train["classes"])
        log(format_few_labels(few, res, train["features"].shape[0]))
        report["few_labels"] = few
    return report


def check_knn_config(cfg) -> None:
    """Bad values fail before any feature is extracted (the numbers' ranges: the limits
    of the YAML files; what depends on the data set: here)."""
    from resmlp.data.datasets import check_split_classes
    check_temperature(cfg.knn.temperature)
    check_ks(cfg.knn.k, 2**62)
    check_split_classes(cfg.data)


def run(cfg) -> int:
    from resmlp.data.datasets import require_classes
    require_classes(cfg.data, "a k-NN accuracy")
    from resmlp.eval.command import eval_command
    check_knn_config(cfg)
    return eval_command(knn_command)(cfg)
