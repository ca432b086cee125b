"""Weighted k-NN classification of frozen features (DINO's eval_knn.py protocol).

Protocol: features are L2-normalised here (callers pass raw features), similarity is
the cosine (inner product of unit vectors), the k most similar training features vote
for their label with weight exp(sim / T), votes are summed per class; top-1 / top-5 of
those scores. DINO's defaults: k = 20 (also 10, 100, 200), T = 0.07.

Exactness and ties. Two backends find the neighbours: FAISS (IndexFlatIP, exact) and
torch (matmul + topk; TF32 on a GPU). Their inner products differ in the last bits, and
neither says how it breaks ties, so the raw search is only a candidate generator:
    1. search k + margin candidates per query (any backend, any precision with a known
       rounding bound);
    2. recompute the candidates' similarities in float64 with one fixed piece of code
       (the cosine of the raw features, norms in float64, where the search runs: the CPU,
       or the GPU for torch there), and sort them by (-similarity, train index);
    3. if the last candidate's search similarity is within the search's rounding bound
       of the k-th float64 similarity, a neighbour may hide outside the candidate list:
       search again for those queries with more candidates (up to the whole train set).
The k neighbours, their order and the scores therefore depend only on the features,
not on the backend, the device or the chunking: equal similarities (exact duplicate
training features) go to the lower train index, and equal class scores to the lower
class index.

Memory stays bounded: queries are processed in chunks so that no n_test x n_train
matrix exists; a torch chunk holds at most `_CHUNK_BYTES` of similarities (1.28M x 384
ImageNet train features: a few hundred queries at a time, ~4 GB of features in host memory).

On a GPU (torch) everything runs there: the raw features are copied once, normalised
there, the candidate pass is a bf16 matmul (fp32 accumulation) whose rows are reduced to
block maxima before the top-k (`_top_candidates`), and the float64 re-rank gathers the
candidates there; only the k neighbours come back.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from resmlp.core.errors import UserError

BACKENDS = ("auto", "faiss", "torch")
_CHUNK_BYTES = 512 * 2**20   # similarity block (torch) / float64 candidate block per query chunk
_MAX_CHUNK = 4096             # queries per chunk, whatever the budget allows


# --------------------------------------------------------------------------- inputs

def _as_tensor(x, name: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except Exception:
            raise UserError(f"{name} must be a numpy array or torch tensor, not {type(x).__name__}") from None
    return x.detach().to(device, dtype)


def _features(x, name: str, device="cpu") -> torch.Tensor:
    """Raw features as float32 on `device`, checked."""
    x = _as_tensor(x, name, device=device)
    if x.ndim != 2:
        raise UserError(f"{name} must be 2-D (n, dim), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise UserError(f"{name} is empty: the split has no images; check data.root / data.subset")
    if not torch.isfinite(x).all():
        raise UserError(f"{name} holds NaN or inf values; the backbone's features are broken")
    return x


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Unit rows in float32, where x is: what the candidate passes search (the exact
    re-rank normalises in float64 itself)."""
    return torch.nn.functional.normalize(x.float(), dim=1, eps=1e-12).contiguous()


def _labels(y, n: int, num_classes: int, name: str) -> torch.Tensor:
    y = _as_tensor(y, name, torch.int64).reshape(-1)
    if y.shape[0] != n:
        raise UserError(f"{name} has {y.shape[0]} labels for {n} features")
    if n and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise UserError(f"{name} holds labels outside 0..{num_classes - 1}; check num_classes")
    return y


def check_ks(ks, n_train: int, key: str = "knn.k") -> list[int]:
    """k values as a sorted list of ints; accepts 20, [10, 20], "10,20". `key`: the config
    key the messages name (the one the user sets)."""
    if isinstance(ks, str):
        ks = [v for v in ks.replace(" ", "").strip("[]").split(",") if v]
    elif not isinstance(ks, Iterable):
        ks = [ks]
    out = []
    for k in ks:
        try:
            kf = float(k)
        except (TypeError, ValueError):
            raise UserError(f"{key}={k!r} is not an integer; use e.g. {key}=20 or {key}=10,20") from None
        if kf != int(kf):
            raise UserError(f"{key}={k!r} is not an integer; use e.g. {key}=20 or {key}=10,20")
        k = int(kf)
        if k <= 0:
            raise UserError(f"{key}={k} must be positive")
        if k > n_train:
            raise UserError(f"{key}={k} is larger than the train set ({n_train} images); use {key}={n_train} "
                            "or less")
        out.append(k)
    if not out:
        raise UserError(f"no k given; use e.g. {key}=20 or {key}=10,20")
    return sorted(set(out))


