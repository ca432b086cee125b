"""The exact k nearest training features (cosine) of each test feature, on any backend.

Exactness and ties. Two backends find the neighbours: FAISS (IndexFlatIP, exact) and
torch (matmul + top-k; a float16 pass on a GPU). Their inner products differ in the last
bits, and neither says how it breaks ties, so the raw search is only a candidate generator:
    1. search kc = k + margin candidates per query (any backend, any precision whose
       rounding is bounded), with a ceiling: a float64 value that no left-out training
       feature's exact cosine exceeds (the last candidate's search value plus the bound);
    2. recompute the candidates' similarities in float64 with one fixed piece of code
       (the cosine of the raw features, norms in float64, where the search runs: the CPU,
       or the GPU for torch there), and sort them by (-similarity, train index);
    3. a query whose k-th float64 similarity is above its ceiling has its k neighbours:
       every left-out feature is strictly less similar. The others are searched again,
       all together, with 4x the candidates; once that reaches the whole train set, every
       training feature is re-ranked (no search).
The k neighbours, their order and the similarities therefore depend only on the features,
not on the backend, the device, the dtype or the chunking: equal similarities (exact
duplicate training features) go to the lower train index.

Memory stays within `budget` bytes (a small multiple of it at the peak, besides the
search's own copy of the train features) for any candidate count: queries go in chunks
(no n_test x n_train matrix exists), a chunk's pass at c candidates takes as many queries
as c candidates each fit in the budget (`pass_rows`), the pass itself goes over tiles of
queries x train columns (`_TorchSearch.tile`) and recomputes its candidates in slices of
queries (`_TorchSearch.recompute_rows`), the inputs are checked in slices, and the float64
re-rank runs in tiles of
queries x candidates (`rerank_tile`), keeping a running top-k. A collapsed network, whose
features are all alike, sends every query to the whole train set: its re-rank then
streams over the train features in tiles instead of gathering n_train float64 vectors
per query.

On a GPU (torch) everything runs there: the raw features are copied once and made unit
vectors there in float16, each row's rounding measured (`unit_rows`); the candidate pass
is a float16 matmul (float32 sums) per tile of a query chunk x tens of thousands of train
columns, whose similarities are written once and read once, for the maxima of blocks of
columns; one top-k per chunk picks its best blocks, whose columns are computed again
(`_TorchSearch`); the float64 re-rank gathers the candidates there; there is no host
sync but one per round of step 3 (and the input checks); only the k neighbours come back.

Where the time goes: the search's phases are torch.profiler spans (`phase`: SPANS + a name;
each round of step 3 a mark, `ROUND`), which the repository's profiler (tools/bench/profile.py,
`profile.phases=knn`) sums; outside a profile a span costs a few microseconds.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import numpy as np
import torch

from resmlp.core import preempt
from resmlp.core.config import check_choice
from resmlp.core.errors import UserError

BUDGET = 512 * 2**20   # bytes one block of the search may hold (similarities, candidates, a re-rank tile)
_MAX_CHUNK = 4096      # queries per chunk, whatever the budget allows
_CAND_BYTES = 24       # per (query, candidate) of a pass: its search similarity and index, twice while joined


# --------------------------------------------------------------------------- phases

SPANS = "knn_search: "          # the name of every phase span begins so in a profiler's trace
ROUND = "knn_search round: "    # a mark per round of step 3: its candidates, queries and chunk


def phase(name: str):
    """A span of the search (and of the vote, eval/knn.py), recorded by torch.profiler when a
    profile runs: it adds no host sync."""
    return torch.profiler.record_function(SPANS + name)


def _mark_round(**facts: int) -> None:
    """A round's facts (its candidate count, queries, queries per chunk) as a mark in the trace."""
    with torch.profiler.record_function(ROUND + " ".join(f"{k}={v}" for k, v in facts.items())):
        pass


def round_of(name: str) -> dict | None:
    """The facts of a round's mark (`_mark_round`), from its name in a trace; None for another name."""
    if not name.startswith(ROUND):
        return None
    return {k: int(v) for k, v in (word.split("=") for word in name[len(ROUND):].split())}


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

