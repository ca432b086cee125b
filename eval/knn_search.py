"""The exact k nearest training features (cosine) of each test feature, on any backend.

Exactness and ties. Two backends find the neighbours: FAISS (IndexFlatIP, exact) and
torch (matmul + topk; a bf16 pass on a GPU). Their inner products differ in the last
bits, and neither says how it breaks ties, so the raw search is only a candidate generator:
    1. search k + margin candidates per query (any backend, any precision with a known
       rounding bound);
    2. recompute the candidates' similarities in float64 with one fixed piece of code
       (the cosine of the raw features, norms in float64, where the search runs: the CPU,
       or the GPU for torch there), and sort them by (-similarity, train index);
    3. if the last candidate's search similarity is within the search's rounding bound
       of the k-th float64 similarity, a neighbour may hide outside the candidate list:
       search again for those queries with 4x the candidates; once that reaches the
       whole train set, every training feature is re-ranked (no search).
The k neighbours, their order and the similarities therefore depend only on the features,
not on the backend, the device or the chunking: equal similarities (exact duplicate
training features) go to the lower train index.

Memory stays within `budget` bytes (a small multiple of it at the peak, besides the
search's own copy of the train features) for any candidate count: queries go in chunks
(no n_test x n_train matrix exists), a chunk's pass at c candidates takes as many queries
as c candidates each fit in the budget (`pass_rows`), and the float64 re-rank runs in
tiles of queries x candidates (`rerank_tile`), keeping a running top-k. A collapsed
network, whose features are all alike, sends every query to the whole train set: its
re-rank then streams over the train features in tiles instead of gathering n_train
float64 vectors per query.

On a GPU (torch) everything runs there: the raw features are copied once, normalised
there, the candidate pass is a bf16 matmul (fp32 accumulation) whose rows are reduced to
block maxima before the top-k (`_top_candidates`), and the float64 re-rank gathers the
candidates there; only the k neighbours come back.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import numpy as np
import torch

from resmlp.core.errors import UserError

BACKENDS = ("auto", "faiss", "torch")
BUDGET = 512 * 2**20   # bytes one block of the search may hold (similarities, candidates, a re-rank tile)
_MAX_CHUNK = 4096      # queries per chunk, whatever the budget allows
_CAND_BYTES = 24       # per (query, candidate) of a pass: its search similarity and index, twice while joined


def pair_bytes(d: int) -> int:
    """Bytes of a re-rank tile per (query, candidate): the gathered float32 candidate, its
    float64 copy and the product with the query (d values each, 20 d bytes in all, rounded
    up), and the similarity and index with their sorting copies."""
    return 24 * d + 64


def rerank_tile(rows: int, cols: int, d: int, budget: int) -> tuple[int, int]:
    """(queries, candidates) of one float64 re-rank tile: all of a query's `cols`
    candidates where one query's fit the budget (one sort, no merging), and as many
    queries as the budget then holds."""
    per = pair_bytes(d)
    tc = min(cols, max(1, budget // per))
    return min(rows, max(1, budget // (per * tc))), tc


def pass_rows(kc: int, budget: int) -> int:
    """Queries of one candidate pass at kc candidates each."""
    return max(1, budget // (kc * _CAND_BYTES))


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


class _Search:
    """What both backends share: the raw train features and their float64 inverse norms
    where the re-rank runs (`device`), and the budget."""

    max_k: int | None = None   # the most candidates one search call can return (None: any)

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int):
        self.device, self.budget = device, budget
        self.train = train.to(device)                                    # raw, float32: the re-rank's
        self.inv_norm = _inverse_norms(self.train, budget)


class _TorchSearch(_Search):
    """Candidates by matmul + top-k where the features live (CPU or GPU), and the exact
    re-rank there too. On a GPU the candidate pass runs in bf16 with float32 sums: the
    unit vectors' rounding bounds its error (`tolerance`), which is all the exactness
    check of knn_search needs."""

    DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}   # the candidate pass, per device type
    BLOCK = 64    # columns per block maximum (_top_candidates)

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int = BUDGET):
        super().__init__(train, device, budget)
        self.dtype = self.DTYPES.get(device.type, torch.float32)
        self.unit = normalize(self.train).to(self.dtype)                 # the candidate pass's

    def rows_for(self, kc: int) -> int:
        """Queries per matmul at kc candidates: a row holds its n similarities, and the
        top-k's working copies (the block maxima's columns, or a full top-k's sort)."""
        n, size = self.unit.shape[0], self.unit.element_size()
        if n // self.BLOCK > kc:
            row = n * size + kc * self.BLOCK * (size + 17)
        else:
            row = n * (2 * size + 16)
        return max(1, min(_MAX_CHUNK, self.budget // row))

    def tolerance(self, d: int) -> float:
        """A bound, with a factor 2 to spare, on |candidate-pass similarity - exact| for
        unit vectors: operand rounding (2u, since sum |q_i t_i| <= 1), float32 accumulation
        over d terms, and the result's rounding to the pass's dtype (u)."""
        u = _UNIT[self.dtype]
        return 2.0 * (3.0 * u + d * 2.0**-24)

    def __call__(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sims, idx = [], []
        unit = normalize(q.to(self.device)).to(self.dtype)
        rows = self.rows_for(k)
        with torch.no_grad(), _matmul_precision("highest"), _fp32_accumulation():
            for s in range(0, unit.shape[0], rows):
                v, i = _top_candidates(unit[s:s + rows] @ self.unit.T, k, self.BLOCK)
                sims.append(v)
                idx.append(i)
        return torch.cat(sims), torch.cat(idx)


class _FaissSearch(_Search):
    GPU_MAX_K = 2048   # faiss's GPU indexes select at most this many neighbours per query

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int = BUDGET):
        super().__init__(train, torch.device("cpu"), budget)   # its results and the re-rank: on the CPU
        faiss = _faiss()
        d = train.shape[1]
        if device.type == "cuda":
            self.res = faiss.StandardGpuResources()
            conf = faiss.GpuIndexFlatConfig()
            conf.device = device.index or 0
            self.index = faiss.GpuIndexFlatIP(self.res, d, conf)
            self.max_k = self.GPU_MAX_K
        else:
            self.index = faiss.IndexFlatIP(d)
        self.index.add(normalize(train).numpy())

    def tolerance(self, d: int) -> float:
        return 2.0 * (2.0 * 2.0**-24 + d * 2.0**-24)

    def rows_for(self, kc: int) -> int:
        return _MAX_CHUNK

    def __call__(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        sims, idx = self.index.search(normalize(q).numpy(), k)
        return torch.from_numpy(sims), torch.from_numpy(idx).long()


# --------------------------------------------------------------------------- exact re-rank

def _inverse_norms(x: torch.Tensor, budget: int = BUDGET) -> torch.Tensor:
    """1 / |x_i| in float64 (0 for a zero row, as F.normalize leaves it at 0), in chunks."""
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    rows = max(1, budget // (16 * max(1, x.shape[1])))
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


def _rerank(search: _Search, q: torch.Tensor, cand: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most similar of each query's candidates (cand: (r, c) train indices; None:
    the whole train set), float64 similarities and indices in canonical order.

    Tiles of rerank_tile's shape; a query's candidates that take several tiles are merged
    into a running top-k (the canonical order is total, so the top k of a union is the top
    k of the tops). Every tile of a query has the same shape (the last one padded, its
    padding last in the order), so that a device whose reductions depend on the shape
    still gives duplicates the same bits."""
    n, d = search.train.shape
    r, c = q.shape[0], (n if cand is None else cand.shape[1])
    tr, tc = rerank_tile(r, c, d, search.budget)
    q = q.to(search.device)
    q_inv = _inverse_norms(q, search.budget)
    out_s = torch.empty(r, k, dtype=torch.float64, device=search.device)
    out_i = torch.empty(r, k, dtype=torch.int64, device=search.device)
    offsets = torch.arange(tc, device=search.device)
    for a in range(0, r, tr):
        rows = slice(a, min(a + tr, r))
        best_s = best_i = None
        for b in range(0, c, tc):
            cols = offsets + b
            pad = cols >= c
            cols = cols.clamp_max(c - 1)
            idx = cols.expand(rows.stop - a, tc) if cand is None else cand[rows][:, cols]
            sims = _exact_similarities(q[rows], q_inv[rows], search.train, search.inv_norm, idx)
            if b + tc > c:   # the padded last tile
                sims, idx = sims.masked_fill(pad, float("-inf")), idx.masked_fill(pad, n)
            if best_s is not None:
                sims, idx = torch.cat([best_s, sims], 1), torch.cat([best_i, idx], 1)
            sims, idx = _canonical_order(sims, idx)
            best_s, best_i = sims[:, :k], idx[:, :k]
        out_s[rows], out_i[rows] = best_s, best_i
    return out_s, out_i


# --------------------------------------------------------------------------- search

def knn_search(train_features, test_features, k: int, backend: str = "auto",
               chunk_size: int | None = None, device=None,
               budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest training features (cosine) of every test feature.

    Returns (similarities float64, indices int64), CPU tensors of shape (n_test, k),
    each row sorted by (-similarity, train index); features are L2-normalised inside.
    chunk_size: queries per chunk (default: what fits the memory budget); the result
    does not depend on it. device: where the search runs (default: the GPU if any).
    budget: bytes one block may hold (default BUDGET; see the module docstring).
    """
    name, dev = resolve_backend(backend, device)
    budget = int(budget or BUDGET)
    where = dev if name == "torch" else torch.device("cpu")   # where the features are searched
    train = _features(train_features, "train features", where)
    test = _features(test_features, "test features", where)
    if train.shape[1] != test.shape[1]:
        raise UserError(f"train features have dim {train.shape[1]}, test features {test.shape[1]}: "
                        "they must come from the same backbone")
    n, d = train.shape
    k = check_ks([k], n)[0]
    search = (_FaissSearch if name == "faiss" else _TorchSearch)(train, dev, budget)
    # A training feature whose candidate-pass similarity is below (k-th exact - tol)
    # cannot be among the k nearest: tol bounds the candidate pass's rounding.
    tol = search.tolerance(d)
    # a coarser pass needs more candidates for its check to pass at once
    margin = max(8, k // 2) if tol < 1e-4 else max(16, k) if tol < 1e-2 else max(64, 4 * k)
    first = min(n, k + margin)
    if chunk_size is None:  # one candidate matmul per chunk: a remainder would read the train features again
        chunk_size = min(pass_rows(first, budget), search.rows_for(first))
    chunk_size = int(max(1, min(_MAX_CHUNK, chunk_size)))

    at = search.device   # results stay there until the end: one copy back, not one per chunk
    out_s = torch.empty(test.shape[0], k, dtype=torch.float64, device=at)
    out_i = torch.empty(test.shape[0], k, dtype=torch.int64, device=at)
    for start in range(0, test.shape[0], chunk_size):
        pending = torch.arange(start, min(start + chunk_size, test.shape[0]), device=test.device)
        kc = first
        while pending.numel():
            whole = kc >= n or (search.max_k is not None and kc > search.max_k)
            per = pending.numel() if whole else pass_rows(kc, budget)
            left = []
            for s in range(0, pending.numel(), per):
                rows = pending[s:s + per]
                q = test[rows]
                if whole:   # every training feature is a candidate: re-rank them all, no search
                    exact, cand = _rerank(search, q, None, k)
                    done = torch.ones(rows.numel(), dtype=torch.bool, device=at)
                else:       # the search's last (smallest) candidate must be clearly below the k-th
                    approx, cand = search(q, kc)
                    exact, cand = _rerank(search, q, cand.to(at), k)
                    done = approx[:, -1].to(at, torch.float64) < exact[:, k - 1] - tol
                mine = rows.to(at)[done]
                out_s[mine] = exact[done]
                out_i[mine] = cand[done]
                left.append(rows[~done.to(rows.device)])
            pending = torch.cat(left)
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