def check_temperature(temperature) -> float:
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise UserError(f"T={temperature!r} is not a number; use e.g. T=0.07") from None
    if not t > 0 or not math.isfinite(t):
        raise UserError(f"T={temperature} must be a positive number (DINO uses 0.07)")
    return t


# --------------------------------------------------------------------------- backends

_FAISS_GPU_OK: dict[int, bool] = {}


def _faiss():
    try:
        import faiss  # noqa: F401
        return faiss
    except ImportError:
        return None


def faiss_gpu_works(device_index: int = 0) -> bool:
    """Whether FAISS's GPU flat index runs, exactly, on this GPU (probed once per device).

    faiss-gpu wheels are built for a few GPU generations only (no H100/H200 kernels:
    "no kernel image is available"), and a GPU index that rounds through TF32 would
    not be exact; either way we fall back to torch on the GPU.
    """
    if device_index in _FAISS_GPU_OK:
        return _FAISS_GPU_OK[device_index]
    ok = False
    faiss = _faiss()
    if faiss is not None and torch.cuda.is_available() and hasattr(faiss, "StandardGpuResources"):
        try:
            if faiss.get_num_gpus() > device_index:
                g = torch.Generator().manual_seed(0)
                xb = normalize(torch.randn(2000, 64, generator=g)).numpy()
                xq = normalize(torch.randn(64, 64, generator=g)).numpy()
                res = faiss.StandardGpuResources()
                conf = faiss.GpuIndexFlatConfig()
                conf.device = device_index
                index = faiss.GpuIndexFlatIP(res, 64, conf)
                index.add(xb)
                sims, idx = index.search(xq, 10)
                exact = np.einsum("qd,qkd->qk", xq.astype(np.float64), xb[idx].astype(np.float64))
                ok = bool((idx >= 0).all() and np.abs(sims - exact).max() < 1e-5)
        except Exception:  # noqa: BLE001 - any failure means "not on this GPU"
            ok = False
    _FAISS_GPU_OK[device_index] = ok
    return ok