def as_tensor(x, name: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """`x` (a numpy array, a tensor or anything numpy reads) as a tensor of `dtype` on `device`;
    a UserError naming `name` for anything else. The k-NN's labels go through it too."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    elif not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except Exception:
            raise UserError(f"{name} must be a numpy array or torch tensor, not {type(x).__name__}") from None
    return x.detach().to(device, dtype)


def _features(x, name: str, device="cpu", budget: int = BUDGET) -> torch.Tensor:
    """Raw features as float32 on `device`, checked: finite, in slices within the budget
    (isfinite over a whole bank would make temporaries of its size)."""
    x = as_tensor(x, name, device=device)
    if x.ndim != 2:
        raise UserError(f"{name} must be 2-D (n, dim), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise UserError(f"{name} is empty: the split has no images; check data.root / data.subset")
    rows = max(1, budget // (8 * max(1, x.shape[1])))   # |x| and the flags per value
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    for s in range(0, x.shape[0], rows):
        finite &= torch.isfinite(x[s:s + rows]).all()
    if not finite:
        raise UserError(f"{name} holds NaN or inf values; the backbone's features are broken")
    return x


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
                xb = torch.nn.functional.normalize(torch.randn(2000, 64, generator=g), dim=1).numpy()
                xq = torch.nn.functional.normalize(torch.randn(64, 64, generator=g), dim=1).numpy()
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
    check_choice("knn.backend", backend)
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


# The candidate pass's rounding, per dtype of its operands (see _Search.bound).
# Accumulation: a bound per summed product, relative to the sum of |products|. float32 on a
# CPU or in CUDA cores: IEEE sums, whose recursive bound is d 2^-24 in any order; 2^-22
# spares a factor 4. float16 / bfloat16 on tensor cores: the products are exact in float32
# but the sums may truncate and align with few extra bits (not IEEE); 2^-21 spares a
# factor 4 over truncation's 2^-23.
_ACCUMULATION = {torch.float32: 2.0**-22, torch.float16: 2.0**-21, torch.bfloat16: 2.0**-21}


def _cublas_setting(name: str):
    """A cuBLAS flag of torch.backends.cuda.matmul as it can be set back: with its split-K
    part where this torch has one."""
    m = torch.backends.cuda.matmul
    try:
        return getattr(m, name), getattr(m, name + "_split_k")
    except AttributeError:
        return getattr(m, name)


@contextlib.contextmanager
def _pass_precision():
    """The candidate pass's matmuls as its rounding bound assumes them: float32 operands
    multiplied in float32 (no TF32), float16 / bfloat16 products summed in float32 (cuBLAS
    may otherwise reduce in the operands' precision, or accumulate float16 in float16)."""
    m = torch.backends.cuda.matmul
    names = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
             "allow_fp16_accumulation")
    old = torch.get_float32_matmul_precision(), [_cublas_setting(name) for name in names]
    torch.set_float32_matmul_precision("highest")
    for name in names:
        setattr(m, name, False)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        for name, value in zip(names, old[1]):
            setattr(m, name, value)


def unit_rows(x: torch.Tensor, dtype: torch.dtype, inv: torch.Tensor,
              budget: int = BUDGET) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit, err): the rows of x (float32) as unit vectors in `dtype`, what a candidate
    pass multiplies, and a float64 bound per row on |unit_i - x_i / |x_i||_2, the operand
    rounding the pass's bound needs, measured rather than assumed. inv: x's float64
    inverse norms (_inverse_norms).

    v = x * float32(inv) is within (2u + u^2)|x_i / |x_i|| + 2^-150 of the exact unit
    vector in each value (u = 2^-24: inv's rounding and the product's; 2^-150 where the
    product is subnormal), so within 2^-22 in norm for any d below 2^200. unit = v rounded
    to `dtype`; for float16 the values that would round to a subnormal are set to 0 first
    (tensor cores may flush them), and a device's flush of float32-range subnormals adds at
    most 2^-126 sqrt(d). unit - v is exact in float32 (two values within a factor 2 of each
    other, or -v where set to 0), and its float32 norm is within a relative (d/2 + 1) 2^-24
    of the true one. A row whose inverse norm float32 cannot hold (|x_i| below 1e-38) is
    set to 0, err 1 + 2^-22: a correct, useless bound. In chunks of the budget, float32
    only: no float64 copy."""
    n, d = x.shape
    unit = torch.empty(n, d, dtype=dtype, device=x.device)
    err = torch.empty(n, dtype=torch.float64, device=x.device)
    tiny, grow = torch.finfo(dtype).tiny, 1.0 + (d / 2 + 1) * 2.0**-24
    rows = max(1, budget // (32 * max(1, d)))
    for s in range(0, n, rows):
        xs, iv, u = x[s:s + rows], inv[s:s + rows], unit[s:s + rows]
        small = iv > 1e38
        scale = iv.masked_fill(small, 0).float().unsqueeze(1)
        if dtype == torch.float32:   # unit = v
            torch.mul(xs, scale, out=u)
            e = torch.zeros_like(iv)
        else:
            v = xs * scale
            if tiny > torch.finfo(torch.float32).tiny:   # float16: what would round to a subnormal is 0
                v = torch.nn.functional.hardshrink(v, tiny)
            u.copy_(v)
            e = torch.linalg.vector_norm(torch.sub(u, v), dim=1).double()   # u - v in float32, exact
        err[s:s + rows] = (e * grow + 2.0**-22 + d**0.5 * 2.0**-126).masked_fill(small, 1.0 + 2.0**-22)
    return unit, err


class _Search:
    """What both backends share: the raw train features and their float64 inverse norms
    where the re-rank runs (`device`), the budget, the unit vectors a pass multiplies (in
    `dtype`, each row's rounding measured: unit_rows) and the pass's rounding bound. A
    backend's call (queries, kc) returns (ceiling, candidates): each query's kc candidate
    train indices and a float64 value that the exact similarity of no other training
    feature exceeds; knn_search keeps a query's re-ranked candidates once its k-th exact
    similarity is above the ceiling."""

    max_k: int | None = None   # the most candidates one search call can return (None: any)

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int, dtype: torch.dtype):
        self.device, self.budget, self.dtype = device, budget, dtype
        self.train = train.to(device)                                    # raw, float32: the re-rank's
        self.inv_norm = _inverse_norms(self.train, budget)
        self.unit, err = unit_rows(self.train, dtype, self.inv_norm, budget)   # the candidate pass's
        self.train_err = err.max()                                       # the largest row's rounding

    def queries(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """unit_rows of the queries, where the pass runs."""
        q = q.to(self.device)
        return unit_rows(q, self.dtype, _inverse_norms(q, self.budget), self.budget)

    def tolerance(self, d: int) -> float:
        """The bound's worst case for unit vectors of dim d (every operand rounded by the
        dtype's unit roundoff, the k-th value near 1): what sets the first candidate
        count's margin. The exactness check uses `bound`, per query."""
        u = torch.finfo(self.dtype).eps / 2
        return 2 * u + u * u + d * _ACCUMULATION[self.dtype] * (1 + u) ** 2 + torch.finfo(self.dtype).eps

    def bound(self, last: torch.Tensor, err: torch.Tensor, d: int) -> torch.Tensor:
        """The ceiling (float64) on the exact cosine of any training feature the pass left
        out, from the last candidate's pass value `last` and the query's operand rounding
        `err`. For unit q, t and their rounded q~ = q + a, t~ = t + b (|a| = err, |b| <=
        train_err, measured): |q~.t~ - q.t| <= |a| + |b| + |a||b| (Cauchy-Schwarz); the
        float32 sum adds at most d * acc * sum|q~_i t~_i| <= d * acc * (1 + |a|)(1 + |b|);
        the result's rounding to the pass's dtype is faithful, so a left-out value v, whose
        stored value is <= last, is < next_up(last) <= last + eps |last| + tiny. 1e-12
        covers the float64 arithmetic of the exact similarities and of this bound."""
        info, b = torch.finfo(self.dtype), self.train_err
        last = last.to(b.device, torch.float64)
        operands = err + b + err * b + d * _ACCUMULATION[self.dtype] * (1 + err) * (1 + b)
        return last + info.eps * last.abs() + info.tiny + operands + 1e-12


class _TorchSearch(_Search):
    """Candidates by matmul + top-k where the features live (CPU or GPU), and the exact
    re-rank there too. On a GPU the pass runs in float16 with float32 sums, at the tensor
    cores' full rate (bfloat16's, with 8x finer rounding); its rounding bound (`bound`)
    is all the exactness check of knn_search needs.

    The pass (`__call__`), per chunk of queries (`tile`):
    1. tiles of bank columns, each one matmul whose similarities are written once and read
       once, for the maxima of blocks of BLOCK columns (a tile holds whole blocks) into the
       chunk's maxima over the whole bank; the columns after the last whole block (fewer
       than BLOCK) are kept as they are, every one a candidate;
    2. one top-k over those maxima: the kb = kc blocks with the largest (`_best_blocks`);
    3. those blocks' columns computed again by the matmul's arithmetic, in slices of the
       chunk (`recompute_rows`), and the top kc of them and the kept columns: the
       candidates (`_recompute`).
    Why that is exact: a column outside the kb blocks is at most its block's maximum, so at
    most the kb-th largest maximum M; one inside them that is not kept is at most the last
    kept value t. The pass value of every column left out is therefore at most max(t, M),
    and both are values of the pass's arithmetic (its dtype's operands, float32 sums, a
    faithful rounding to the dtype), so `bound` of max(t, M) is a ceiling, as it is of t
    after one top-k over the whole row. kb = kc blocks hold at least kc columns. Where the
    bank has no more whole blocks than kc (a wide search of a small bank) a tile is whole
    rows and one top-k over them. No host sync: the loop only launches work."""

    DTYPES = {"cuda": torch.float16, "cpu": torch.float32}   # the candidate pass, per device type
    BLOCK = 64    # bank columns per block maximum

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int = BUDGET,
                 dtype: torch.dtype | None = None):
        super().__init__(train, device, budget, dtype or default_pass_dtype(device))

    def prunes(self, kc: int) -> bool:
        """Whether the pass at kc candidates goes through block maxima: more whole blocks
        than kc in the bank."""
        return self.unit.shape[0] // self.BLOCK > kc

    def tile(self, kc: int) -> tuple[int, int]:
        """(queries, bank columns) of one matmul at kc candidates per query, within the
        budget. With block maxima: per query, the chunk's maxima over the whole bank with
        topk's copies and the candidates, on at most half the budget (_MAX_CHUNK queries where
        they fit), and the rest for the tile's similarities and their maxima, in whole
        blocks. Without: whole rows, with topk's copies."""
        n, size, block = self.unit.shape[0], self.unit.element_size(), self.BLOCK
        out = 4 * kc * (size + 8)
        if not self.prunes(kc):
            return max(1, min(_MAX_CHUNK, int(self.budget // (out + n * (2 * size + 8))))), n
        per_row = (n // block) * (2 * size + 8) + out
        rows = max(1, min(_MAX_CHUNK, int(self.budget // (2 * per_row))))
        cols = int((self.budget / rows - per_row) / (size + size / block)) // block * block
        return rows, (n if cols >= n else max(cols, block))

    def recompute_rows(self, kc: int, d: int) -> int:
        """Queries of one slice of step 3 at kc candidates: per query, the rows of its kc
        blocks gathered (kc x BLOCK x d values), their similarities, their bank columns, and
        the pool of those and the kept columns with topk's copies."""
        size, block = self.unit.element_size(), self.BLOCK
        per = kc * block * (d * size + 3 * size + 24) + block * (2 * size + 24) + 4 * kc * (size + 8)
        return max(1, int(self.budget // per))

    def rows_for(self, kc: int) -> int:
        """Queries per chunk at kc candidates."""
        return self.tile(kc)[0]

    def __call__(self, q: torch.Tensor, kc: int) -> tuple[torch.Tensor, torch.Tensor]:
        with phase("queries: norms, unit rows"):
            unit, err = self.queries(q)
        n, block = self.unit.shape[0], self.BLOCK
        rows, cols = self.tile(kc)
        prune = self.prunes(kc)
        if prune and cols < n:   # whole blocks per tile, whatever tile says
            cols = max(block, cols // block * block)
        last, cand = [], []
        with torch.no_grad(), _pass_precision():
            for s in range(0, unit.shape[0], rows):
                uq = unit[s:s + rows]
                if not prune:
                    with phase("pass: matmul"):
                        sims = uq @ self.unit.T
                    with phase("pass: block maxima, merge"):
                        top, idx = sims.topk(kc, dim=1)
                    last.append(top[:, -1])
                    cand.append(idx)
                    continue
                maxima = torch.empty(uq.shape[0], n // block, dtype=self.dtype, device=self.device)
                rest = None   # the similarities of the columns after the last whole block
                for c in range(0, n, cols):
                    with phase("pass: matmul"):
                        sims = uq @ self.unit[c:c + cols].T
                    with phase("pass: block maxima, merge"):
                        whole = sims.shape[1] // block
                        torch.amax(sims[:, :whole * block].unflatten(1, (whole, block)), 2,
                                   out=maxima[:, c // block:c // block + whole])
                        if whole * block < sims.shape[1]:
                            rest = sims[:, whole * block:].clone()
                    del sims
                with phase("pass: best blocks, recompute"):
                    m, blocks = _best_blocks(maxima, kc)
                    del maxima
                    top, idx = _recompute(uq, self.unit, blocks, rest, kc, block,
                                          self.recompute_rows(kc, unit.shape[1]))
                    last.append(torch.maximum(top[:, -1], m))
                    cand.append(idx)
        with phase("pass: block maxima, merge"):
            return self.bound(torch.cat(last), err, unit.shape[1]), torch.cat(cand)


def default_pass_dtype(device) -> torch.dtype:
    """The dtype of the torch backend's candidate pass on `device` when knn_search is given none."""
    return _TorchSearch.DTYPES.get(torch.device(device).type, torch.float32)


def _best_blocks(maxima: torch.Tensor, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kb-th largest block maximum, the kb blocks with the largest) of each row of a
    chunk's block maxima: the chunk's one top-k over the bank."""
    m, blocks = maxima.topk(kb, dim=1, sorted=False)
    return m.amin(1), blocks


def _recompute(uq: torch.Tensor, bank: torch.Tensor, blocks: torch.Tensor, rest: torch.Tensor | None,
               kc: int, block: int, per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top kc (values sorted, and their bank columns) of each query's columns in
    `blocks` (the blocks of `block` bank rows it picked) and after the last whole block
    (`rest`: their similarities, or None), in slices of `per` queries. The blocks'
    similarities are computed again as the matmul computed them: the same unit rows in the
    same dtype, float32 sums (a batched matrix-vector product), rounded to the dtype."""
    full = bank.shape[0] // block
    by_block = bank[:full * block].view(full, block, bank.shape[1])
    offsets = torch.arange(block, device=bank.device)
    tops, idxs = [], []
    for s in range(0, uq.shape[0], per):
        b = blocks[s:s + per]
        rows = by_block[b].flatten(1, 2)                                  # (r, kb * block, d)
        sims = torch.bmm(rows, uq[s:s + per].unsqueeze(2)).squeeze(2)     # (r, kb * block)
        del rows
        cols = (b.unsqueeze(2) * block + offsets).flatten(1)
        if rest is not None:
            sims = torch.cat([sims, rest[s:s + per]], 1)
            cols = torch.cat([cols, (full * block + offsets[:rest.shape[1]]).expand(cols.shape[0], -1)], 1)
        top, where = sims.topk(kc, dim=1)
        tops.append(top)
        idxs.append(cols.gather(1, where))
    return torch.cat(tops), torch.cat(idxs)


class _FaissSearch(_Search):
    """FAISS's exact flat index over the float32 unit vectors (IEEE float32 sums, in BLAS
    or its own loops: the float32 bound of _Search)."""

    GPU_MAX_K = 2048   # faiss's GPU indexes select at most this many neighbours per query

    def __init__(self, train: torch.Tensor, device: torch.device, budget: int = BUDGET):
        super().__init__(train, torch.device("cpu"), budget, torch.float32)   # results, re-rank: on the CPU
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
        self.index.add(self.unit.numpy())
        self.unit = None   # the index holds its own copy

    def rows_for(self, kc: int) -> int:
        return _MAX_CHUNK

    def __call__(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        unit, err = self.queries(q)
        sims, idx = self.index.search(unit.numpy(), k)
        return self.bound(torch.from_numpy(sims[:, -1]), err, q.shape[1]), torch.from_numpy(idx).long()


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

def first_candidates(k: int, tol: float, n: int) -> int:
    """Candidates per query of the first pass: a coarser pass (its worst-case bound `tol`)
    needs a wider margin for its exactness check to pass at once."""
    margin = max(8, k // 2) if tol < 1e-4 else max(16, k) if tol < 1e-2 else max(64, 4 * k)
    return min(n, k + margin)


def knn_search(train_features, test_features, k: int, backend: str = "auto",
               chunk_size: int | None = None, device=None,
               budget: int | None = None, on_host: bool = True,
               pass_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest training features (cosine) of every test feature.

    Returns (similarities float64, indices int64), CPU tensors of shape (n_test, k)
    (on_host=False: on the device the search ran on),
    each row sorted by (-similarity, train index); features are L2-normalised inside.
    chunk_size: queries per chunk (default: what fits the memory budget); the result
    does not depend on it. device: where the search runs (default: the GPU if any).
    budget: bytes one block may hold (default BUDGET; see the module docstring).
    pass_dtype: the torch backend's candidate pass in this dtype (default: default_pass_dtype's
    for the device); the result does not depend on it, only the time it takes.
    """
    name, dev = resolve_backend(backend, device)
    budget = int(budget or BUDGET)
    where = dev if name == "torch" else torch.device("cpu")   # where the features are searched
    with phase("inputs: copy, checks"):
        train = _features(train_features, "train features", where, budget)
        test = _features(test_features, "test features", where, budget)
    if train.shape[1] != test.shape[1]:
        raise UserError(f"train features have dim {train.shape[1]}, test features {test.shape[1]}: "
                        "they must come from the same backbone")
    n, d = train.shape
    k = check_ks([k], n)[0]
    with phase("bank: norms, unit rows"):
        search = _FaissSearch(train, dev, budget) if name == "faiss" else _TorchSearch(train, dev, budget, pass_dtype)
    first = first_candidates(k, search.tolerance(d), n)
    if chunk_size is None:  # one candidate matmul per chunk: a remainder would read the train features again
        chunk_size = min(pass_rows(first, budget), search.rows_for(first))
    chunk_size = int(max(1, min(_MAX_CHUNK, chunk_size)))

    # Every query is searched at kc candidates, in chunks; those whose k-th exact similarity
    # is not above the ceiling of what the pass left out are searched again at 4x, all
    # together: one host sync per round (the count), none per chunk.
    at = search.device   # results stay there until the end: one copy back, not one per chunk
    out_s = torch.empty(test.shape[0], k, dtype=torch.float64, device=at)
    out_i = torch.empty(test.shape[0], k, dtype=torch.int64, device=at)
    pending, kc = torch.arange(test.shape[0], device=at), first
    while pending.numel():
        whole = kc >= n or (search.max_k is not None and kc > search.max_k)
        per = min(chunk_size, pass_rows(kc, budget))
        _mark_round(candidates=n if whole else kc, queries=pending.numel(), chunk=per)
        asked, missed = [], []
        for s in range(0, pending.numel(), per):
            preempt.stop_between_batches()  # a trainer's stop signal need not wait for the whole search
            with phase("queries: gather"):
                rows = pending[s:s + per]
                q = test[rows.to(test.device)]
            if whole:   # every training feature is a candidate: re-rank them all, no search
                ceiling = cand = None
            else:
                ceiling, cand = search(q, kc)
            with phase("re-rank"):
                exact, cand = _rerank(search, q, None if whole else cand.to(at), k)
            with phase("check, scatter"):
                if not whole:   # kept where the k-th is above everything the search left out
                    asked.append(rows)
                    missed.append(ceiling.to(at) >= exact[:, k - 1])
                out_s.index_copy_(0, rows, exact)
                out_i.index_copy_(0, rows, cand)
        with phase("round's count (host sync)"):
            pending = torch.cat(asked)[torch.cat(missed)] if asked else pending[:0]
        kc = min(n, 4 * kc)
    if not on_host:
        return out_s, out_i
    with phase("copy back"):
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