def resolve_backend(backend: str = "auto", device=None) -> tuple[str, torch.device]:
    """('faiss' | 'torch', device) that `backend` means on this machine.

    auto: on a GPU, FAISS's GPU index if `faiss_gpu_works`, else torch on the GPU;
    without one, FAISS on the CPU if installed, else torch on the CPU.
    faiss: FAISS on the GPU when it works there, else on the CPU.
    """
    if backend not in BACKENDS:
        raise UserError(f"knn.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gpu = device.type == "cuda"
    if backend == "torch":
        return "torch", device
    have_faiss = _faiss() is not None
    if backend == "faiss" and not have_faiss:
        raise UserError("knn.backend=faiss but faiss is not installed; pip install faiss-cpu, "
                        "or use knn.backend=torch")
    if gpu and have_faiss and faiss_gpu_works(device.index):
        return "faiss", device
    if backend == "faiss" or (not gpu and have_faiss):
        return "faiss", torch.device("cpu")
    return "torch", device


def backend_name(backend: str = "auto", device=None) -> str:
    """What `backend` resolves to, for reports: faiss-cpu, faiss-gpu, torch-cpu, torch-cuda."""
    name, dev = resolve_backend(backend, device)
    return f"{name}-{'gpu' if name == 'faiss' and dev.type == 'cuda' else dev.type}"


@contextlib.contextmanager
def _matmul_precision(precision: str):
    """torch's float32 matmul precision for the duration ('highest': true float32;
    'high': TF32 on the GPU's tensor cores)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


# Relative rounding of one operand (round to nearest: half of these; counted in full).
_UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@contextlib.contextmanager
def _fp32_accumulation():
    """cuBLAS may sum bf16 products in reduced precision unless told not to; the rounding
    bound below assumes float32 sums."""
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old


def _top_candidates(sims: torch.Tensor, k: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sims.topk(k, dim=1), values exact, found through block maxima: every value above the
    k-th largest lies in a block whose maximum is among the k largest maxima (fewer than k
    values exceed it), so the top k of those k blocks are the top k of the row. Any k values
    tied at the k-th may be returned, as with topk. One pass over the row for the maxima
    instead of torch.topk's several over a row of a million values."""
    r, n = sims.shape
    full = n // block
    if full <= k or block <= 1:
        return sims.topk(k, dim=1)
    maxima = sims.unfold(1, block, block).amax(2)   # a strided view of the full blocks: no copy
    if n > full * block:
        maxima = torch.cat([maxima, sims[:, full * block:].amax(1, keepdim=True)], dim=1)
    cols = (maxima.topk(k, dim=1).indices.unsqueeze(2) * block
            + torch.arange(block, device=sims.device)).reshape(r, k * block)
    inside = cols < n
    values = sims.gather(1, cols.clamp_max(n - 1)).masked_fill(~inside, float("-inf"))
    top, where = values.topk(k, dim=1)
    return top, cols.gather(1, where)


class _TorchSearch:
    """Candidates by matmul + top-k where the features live (CPU or GPU), and the exact
    re-rank there too. On a GPU the candidate pass runs in bf16 with float32 sums: the
    unit vectors' rounding bounds its error (`tolerance`), which is all the exactness
    check of knn_search needs."""

    DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}   # the candidate pass, per device type
    BLOCK = 64    # columns per block maximum (_top_candidates)

    def __init__(self, train: torch.Tensor, device: torch.device):
        self.device = device
        self.train = train.to(device)                                    # raw, float32: the re-rank's
        self.inv_norm = _inverse_norms(self.train)
        self.dtype = self.DTYPES.get(device.type, torch.float32)
        self.unit = normalize(self.train).to(self.dtype)                 # the candidate pass's
        n = train.shape[0]
        self.rows = max(1, min(_MAX_CHUNK, _CHUNK_BYTES // (self.unit.element_size() * n)))

    def tolerance(self, d: int) -> float:
        """A bound, with a factor 2 to spare, on |candidate-pass similarity - exact| for
        unit vectors: operand rounding (2u, since sum |q_i t_i| <= 1), float32 accumulation
        over d terms, and the result's rounding to the pass's dtype (u)."""
        u = _UNIT[self.dtype]
        return 2.0 * (3.0 * u + d * 2.0**-24)

    def __call__(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sims, idx = [], []
        unit = normalize(q.to(self.device)).to(self.dtype)
        with torch.no_grad(), _matmul_precision("highest"), _fp32_accumulation():
            for s in range(0, unit.shape[0], self.rows):
                v, i = _top_candidates(unit[s:s + self.rows] @ self.unit.T, k, self.BLOCK)
                sims.append(v)
                idx.append(i)
        return torch.cat(sims), torch.cat(idx)

    def exact(self, q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        q = q.to(self.device)
        return _exact_similarities(q, _inverse_norms(q), self.train, self.inv_norm, idx)


class _FaissSearch:
    def __init__(self, train: torch.Tensor, device: torch.device):
        faiss = _faiss()
        d = train.shape[1]
        self.train = train
        self.device = torch.device("cpu")   # where its results (and the re-rank) live
        if device.type == "cuda":
            self.res = faiss.StandardGpuResources()
            conf = faiss.GpuIndexFlatConfig()
            conf.device = device.index or 0
            self.index = faiss.GpuIndexFlatIP(self.res, d, conf)
        else:
            self.index = faiss.IndexFlatIP(d)
        self.index.add(normalize(train).numpy())
        self.inv_norm = _inverse_norms(train)

    def tolerance(self, d: int) -> float:
        return 2.0 * (2.0 * 2.0**-24 + d * 2.0**-24)

    def __call__(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sims, idx = self.index.search(normalize(q).numpy(), k)
        return torch.from_numpy(sims), torch.from_numpy(idx).long()

    def exact(self, q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return _exact_similarities(q, _inverse_norms(q), self.train, self.inv_norm, idx)


def _inverse_norms(x: torch.Tensor, rows: int = 65536) -> torch.Tensor:
    """1 / |x_i| in float64 (0 for a zero row, as F.normalize leaves it at 0), in chunks."""
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], rows):
        norm = torch.linalg.vector_norm(x[s:s + rows].double(), dim=1)
        out[s:s + rows] = torch.where(norm > 0, 1.0 / norm, torch.zeros_like(norm))
    return out


def _exact_similarities(q: torch.Tensor, q_inv: torch.Tensor, train: torch.Tensor, train_inv: torch.Tensor,
                        idx: torch.Tensor) -> torch.Tensor:
    """float64 cosines of each query with its candidates from the raw features, by one
    fixed computation (elementwise product + row sum, times the float64 inverse norms) so
    identical vectors get bit-identical values."""
    cand = train[idx].double()                                  # (q, c, d)
    dots = (cand * q.double().unsqueeze(1)).sum(-1)             # (q, c)
    return dots * train_inv[idx] * q_inv.unsqueeze(1)


def _canonical_order(sims: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by (-similarity, index): index ascending first, then a stable sort."""
    o = idx.argsort(dim=1)
    idx, sims = idx.gather(1, o), sims.gather(1, o)
    o = sims.sort(dim=1, descending=True, stable=True).indices
    return sims.gather(1, o), idx.gather(1, o)


def knn_search(train_features, test_features, k: int, backend: str = "auto",
               chunk_size: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest training features (cosine) of every test feature.

    Returns (similarities float64, indices int64), CPU tensors of shape (n_test, k),
    each row sorted by (-similarity, train index); features are L2-normalised inside.
    chunk_size: queries per chunk (default: what fits the memory budget); the result
    does not depend on it. device: where the search runs (default: the GPU if any).
    """
    name, dev = resolve_backend(backend, device)
    where = dev if name == "torch" else torch.device("cpu")   # where the features are searched
    train = _features(train_features, "train features", where)
    test = _features(test_features, "test features", where)
    if train.shape[1] != test.shape[1]:
        raise UserError(f"train features have dim {train.shape[1]}, test features {test.shape[1]}: "
                        "they must come from the same backbone")
    n, d = train.shape
    k = check_ks([k], n)[0]
    search = (_FaissSearch if name == "faiss" else _TorchSearch)(train, dev)
    # A training feature whose candidate-pass similarity is below (k-th exact - tol)
    # cannot be among the k nearest: tol bounds the candidate pass's rounding.
    tol = search.tolerance(d)
    # a coarser pass needs more candidates for its check to pass at once
    margin = max(8, k // 2) if tol < 1e-4 else max(16, k) if tol < 1e-2 else max(64, 4 * k)
    if chunk_size is None:
        chunk_size = _CHUNK_BYTES // (16 * d * min(n, 4 * (k + margin)))
        # one candidate matmul per chunk: a remainder would read the train features again
        chunk_size = min(chunk_size, getattr(search, "rows", chunk_size))
    chunk_size = int(max(1, min(_MAX_CHUNK, chunk_size)))

    at = search.device   # results stay there until the end: one copy back, not one per chunk
    out_s = torch.empty(test.shape[0], k, dtype=torch.float64, device=at)
    out_i = torch.empty(test.shape[0], k, dtype=torch.int64, device=at)
    for start in range(0, test.shape[0], chunk_size):
        rows = torch.arange(start, min(start + chunk_size, test.shape[0]), device=test.device)
        kc = min(n, k + margin)
        while rows.numel():
            q = test[rows]
            approx, cand = search(q, kc)
            cand = cand.to(at)
            exact, cand = _canonical_order(search.exact(q, cand), cand)
            if kc >= n:
                done = torch.ones(rows.numel(), dtype=torch.bool, device=at)
            else:  # the search's last (smallest) candidate must be clearly below the k-th
                done = approx[:, -1].to(at, torch.float64) < exact[:, k - 1] - tol
            mine = rows.to(at)[done]
            out_s[mine] = exact[done, :k]
            out_i[mine] = cand[done, :k]
            rows = rows[~done.to(rows.device)]
            kc = min(n, 4 * kc)
    return out_s.cpu(), out_i.cpu()


def query_neighbours(train_features, test_features, queries, k: int, backend: str = "auto",
                     device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(similarities, train indices), each (len(queries), k): the neighbours the evaluator's
    search gives the test features at `queries`, for pictures of what the k-NN votes with.
    A row of knn_search depends only on its own query (exact re-rank, canonical order), so
    these equal the rows knn_evaluate and online_knn vote with."""
    test = _features(test_features, "test features")
    q = torch.as_tensor(queries, dtype=torch.int64).reshape(-1)
    if q.numel() == 0 or int(q.min()) < 0 or int(q.max()) >= test.shape[0]:
        raise UserError(f"query indices must lie in 0..{test.shape[0] - 1} (the test split)")
    return knn_search(train_features, test[q], k, backend, device=device)


# --------------------------------------------------------------------------- votes

def _vote(sims: torch.Tensor, idx: torch.Tensor, train_labels: torch.Tensor, num_classes: int,
          temperature: float) -> torch.Tensor:
    """Scores (n, C) float64: sum over neighbours of exp(sim / T) into their class."""
    weights = (sims.double() / temperature).exp()
    scores = torch.zeros(sims.shape[0], num_classes, dtype=torch.float64)
    scores.scatter_add_(1, train_labels[idx], weights)
    return scores


def knn_classify(train_features, train_labels, test_features, num_classes: int, k: int = 20,
                 temperature: float = 0.07, backend: str = "auto",
                 chunk_size: int | None = None, device=None) -> torch.Tensor:
    """DINO weighted k-NN vote scores, shape (n_test, num_classes).

    Inputs may be numpy arrays or torch tensors (any device, any float dtype); features
    are L2-normalised inside, so pass them raw. The result is always a float32 CPU torch
    tensor (sums of exp(sim/T), computed in float64); its argmax is the prediction, with
    ties going to the lower class index (torch.argmax). backend: auto | faiss | torch
    (same neighbours and scores either way, see the module docstring).
    """
    temperature = check_temperature(temperature)
    sims, idx = knn_search(train_features, test_features, k, backend, chunk_size, device)
    labels = _labels(train_labels, len(train_features), num_classes, "train labels")
    return _vote(sims, idx, labels, num_classes, temperature).float()


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
    Classes are ranked on the float64 scores; equal scores go to the lower class.
    """
    temperature = check_temperature(temperature)
    n_train = len(train_features)
    if n_train == 0:
        raise UserError("train features are empty: the train split has no images")
    ks = check_ks(ks, n_train)
    sims, idx = knn_search(train_features, test_features, max(ks), backend, chunk_size, device)
    ytr = _labels(train_labels, n_train, num_classes, "train labels")
    yte = _labels(test_labels, idx.shape[0], num_classes, "test labels")
    return {k: topk_correct(_vote(sims[:, :k], idx[:, :k], ytr, num_classes, temperature), yte)
            for k in ks}


# --------------------------------------------------------------------------- online (training)

# The eval images a trainer's k-NN keeps between calls (`online_knn(cache=...)`), at most:
# Fashion-MNIST and CIFAR fit (70k x 3 x 32 x 32 float32: 0.9 GB), ImageNet does not.
_CACHE_BYTES = 2 * 2**30


def _cached_batches(loader, n: int, device, cache: dict, key: str, budget: int):
    """The loader's batches on `device`, kept in `cache[key]`, when all n images fit in
    `budget` bytes; else the loader itself (and cache[key] = False: do not try again)."""
    batches = []
    for batch in loader:
        x, y = batch[0].to(device, non_blocking=True), torch.as_tensor(batch[1]).to(device, non_blocking=True)
        if not batches and x[:1].nbytes * n > budget:
            cache[key] = False
            return loader
        batches.append((x, y))
    cache[key] = batches
    return batches


def online_knn(model, data_cfg, device, ks=(20,), temperature: float = 0.07, batch_size: int = 256,
               num_workers: int = 0, backend: str = "auto", amp_dtype=None,
               train_split: str = "train", keep_features: bool = False, cache: dict | None = None) -> dict:
    """k-NN accuracy of a model being trained (e.g. the DINO teacher backbone), no cache.

    model: the backbone returning pooled features (num_classes=0), not DDP-wrapped;
    its train/eval mode is restored. batch_size is global (each process extracts its
    shard: dist.share). Every rank must call it (extraction is sharded);
    the search runs on rank 0 and the result is broadcast to all. Returns
    {'knn': {k: {'top1': %, 'top5': %}}, 'knn_k': the headline k (the largest k <= 20,
    DINO's k=20 by default), 'knn_top1', 'knn_top5' (at knn_k), 'n_train', 'n_test'}:
    log 'knn_top1' with the epoch in log.jsonl, which the viz command plots.
    keep_features: rank 0's result also holds 'features': {'train': (f, y), 'test': (f, y)}
    (CPU tensors, for a linear probe or a neighbours grid on the same extraction) and
    'datasets': {'train': ..., 'test': ...} (eval-transformed, the features' order); they
    are not broadcast.
    cache: a dict the caller keeps between calls (one process only): the first call puts
    each split's eval images there, on `device`, as the loader made them (when they fit in
    _CACHE_BYTES), and later calls extract from them in the same batches, with no dataset,
    workers or transforms: the same features, without the loader's cost at every call.
    """
    import resmlp.data as rdata
    from resmlp.core import dist
    from resmlp.eval.features import extract_features

    temperature = check_temperature(temperature)
    transform = rdata.build_eval_transform(data_cfg)
    device = torch.device(device)
    out, datasets = {}, {}
    keep = cache is not None and dist.world_size() == 1
    for split in (train_split, "test"):
        batches, ds = (cache.get(split) if keep else None), None
        if not batches:
            ds = rdata.build_dataset(data_cfg, split, transform=transform)
            batches = rdata.build_loader(ds, dist.share(batch_size), train=False, num_workers=num_workers, seed=0)
            if keep and split not in cache:
                batches = _cached_batches(batches, len(ds), device, cache, split, _CACHE_BYTES)
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
                  "n_train": int(ftr.shape[0]), "n_test": int(fte.shape[0])}
    result = dist.broadcast_object(result)
    if keep_features and dist.is_main():
        result["features"] = {"train": out[train_split], "test": out["test"]}
        result["datasets"] = {"train": datasets[train_split], "test": datasets["test"]}
    return result


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
    """bash run.sh knn <ckpt | run dir | timm:<name>> [data=...] [k=10,20] [T=0.07] [key=teacher]"""
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
    return {
        "protocol": {"name": "dino-knn", "similarity": "cosine (L2-normalised features)",
                     "votes": "sum of exp(sim/T) per class", "temperature": temperature,
                     "ks": ks, "backend": bname},
        "header": header,
        "data": {"name": cfg.data.name, "train": train["features"].shape[0],
                 "test": test["features"].shape[0], "num_classes": test["num_classes"],
                 "subset": cfg.data.subset},
        "features": {"dim": train["features"].shape[1], "train_cache": train["cache"],
                     "test_cache": test["cache"]},
        "results": {str(k): v for k, v in res.items()},
    }


def check_knn_config(cfg) -> None:
    """Bad values fail before any feature is extracted."""
    check_temperature(cfg.knn.temperature)
    check_ks(cfg.knn.k, 2**62)
    if str(cfg.knn.backend) not in BACKENDS:
        raise UserError(f"knn.backend={cfg.knn.backend!r} is not one of {', '.join(BACKENDS)}")


def run(cfg) -> int:
    from resmlp.data.datasets import require_classes
    require_classes(cfg.data, "a k-NN accuracy")
    from resmlp.eval.command import eval_command
    check_knn_config(cfg)
    return eval_command(knn_command)(cfg)
