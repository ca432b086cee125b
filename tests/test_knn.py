"""k-NN: the exact search (eval/knn_search.py), its memory bound, the vote at any temperature,
and few-label banks (eval/knn.py, eval/few_labels.py)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from resmlp.core.errors import UserError
from resmlp.eval import knn_search as S
from resmlp.eval.knn import knn_classify, knn_evaluate, topk_correct
from resmlp.eval.knn_search import check_ks, knn_search, resolve_backend

try:
    import faiss  # noqa: F401
    HAVE_FAISS = True
except ImportError:
    HAVE_FAISS = False


# --------------------------------------------------------------------------- k-NN

def numpy_knn_scores(train, labels, test, num_classes, k, T):
    """The DINO protocol written out plainly: cosine, top-k by (-sim, index), exp(sim/T) votes
    (at temperatures where exp does not overflow; knn_classify returns their log)."""
    tr = train / np.linalg.norm(train, axis=1, keepdims=True)
    te = test / np.linalg.norm(test, axis=1, keepdims=True)
    sims = te.astype(np.float64) @ tr.astype(np.float64).T
    scores = np.zeros((len(te), num_classes))
    for i, row in enumerate(sims):
        order = np.lexsort((np.arange(len(row)), -row))[:k]
        for j in order:
            scores[i, labels[j]] += np.exp(row[j] / T)
    return scores


def random_features(n_train=400, n_test=60, dim=24, classes=6, seed=0):
    g = np.random.default_rng(seed)
    centers = g.standard_normal((classes, dim))
    ytr = g.integers(0, classes, n_train)
    yte = g.integers(0, classes, n_test)
    xtr = (centers[ytr] + 1.5 * g.standard_normal((n_train, dim))).astype(np.float32)
    xte = (centers[yte] + 1.5 * g.standard_normal((n_test, dim))).astype(np.float32)
    return xtr, ytr, xte, yte


@pytest.mark.parametrize("k,T", [(1, 0.07), (5, 0.07), (20, 0.5), (37, 0.02)])
def test_knn_matches_numpy_reference(k, T):
    xtr, ytr, xte, _ = random_features()
    ref = numpy_knn_scores(xtr, ytr, xte, 6, k, T)
    got = knn_classify(xtr, ytr, xte, 6, k=k, temperature=T, backend="torch")
    assert got.dtype == torch.float64 and got.device.type == "cpu" and got.shape == (60, 6)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(got.numpy(), np.log(ref), rtol=1e-6)   # -inf where no vote
    assert (got.argmax(1).numpy() == ref.argmax(1)).all()



def test_knn_classify_votes_with_the_search_it_is_handed():
    """knn_classify's neighbours come from its `search` argument (the bench hands it another
    version's knn_search to time): the votes are those of the neighbours that search gives,
    and the default is the project's own."""
    xtr, ytr, xte, _ = random_features()
    calls = []

    def flipped(train, test, k, *args, **kwargs):   # the search on the negated queries: their farthest
        calls.append(k)
        return knn_search(train, -np.asarray(test), k, *args, **kwargs)
    got = knn_classify(xtr, ytr, xte, 6, k=5, temperature=0.07, backend="torch", search=flipped)
    assert calls == [5]
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(got.numpy(), np.log(numpy_knn_scores(xtr, ytr, -xte, 6, 5, 0.07)), rtol=1e-6)
    assert torch.equal(knn_classify(xtr, ytr, xte, 6, k=5, backend="torch"),
                       knn_classify(xtr, ytr, xte, 6, k=5, backend="torch", search=knn_search))

def tie_features():
    xtr, ytr, xte, _ = random_features(n_train=300, n_test=40, seed=1)
    xtr[50:80] = xtr[7]               # 31 identical training features, mixed labels
    xtr[200:203] = 2.0 * xtr[9]       # same direction, other norm: equal cosine
    xte[:6] = xtr[7]                  # queries sitting exactly on the duplicates
    xte[6:9] = xtr[9]
    return xtr, ytr, xte


@pytest.mark.skipif(not HAVE_FAISS, reason="faiss not installed")
@pytest.mark.parametrize("k", [1, 10, 20, 45])
def test_faiss_and_torch_backends_agree_with_ties(k):
    xtr, ytr, xte = tie_features()
    s_f, i_f = knn_search(xtr, xte, k, backend="faiss", device="cpu")
    s_t, i_t = knn_search(xtr, xte, k, backend="torch", device="cpu")
    assert torch.equal(i_f, i_t)
    assert torch.allclose(s_f, s_t, atol=1e-12)
    # ties go to the lower train index: the duplicates come out in index order
    first = i_t[0].tolist()
    dup = [7] + list(range(50, 80))
    assert first == dup[:k] if k <= len(dup) else first[:len(dup)] == dup
    a = knn_classify(xtr, ytr, xte, 6, k=k, backend="faiss", device="cpu")
    b = knn_classify(xtr, ytr, xte, 6, k=k, backend="torch", device="cpu")
    assert torch.equal(a.argmax(1), b.argmax(1))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    ref = numpy_knn_scores(xtr, ytr, xte, 6, k, 0.07)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(b.numpy(), np.log(ref), rtol=1e-6)


def numpy_neighbours(train, test, k):
    """The k nearest by float64 cosine of the raw features, ties to the lower index."""
    tr = train.astype(np.float64) / np.linalg.norm(train.astype(np.float64), axis=1, keepdims=True)
    te = test.astype(np.float64) / np.linalg.norm(test.astype(np.float64), axis=1, keepdims=True)
    sims = te @ tr.T
    return np.stack([np.lexsort((np.arange(len(row)), -row))[:k] for row in sims])


def near_tie_features(n_background=2000, m=12, ties=100, d=48, seed=5):
    """Adversarial for a half-precision pass: each query has `ties` training features at
    cosines 0.9 + 1e-6 x a shuffled rank (float16 resolves 5e-4 there, bfloat16 4e-3), the
    k-th boundary among them, a block of 20 exact duplicates of one of them, and a zero
    row and a row with huge and tiny components; the rest random."""
    g = np.random.default_rng(seed)
    q = g.standard_normal((m, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    rows = [g.standard_normal((n_background, d))]
    for i in range(m):
        r = g.standard_normal((ties, d))
        r -= (r @ q[i])[:, None] * q[i]
        r /= np.linalg.norm(r, axis=1, keepdims=True)
        c = 0.9 + 1e-6 * g.permutation(ties)[:, None]
        rows.append(c * q[i] + np.sqrt(1 - c * c) * r)
    train = np.concatenate(rows).astype(np.float32)
    train = train[g.permutation(len(train))]
    train[:20] = train[n_background // 2]           # duplicates: ties to the lower index
    train[25] = 0.0
    train[26] = np.where(np.arange(d) % 2, 1e-7, 1e3)
    return train, q.astype(np.float32)


def assert_exact(got, train, test, k):
    """Same neighbours as the float64 brute force, similarities to its rounding."""
    s, i = got
    want_i, want_s = plain_neighbours(train, test, k)
    assert (i.numpy() == want_i).all()
    np.testing.assert_allclose(s.numpy(), want_s, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block", [7, 64])
def test_the_gpus_half_precision_candidate_pass_keeps_the_neighbours_exact(monkeypatch, dtype, block):
    """The GPU's candidate pass (float16; bfloat16 also bounded), tiles reduced to block
    maxima before the top-k, run here on the CPU (block 7: pruning on, ragged last blocks;
    64: off at this size). Same neighbours and similarities as the float32 pass and the
    float64 brute force, same predictions; near ties send queries to a wider second
    search; with the rounding bound ignored the answer would be wrong."""
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(30, 48, generator=g)
    xtr = centers[torch.randint(0, 30, (3001,), generator=g)] + 0.15 * torch.randn(3001, 48, generator=g)
    xte = centers[torch.randint(0, 30, (200,), generator=g)] + 0.15 * torch.randn(200, 48, generator=g)
    ytr = torch.randint(0, 30, (3001,), generator=g)
    want_s, want_i = knn_search(xtr, xte, 20, backend="torch", device="cpu")
    assert (want_i.numpy() == numpy_neighbours(xtr.numpy(), xte.numpy(), 20)).all()
    want_scores = knn_classify(xtr, ytr, xte, 30, k=20, backend="torch", device="cpu")
    ties, queries = near_tie_features()
    want_ties = knn_search(ties, queries, 20, backend="torch", device="cpu")

    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", dtype)
    monkeypatch.setattr(S._TorchSearch, "BLOCK", block)
    calls = []
    real = S._TorchSearch.__call__
    monkeypatch.setattr(S._TorchSearch, "__call__", lambda self, q, k: calls.append(k) or real(self, q, k))
    got_s, got_i = knn_search(xtr, xte, 20, backend="torch", device="cpu")
    assert torch.equal(got_i, want_i) and torch.equal(got_s, want_s)
    assert torch.equal(knn_classify(xtr, ytr, xte, 30, k=20, backend="torch", device="cpu"), want_scores)
    calls.clear()
    got = knn_search(ties, queries, 20, backend="torch", device="cpu")
    assert torch.equal(got[0], want_ties[0]) and torch.equal(got[1], want_ties[1])
    assert_exact(got, ties, queries, 20)
    assert len(set(calls)) > 1  # the near ties needed a wider second search
    monkeypatch.setattr(S._TorchSearch, "bound", lambda self, last, err, d: last.double())
    assert not torch.equal(knn_search(ties, queries, 20, backend="torch", device="cpu")[1], want_ties[1])


def spans_of(fn):
    """(fn()'s result, {span: calls}, [each round's facts]): eval/knn_search.py's spans and
    round marks in a torch.profiler trace of fn() on the host (tools/bench/knn.py sums them)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    calls = Counter(e.name[len(S.SPANS):] for e in events if e.name.startswith(S.SPANS))
    return out, calls, [S.round_of(e.name) for e in events if S.round_of(e.name) is not None]


def test_the_spans_time_every_tile_and_round_and_change_nothing(monkeypatch):
    """The search's phases as torch.profiler spans (what tools/bench/profile.py's k-NN phases
    read): every tile's matmul and its block maxima are spans, and so is each chunk's choice
    of blocks and their recomputation; each round is marked with its queries and candidates
    (near ties under float16: a wider round, whose candidates outnumber the blocks: whole
    rows), the vote is a span, and the scores are those of a call without a profile."""
    ties, queries = near_tie_features()
    n = len(ties)
    labels = torch.arange(n) % 7
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", torch.float16)
    monkeypatch.setattr(S._TorchSearch, "tile", lambda self, kc: (5, 700))
    want = knn_classify(ties, labels, queries, 7, k=20, backend="torch", device="cpu")
    got, spans, rounds = spans_of(lambda: knn_classify(ties, labels, queries, 7, k=20, backend="torch", device="cpu"))
    assert torch.equal(got, want)
    assert rounds[0]["queries"] == len(queries) and len(rounds) >= 2
    assert all(b["candidates"] == min(n, 4 * a["candidates"]) and b["queries"] <= a["queries"]
               for a, b in zip(rounds, rounds[1:]))
    searched = [r for r in rounds if r["candidates"] < n]
    chunks = sum(math.ceil(r["queries"] / r["chunk"]) for r in rounds)
    calls = [math.ceil(r["queries"] / r["chunk"]) for r in searched]     # one chunk per call: 5 queries
    pruned = [c for c, r in zip(calls, searched) if n // 64 > r["candidates"]]
    assert pruned and sum(pruned) < sum(calls)                               # both kinds of pass ran
    tiles = math.ceil(n / 640)                                               # 700 columns: 10 whole blocks
    assert spans["pass: matmul"] == sum(pruned) * tiles + sum(calls) - sum(pruned)
    assert spans["pass: block maxima, merge"] == spans["pass: matmul"] + sum(calls)  # + the ceiling
    assert spans["pass: best blocks, recompute"] == sum(pruned)
    assert spans["queries: norms, unit rows"] == sum(calls)
    assert spans["re-rank"] == spans["check, scatter"] == chunks
    assert spans["round's count (host sync)"] == len(rounds)
    for name in ("inputs: copy, checks", "bank: norms, unit rows", "copy back", "vote"):
        assert spans[name] == 1, name
    assert S.round_of("knn_search: re-rank") is None


def bound_holds(dtype, device):
    """`bound` of each pass value is at least the exact float64 cosine, for every pair of
    clustered, near-tie and wide-dynamic-range features, with the matmul the pass runs on
    `device`; and it is not loose beyond use (the worst pair's error is a good part of its
    allowance for the half types)."""
    g = torch.Generator().manual_seed(0)
    d = 96
    c = torch.randn(10, d, generator=g)
    ties, queries = near_tie_features(n_background=300, m=4, ties=50, d=d)
    wide = torch.randn(600, d, generator=g) * torch.logspace(-7, 0, d)[torch.randperm(d, generator=g)]
    sets = {"clustered": (c[torch.randint(0, 10, (600,), generator=g)] + 0.05 * torch.randn(600, d, generator=g),
                          c[torch.randint(0, 10, (50,), generator=g)] + 0.05 * torch.randn(50, d, generator=g)),
            "near ties": (torch.from_numpy(ties), torch.from_numpy(queries)),
            "wide range": (wide, wide[:50] + 1e-6 * torch.randn(50, d, generator=g))}
    worst = 0.0
    for name, (tr, te) in sets.items():
        search = S._TorchSearch.__new__(S._TorchSearch)
        search.dtype = dtype
        tr, te = tr.to(device), te.to(device)
        search.unit, err = S.unit_rows(tr, dtype, S._inverse_norms(tr))
        search.train_err = err.max()
        unit, err = S.unit_rows(te, dtype, S._inverse_norms(te))
        assert (err <= torch.finfo(dtype).eps + 2.0**-21).all()               # the measured rounding
        with S._pass_precision():
            sims = unit @ search.unit.T
        ref = torch.from_numpy(np.stack([plain_cosines(tr.cpu().numpy(), q) for q in te.cpu().numpy()]))
        sims, ceiling = sims.cpu(), search.bound(sims, err.unsqueeze(1), d).cpu()
        assert (ref <= ceiling).all(), name
        worst = max(worst, float(((sims.double() - ref).abs() / (ceiling - sims.double())).max()))
    if dtype != torch.float32:
        assert worst > 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_candidate_pass_rounding_bound_holds_for_every_pair(dtype):
    bound_holds(dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_features_of_any_scale_stay_exact(monkeypatch, dtype):
    """Rows of norm 1e-40 (subnormal floats: a unit vector float32 cannot scale to; their
    bound is then vacuous and every query widens to the whole set), 1e-20, 1e20 and 0,
    in the bank and among the queries: the float64 brute force's neighbours. (F.normalize's
    eps would have made a 1e-20 row a 1e-8 vector and its neighbours wrong.)"""
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", dtype)
    xtr, _, xte, _ = random_features(n_train=300, n_test=12, dim=16, seed=4)
    for rows, scale in ((slice(0, 3), 1e-40), (slice(3, 6), 1e-20), (slice(6, 9), 1e20), (slice(9, 10), 0.0)):
        xtr[rows] = xtr[rows] / np.linalg.norm(xtr[rows], axis=1, keepdims=True) * np.float32(scale)
    xte[:3] = xtr[[1, 4, 7]]          # queries on the scaled rows
    xte[3] = xte[3] * np.float32(1e-40)
    for train in (xtr, xtr[3:]):      # with and without the rows float32 cannot scale
        assert_exact(knn_search(train, xte, 20, backend="torch", device="cpu"), train, xte, 20)
        if HAVE_FAISS:
            assert_exact(knn_search(train, xte, 20, backend="faiss", device="cpu"), train, xte, 20)


@pytest.mark.parametrize("rows,cols", [(1, 7), (5, 13), (64, 100), (3, 1000), (200, 3001)])
def test_any_tile_of_the_pass_gives_the_exact_neighbours(monkeypatch, rows, cols):
    """The pass's tiles (queries x train columns) merged into a running top-kc: tiles
    narrower than the candidates (7, 13 columns for kc = 40), n not a multiple of the tile
    or the block, one query per tile: the float64 brute force's neighbours every time."""
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", torch.float16)
    monkeypatch.setattr(S._TorchSearch, "BLOCK", 7)
    monkeypatch.setattr(S._TorchSearch, "tile", lambda self, kc: (rows, cols))
    train, test = near_tie_features(n_background=1000, m=6, ties=40, d=24)
    assert_exact(knn_search(train, test, 20, backend="torch", device="cpu"), train, test, 20)


@pytest.mark.parametrize("budget", [2**12, 2**16])
def test_tiny_budgets_give_the_exact_neighbours(monkeypatch, budget):
    """4 KiB and 64 KiB for the float16 pass's tiles and the re-rank: a query per tile, a
    few candidates per re-rank tile, the same neighbours."""
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", torch.float16)
    train, test = near_tie_features(n_background=500, m=4, ties=40, d=24)
    assert_exact(knn_search(train, test, 20, backend="torch", device="cpu", budget=budget), train, test, 20)


def test_the_pass_tiles_fit_the_budget():
    """tile(kc) and recompute_rows(kc): within the budget by the structures' own count of
    bytes (the chunk's block maxima over the bank with topk's copies, the tile's
    similarities and their maxima; the gathered rows of a slice's blocks and their
    similarities), tiles of whole blocks, the maxima on at most half the budget; at the
    H100 bench's size (1.28M x 384 at 512 MiB, float16) chunks of over a thousand queries,
    so that the bank is read a few dozen times for 50k queries, not hundreds."""
    search = S._TorchSearch.__new__(S._TorchSearch)
    block = search.BLOCK
    for n, size, budget, kcs in ((1_281_167, 2, S.BUDGET, (40, 160, 640, 2560, 40960)),
                                 (60_000, 4, 2**20, (30, 120, 480, 36_000)), (12, 2, 2**20, (5,))):
        search.unit, search.budget = torch.empty(n, 0, dtype=torch.float16 if size == 2 else torch.float32), budget
        for kc in kcs:
            rows, cols = search.tile(kc)
            out = 4 * kc * (size + 8)                                        # the candidates, with copies
            if n // block > kc:
                assert search.prunes(kc)
                maxima = (n // block) * (2 * size + 8) + out                  # values, topk's copies
                assert rows == 1 or rows * maxima <= budget / 2, (n, kc, rows)
                assert cols == n or cols % block == 0
                assert rows == 1 or rows * (maxima + cols * (size + size / block)) <= budget, (n, kc, rows, cols)
                d = 384
                per = search.recompute_rows(kc, d)
                gathered = kc * block * (d * size + 3 * size + 24) + block * (2 * size + 24) + out
                assert per == 1 or per * gathered <= budget, (n, kc, per)
            else:
                assert not search.prunes(kc) and cols == n
                assert rows == 1 or rows * (out + n * (2 * size + 8)) <= budget, (n, kc, rows)
    search.unit, search.budget = torch.empty(1_281_167, 0, dtype=torch.float16), S.BUDGET
    rows, cols = search.tile(40)
    assert rows >= 1024 and cols % block == 0 and math.ceil(50_000 / rows) <= 50


@pytest.mark.cuda
def test_the_gpu_search_gives_the_cpus_neighbours(monkeypatch):
    """On the GPU (float16 pass, block maxima, float64 re-rank there) the same neighbours
    and similarities as the CPU's float32 pass, from CPU and from GPU tensors alike, with
    duplicates and near ties; the rounding bound holds for every pair of the GPU's own
    float16 and bfloat16 matmuls (its tensor cores' sums and output rounding)."""
    monkeypatch.setattr(S._TorchSearch, "BLOCK", 7)
    for xtr, xte in (tie_features()[::2], near_tie_features()):
        want_s, want_i = knn_search(xtr, xte, 20, backend="torch", device="cpu")
        for tr, te in ((xtr, xte), (torch.from_numpy(xtr).cuda(), torch.from_numpy(xte).cuda())):
            got_s, got_i = knn_search(tr, te, 20, backend="torch", device="cuda")
            assert torch.equal(got_i, want_i)
            torch.testing.assert_close(got_s, want_s, rtol=0, atol=1e-12)
    for dtype in (torch.float16, torch.bfloat16):
        bound_holds(dtype, "cuda")


def straddling_features(n=2000, m=8, d=24, block=7, seed=11):
    """Adversarial for the block maxima: each query's 30 nearest (cosines 0.95 + 1e-7 x a
    shuffled rank, below float16's resolution there) sit on both sides of block boundaries
    (the last column of a block and the first of the next), a few in one block, and some
    among the columns after the last whole block; one query's nearest are exact duplicates
    of one row (ties to the lower index, across boundaries); its own zero row and a row of
    norm 1e-30 among them."""
    g = np.random.default_rng(seed)
    q = g.standard_normal((m, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    train = g.standard_normal((n, d))
    full = n // block
    for i in range(m):
        r = g.standard_normal((30, d))
        r -= (r @ q[i])[:, None] * q[i]
        r /= np.linalg.norm(r, axis=1, keepdims=True)
        c = 0.95 + 1e-7 * g.permutation(30)[:, None]
        near = c * q[i] + np.sqrt(1 - c * c) * r
        edges = g.choice(np.arange(1, full), 10, replace=False) * block
        cols = np.concatenate([edges - 1, edges, block * g.integers(0, full) + np.arange(min(block, 6)),
                               np.arange(full * block, n)])[:30]
        train[cols] = near[:len(cols)]
    dup = g.choice(np.arange(1, full), 12, replace=False) * block
    train[np.concatenate([dup - 1, dup])] = train[dup[0] - 1]
    q[0] = train[dup[0] - 1] / np.linalg.norm(train[dup[0] - 1])
    train[block * 3 - 1] = 0.0
    train[block * 3] = q[1] * 1e-30
    return train.astype(np.float32), q.astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [7, 16])
def test_neighbours_across_block_boundaries_ties_and_tiny_norms_stay_exact(monkeypatch, dtype, block):
    """The pass through block maxima (a chunk's one top-k over them, the picked blocks
    computed again) with the nearest features on both sides of block boundaries, in the
    columns after the last whole block, exact duplicates across boundaries, a zero row and
    one of norm 1e-30; n not a multiple of the block or of the tile; k from 1 to more than
    the bank's blocks: the float64 brute force's neighbours and similarities."""
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", dtype)
    monkeypatch.setattr(S._TorchSearch, "BLOCK", block)
    train, test = straddling_features(n=2003, block=block)
    seen = []
    real = S._best_blocks
    monkeypatch.setattr(S, "_best_blocks", lambda maxima, kb: seen.append(kb) or real(maxima, kb))
    for k in (1, 20, 45, 2003 // block + 1, 2003):   # the fourth: more neighbours than the bank has blocks
        assert_exact(knn_search(train, test, k, backend="torch", device="cpu"), train, test, k)
    assert any(kb < 2003 // block for kb in seen)      # the block maxima were used
    monkeypatch.setattr(S._TorchSearch, "tile", lambda self, kc: (3, 5 * block + 3))   # ragged tiles, small chunks
    assert_exact(knn_search(train, test, 20, backend="torch", device="cpu"), train, test, 20)


def test_the_pass_through_block_maxima_finds_the_top_of_each_row(monkeypatch):
    """_TorchSearch's candidates at kc (float32 pass, blocks of 7, the columns after the
    last whole block) are the top kc of the whole row of the same matmul: the top of one
    query inside one block, of another across boundaries and in the last columns; the
    ceiling is at least the bound of the last one, and at least the bound of the kc-th
    largest block maximum even where the recomputation rounds lower than the matmul."""
    g = torch.Generator().manual_seed(0)
    train = torch.randn(1003, 16, generator=g)
    test = torch.randn(5, 16, generator=g)
    train[500:540] = test[3] + 0.3 * torch.randn(40, 16, generator=g)       # one query's top: a few blocks
    train[[69, 70, 139, 140, 1001, 1002]] = test[4] + 0.3 * torch.randn(6, 16, generator=g)
    search = S._TorchSearch(train, torch.device("cpu"))
    search.BLOCK = 7
    for kc in (1, 6, 30, 143):   # 143 = the bank's whole blocks: no pruning
        ceiling, idx = search(test, kc)
        unit, err = search.queries(test)
        sims = unit @ search.unit.T
        want = sims.topk(kc, dim=1)
        assert torch.equal(idx.sort(1).values, want.indices.sort(1).values), kc
        torch.testing.assert_close(sims.gather(1, idx).sort(1).values, want.values.sort(1).values, rtol=0, atol=1e-6)
        assert (ceiling >= search.bound(want.values[:, -1], err, 16) - 1e-6).all()
    assert set(search(test, 6)[1][4].tolist()) == {69, 70, 139, 140, 1001, 1002}
    real = S._recompute
    monkeypatch.setattr(S, "_recompute", lambda *a: (lambda top, idx: (top - 1.0, idx))(*real(*a)))
    for kc in (1, 6, 30):
        ceiling = search(test, kc)[0]
        maxima = sims[:, :143 * 7].unflatten(1, (143, 7)).amax(2)
        assert (ceiling >= search.bound(maxima.topk(kc, dim=1).values[:, -1], err, 16)).all(), kc


def test_chunking_does_not_change_results():
    xtr, ytr, xte = tie_features()
    whole = knn_classify(xtr, ytr, xte, 6, k=20, backend="torch", chunk_size=10_000)
    for chunk in (1, 7):
        assert torch.equal(knn_classify(xtr, ytr, xte, 6, k=20, backend="torch", chunk_size=chunk), whole)
    if HAVE_FAISS:
        assert torch.equal(knn_classify(xtr, ytr, xte, 6, k=20, backend="faiss", chunk_size=3), whole)


def test_knn_evaluate_hand_made():
    # unit vectors at angles (degrees); the test points at 5, 95 and 15 sit exactly between
    # two training points: with k=1 the lower train index wins the tie
    deg = np.radians
    train = np.array([[np.cos(deg(a)), np.sin(deg(a))] for a in (0, 10, 20, 90, 100, 180)], np.float32)
    ytr = np.array([0, 0, 1, 1, 1, 2])
    test = np.array([[np.cos(deg(a)), np.sin(deg(a))] for a in (5, 95, 170, 15)], np.float32)
    yte = np.array([0, 1, 2, 1])
    res = knn_evaluate(train, ytr, test, yte, 3, ks=(1, 3), temperature=0.07)
    assert set(res) == {1, 3}
    for k in (1, 3):
        assert res[k]["top1"] == pytest.approx(75.0)
        assert res[k]["top5"] == pytest.approx(100.0)   # top-min(5, 3 classes)
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.0, 0.0, 0.0, 0.9], [0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    r = topk_correct(scores, torch.tensor([1, 6]))
    assert r["top1"] == 0.0 and r["top5"] == 50.0   # ties in the 2nd row go to low classes


def test_numpy_and_torch_inputs_agree():
    xtr, ytr, xte, yte = random_features()
    a = knn_evaluate(xtr, ytr, xte, yte, 6, ks=(5, 10))
    b = knn_evaluate(torch.from_numpy(xtr).double(), torch.from_numpy(ytr), torch.from_numpy(xte),
                     list(yte), 6, ks=[10, 5])
    assert a == b
    assert isinstance(knn_classify(torch.from_numpy(xtr), ytr, xte, 6, k=3), torch.Tensor)


def log_vote_reference(train, labels, test, num_classes, k, T):
    """The log of each class's vote, written out plainly in float64: the k nearest by
    float64 cosine (ties to the lower index), then per class numpy's logaddexp over the
    neighbours' sim / T (-inf where none votes)."""
    idx = numpy_neighbours(train, test, k)
    tr = train.astype(np.float64) / np.linalg.norm(train.astype(np.float64), axis=1, keepdims=True)
    te = test.astype(np.float64) / np.linalg.norm(test.astype(np.float64), axis=1, keepdims=True)
    out = np.full((len(test), num_classes), -np.inf)
    for i, row in enumerate(idx):
        for c in range(num_classes):
            terms = [te[i] @ tr[j] / T for j in row if labels[j] == c]
            if terms:
                out[i, c] = np.logaddexp.reduce(terms)
    return out


@pytest.mark.parametrize("T", [1e-5, 1e-3, 1e-300])
def test_the_vote_is_exact_at_tiny_temperatures(T):
    """exp(sim / T) overflows float64 once sim / T > 709 (T = 1e-3 already, with sims near 1),
    and a vote of inf for several classes ranks them all alike: the vote must rank the
    classes as the log-sum-exp of sim / T does, at any T the limit admits."""
    xtr, ytr, xte, yte = random_features(n_train=400, n_test=60, dim=24, classes=6, seed=2)
    ref = log_vote_reference(xtr, ytr, xte, 6, 20, T)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(ref[np.isfinite(ref)])).any()     # the plain vote would overflow
    got = knn_classify(xtr, ytr, xte, 6, k=20, temperature=T, backend="torch")
    assert not got.isnan().any()
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-12)
    want_order = np.argsort(-ref, axis=1, kind="stable")            # equal scores: the lower class
    assert (got.sort(dim=1, descending=True, stable=True).indices.numpy() == want_order).all()
    res = knn_evaluate(xtr, ytr, xte, yte, 6, ks=[20], temperature=T)[20]
    assert res["top1"] == pytest.approx(100 * np.mean(want_order[:, 0] == yte))
    assert res["top5"] == pytest.approx(100 * np.mean((want_order[:, :5] == yte[:, None]).any(1)))
    assert res["top1"] > 50    # 6 classes: chance is 17%


def test_bad_knn_input_raises_user_error():
    xtr, ytr, xte, yte = random_features(n_train=30)
    for k in (0, -3, 31, "abc", 2.5):
        with pytest.raises(UserError):
            knn_evaluate(xtr, ytr, xte, yte, 6, ks=[k])
    for T in (0, -0.1, "x"):
        with pytest.raises(UserError):
            knn_classify(xtr, ytr, xte, 6, k=5, temperature=T)
    with pytest.raises(UserError):
        knn_classify(xtr[:0], ytr[:0], xte, 6, k=1)
    with pytest.raises(UserError):
        knn_classify(xtr, ytr, xte, 6, k=1, backend="annoy")
    with pytest.raises(UserError):
        knn_classify(xtr, ytr + 10, xte, 6, k=1)     # labels outside num_classes
    assert check_ks("10,20", 100) == [10, 20] and check_ks(20, 100) == [20]
    assert resolve_backend("torch", "cpu")[0] == "torch"



def test_neighbours_come_from_the_evaluators_search(monkeypatch):
    from resmlp.eval.neighbours import neighbours, pick_queries
    xtr, ytr, xte, yte = random_features()
    queries = pick_queries(yte, 8, seed=3)
    assert queries == pick_queries(yte, 8, seed=3) != pick_queries(yte, 8, seed=4)
    assert len(set(queries)) == 8 and sorted(set(yte[queries].tolist())) == list(range(6))   # every class
    assert [yte[q] for q in queries] == sorted(yte[q] for q in queries)                    # rows by class
    assert set(pick_queries(yte, 4, seed=3)) <= set(queries)    # the patch map's images are queries too
    assert len(set(pick_queries(-np.ones(50, dtype=int), 8, seed=0))) == 8    # no labels: random

    calls = []
    real = S.knn_search
    monkeypatch.setattr(S, "knn_search", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    nb = neighbours(xtr, ytr, xte, yte, queries, k=7, backend="torch")
    assert calls == [7]                                  # through the evaluator's own search
    sims, idx = real(xtr, xte, 7, backend="torch")       # what knn_evaluate votes with, all queries
    assert nb["indices"] == idx[queries].tolist()
    np.testing.assert_allclose(nb["similarities"], sims[queries].numpy(), atol=1e-6)
    assert nb["labels"] == ytr[idx[queries].numpy()].tolist()
    assert nb["match_rate"] == pytest.approx(np.mean(ytr[idx[queries].numpy()] == yte[queries, None]))
    # the same rows give knn_classify's votes (their log) for those queries
    votes = torch.zeros(8, 6, dtype=torch.float64).scatter_add_(
        1, torch.tensor(nb["labels"]), (torch.tensor(nb["similarities"], dtype=torch.float64) / 0.07).exp())
    full = knn_classify(xtr, ytr, xte, 6, k=7, temperature=0.07, backend="torch")
    torch.testing.assert_close(votes.log(), full[queries], rtol=1e-6, atol=0)
    with pytest.raises(UserError, match="query indices"):
        neighbours(xtr, ytr, xte, yte, [60], k=3)




# --------------------------------------------------------------------------- memory

def collapsed_features(n, m, d, seed=0):
    """Features all within a hair of one direction v, as a collapsed network gives: train
    rows at 50 levels v + a u (a few thousand exact duplicates each), queries between the
    levels. Every similarity lies within 1e-6 of the others, inside any candidate pass's
    rounding bound (so the search widens to the whole train set), yet the float64
    similarities of different levels stay far apart (a strict order to check against)."""
    g = np.random.default_rng(seed)
    v, u = np.zeros(d), np.zeros(d)
    v[0], u[1] = 1.0, 1.0
    v = v + 0.1 * g.standard_normal(d)
    v /= np.linalg.norm(v)
    u -= (u @ v) * v
    u /= np.linalg.norm(u)
    train = (v + 2e-5 * g.integers(0, 50, n)[:, None] * u).astype(np.float32)
    test = (v + (g.integers(0, 50, m) + 0.3)[:, None] * 2e-5 * u).astype(np.float32)
    return train, test


def plain_cosines(train, q):
    """float64 cosines of q with every training row (0 with a zero row, as knn_search)."""
    tr = train.astype(np.float64)
    norm = np.linalg.norm(tr, axis=1, keepdims=True)
    tr = tr / np.where(norm > 0, norm, 1)
    q = q.astype(np.float64)
    return (tr * (q / np.linalg.norm(q))).sum(1)


def plain_neighbours(train, test, k):
    """(indices, similarities) of the k nearest by float64 cosine, one query at a time,
    ties to the lower index."""
    idx, out = [], []
    for q in test:
        sims = plain_cosines(train, q)
        idx.append(np.lexsort((np.arange(len(sims)), -sims))[:k])
        out.append(sims[idx[-1]])
    return np.stack(idx), np.stack(out)


# Runs in a fresh process, so that its peak resident memory (VmHWM, reset through
# /proc/self/clear_refs) is the search's own and not what earlier tests left behind.
MEMORY_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import numpy as np
    import torch
    sys.path.insert(0, sys.argv[1])
    import test_knn
    from resmlp.eval import knn_search as S

    def kb(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

    n, m, d, k, budget = (int(v) for v in sys.argv[2:7])
    kind, dtype = sys.argv[8], getattr(torch, sys.argv[9])   # which features; the torch pass's dtype
    S._TorchSearch.DTYPES["cpu"] = dtype
    torch.set_num_threads(1)          # a busy shared machine: one thread is faster and steadier
    train, test = (torch.from_numpy(x) for x in getattr(test_knn, kind + "_features")(n, m, d))
    calls, tiles, maxima = [], [], []
    best = S._best_blocks
    S._best_blocks = lambda mx, kb: maxima.append(list(mx.shape)) or best(mx, kb)
    exact = S._exact_similarities
    S._exact_similarities = lambda q, qi, tr, ti, idx: tiles.append(list(idx.shape)) or exact(q, qi, tr, ti, idx)
    for cls in (S._TorchSearch, S._FaissSearch):
        def call(self, q, kc, real=cls.__call__):
            calls.append([q.shape[0], kc])
            return real(self, q, kc)
        cls.__call__ = call
    out = {}
    for backend in sys.argv[7].split(","):
        S.knn_search(train[:100], test[:2], 5, backend=backend, device="cpu")   # imports, libraries
        calls.clear(), tiles.clear(), maxima.clear()
        before = kb("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS
        sims, idx = S.knn_search(train, test, k, backend=backend, device="cpu", budget=budget)
        out[backend] = {"peak": 1024 * (kb("VmHWM") - before), "calls": list(calls), "tiles": list(tiles),
                        "maxima": list(maxima), "idx": idx.tolist(), "sims": sims.tolist()}
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_a_collapsed_network_stays_within_the_memory_budget():
    """n = 60k collapsed features (every query's candidates widen to the whole train set)
    searched with a 2 MiB budget: the chunks are the ones the plan gives, the neighbours
    the plain float64 ones, and the peak memory the index's copy of the features plus a
    few budgets; the float64 re-rank of whole candidate rows at once would need m x n x d x
    16 bytes (700 MB here, 40 GB at 10k queries of dim 384)."""
    n, m, d, k, budget = 60_000, 24, 32, 1500, 2 * 2**20
    backends = ["torch"] + (["faiss"] if HAVE_FAISS else [])
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, os.path.dirname(__file__), str(n), str(m), str(d),
                          str(k), str(budget), ",".join(backends), "collapsed", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(run.stdout)
    train, test = collapsed_features(n, m, d)
    want, sims = plain_neighbours(train, test, k)
    assert (sims.max(1) - sims.min(1) < 1e-6).all()                        # collapsed: all alike,
    assert all(len(np.unique(row)) > 1 for row in sims) and (np.diff(want, axis=1) < 0).any()  # yet ordered
    assert S.rerank_tile(m, n, d, budget) == (1, 2520)        # whole-set re-rank: 2520 candidates at a time
    for backend, r in res.items():
        assert (np.array(r["idx"]) == want).all(), backend
        np.testing.assert_allclose(r["sims"], sims, rtol=0, atol=1e-15)
        searched = [kc for _, kc in r["calls"]]
        assert max(searched) < n and 4 * max(searched) >= n, backend   # widened until the whole set was next
        for rows, kc in r["calls"]:
            assert rows == 1 or rows * kc * S._CAND_BYTES <= budget, (backend, rows, kc)
        for rows, cols in r["tiles"]:
            assert rows * cols * S.pair_bytes(d) <= budget, (backend, rows, cols)
        assert [1, 2520] in r["tiles"], backend
        data = n * d * 4 + n * 8      # the search's unit-vector copy and the float64 inverse norms
        assert r["peak"] <= data + 6 * budget, (backend, r["peak"] / 2**20)


def clustered_features(n, m, d, seed=0):
    """Features around 50 centres, the queries among them: each query's neighbours are a
    small part of the bank, so that the pass prunes by block maxima."""
    g = np.random.default_rng(seed)
    centres = g.standard_normal((50, d))
    train = centres[g.integers(0, 50, n)] + 0.5 * g.standard_normal((n, d))
    test = centres[g.integers(0, 50, m)] + 0.5 * g.standard_normal((m, d))
    return train.astype(np.float32), test.astype(np.float32)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_the_pass_through_block_maxima_stays_within_the_memory_budget():
    """The float16 pass through block maxima (100k x 64 clustered features, 1562 blocks for
    40 candidates) with a 2 MiB budget, in a fresh process: each chunk's maxima over the
    bank on at most half the budget, the float64 brute force's neighbours, and a peak
    within the search's float16 copy of the features, their float64 inverse norms and a few
    budgets (the same bound as the collapsed search's, which never prunes). The finiteness
    check of the inputs goes in slices too: over the whole bank at once its temporaries
    alone (|x| and flags, 5 bytes per value) would pass that bound."""
    n, m, d, k, budget = 100_000, 64, 64, 20, 2 * 2**20
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, os.path.dirname(__file__), str(n), str(m), str(d),
                          str(k), str(budget), "torch", "clustered", "float16"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout)["torch"]
    train, test = clustered_features(n, m, d)
    want, sims = plain_neighbours(train, test, k)
    assert (np.array(r["idx"]) == want).all()
    np.testing.assert_allclose(r["sims"], sims, rtol=0, atol=1e-15)
    assert r["maxima"] and all(blocks == n // 64 for _, blocks in r["maxima"])   # pruned, every chunk
    assert all(rows * blocks * (2 * 2 + 8) <= budget / 2 for rows, blocks in r["maxima"])
    data = n * d * 2 + n * 8
    assert r["peak"] <= data + 6 * budget, r["peak"] / 2**20


def counting_syncs(fn, syncs: list):
    """fn, recording in `syncs` every host sync (torch's CUDA sync debug warnings) it makes."""
    import warnings

    def wrapped(*args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                syncs.extend(f"{fn.__name__}: {w.filename}:{w.lineno} {w.message}" for w in caught
                             if "synchroniz" in str(w.message))
    return wrapped


def gpu_scale_check(monkeypatch, device: str, n: int = 60_000, d: int = 384, budget: int = 32 * 2**20) -> dict:
    """The GPU test's body, on `device`: clustered features at n x d through the candidate
    pass's block maxima, and collapsed ones within `budget`, both against the CPU's
    float32 pass. Returns the peak device memory of the collapsed search where measured."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(100, d, generator=g)
    xtr = centers[torch.randint(0, 100, (n,), generator=g)] + 0.5 * torch.randn(n, d, generator=g)
    xte = centers[torch.randint(0, 100, (256,), generator=g)] + 0.5 * torch.randn(256, d, generator=g)
    seen = []
    real = S._best_blocks
    monkeypatch.setattr(S, "_best_blocks", lambda maxima, kb: seen.append(
        (maxima.shape[1], kb, maxima.device.type)) or real(maxima, kb))
    want_s, want_i = knn_search(xtr, xte, 20, backend="torch", device="cpu")
    seen.clear()
    syncs = []
    if torch.device(device).type == "cuda":   # the pass and the re-rank only launch work: no host sync
        for owner, name in ((S._TorchSearch, "__call__"), (S, "_rerank")):
            monkeypatch.setattr(owner, name, counting_syncs(getattr(owner, name), syncs))
    got_s, got_i = knn_search(xtr.to(device), xte.to(device), 20, backend="torch", device=device)
    assert not syncs, syncs[:3]
    assert any(blocks > k and where == torch.device(device).type for blocks, k, where in seen)  # block maxima
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=1e-12)
    # profiled by phase (tools/bench/profile.py's k-NN phases): no host sync added, the same answer
    timed, spans, _ = spans_of(lambda: knn_search(xtr.to(device), xte.to(device), 20, backend="torch", device=device))
    assert not syncs, syncs[:3]
    assert torch.equal(timed[1], got_i) and torch.equal(timed[0], got_s)
    assert spans["pass: best blocks, recompute"] == len(seen) // 2 > 0   # seen: both searches' chunks

    tr, te = (torch.from_numpy(x) for x in collapsed_features(n, 64, d))
    want_s, want_i = knn_search(tr, te, 20, backend="torch", device="cpu", budget=budget)
    tr, te = tr.to(device), te.to(device)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    got_s, got_i = knn_search(tr, te, 20, backend="torch", device=device, budget=budget)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_s, want_s, rtol=0, atol=1e-12)
    return {"peak": torch.cuda.max_memory_allocated() - base} if cuda else {}


@pytest.mark.cuda
def test_the_gpu_search_at_scale_uses_block_maxima_and_stays_within_budget(monkeypatch):
    """60k x 384 on the GPU: the float16 candidate pass reduces its tiles to block maxima
    (937 blocks > 40 candidates, one top-k over them per chunk), makes no host sync (nor
    does the re-rank), and gives the
    CPU's neighbours; collapsed features (every query widened to the whole train set)
    within a 32 MiB budget: the CPU's neighbours, and a peak (the allocator's own count)
    within the unit vectors (float16, made in chunks), the inverse norms and a few
    budgets."""
    n, d, budget = 60_000, 384, 32 * 2**20
    peak = gpu_scale_check(monkeypatch, "cuda", n, d, budget)["peak"]
    assert peak <= n * d * (4 + 2) + n * 8 + 6 * budget, peak / 2**20


def test_the_gpu_scale_check_runs_on_the_cpu(monkeypatch):
    """The CUDA test's body at a size the CPU takes (its own check of the test), one
    thread: the tiles are small, and a busy machine's thread handoffs would cost more."""
    monkeypatch.setitem(S._TorchSearch.DTYPES, "cpu", torch.float16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gpu_scale_check(monkeypatch, "cpu", n=12_000, d=48, budget=2**20)
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- few labels

def test_few_labels_picks_are_class_balanced_seeded_and_differ_between_tries():
    from resmlp.eval import few_labels
    labels = torch.tensor([c for c, count in enumerate([30, 31, 29, 30, 40, 3]) for _ in range(count)])
    labels = labels[torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(0))]
    five = few_labels.picks(labels, 5, tries=4, seed=0)
    for pick in five:
        assert torch.equal(pick, pick.unique())                                   # sorted, no repeats
        assert torch.bincount(labels[pick], minlength=6).tolist() == [5, 5, 5, 5, 5, 3]   # the short class: all 3
    assert all(torch.equal(a, b) for a, b in zip(five, few_labels.picks(labels, 5, tries=4, seed=0)))   # seeded
    assert len({tuple(p.tolist()) for p in five}) == 4                             # a new pick every try
    assert not any(torch.equal(a, b) for a, b in zip(five, few_labels.picks(labels, 5, tries=4, seed=1)))
    for small, large in zip(few_labels.picks(labels, 2, tries=4, seed=0), five):    # nested over n
        assert set(small.tolist()) <= set(large.tolist())
    note = few_labels.short_classes(labels, 5, ["a", "b", "c", "d", "e", "f"])
    assert note == "n=5: 1 classes hold fewer than 5 images, their picks all they have: f (3)"
    assert few_labels.short_classes(labels, 3) is None
    assert few_labels.sizes(None) == [] and few_labels.sizes([10, 1, 5, 5]) == [1, 5, 10] and few_labels.sizes(5) == [5]


def test_few_labels_knn_reports_mean_and_std_over_tries_and_clips_k_once():
    from resmlp.eval import few_labels
    from resmlp.eval.knn import format_few_labels, knn_few_labels
    xtr, ytr, xte, yte = random_features(n_train=300, n_test=60, classes=6)
    res = knn_few_labels(xtr, ytr, xte, yte, 6, ks=[1, 5, 20], temperature=0.07, per_class=[3, 1], tries=4,
                       seed=7, backend="torch")
    assert res["per_class"] == [1, 3] and res["tries"] == 4 and list(res["results"]) == ["1", "3"]
    assert res["results"]["1"]["bank"] == 6 and res["results"]["3"]["bank"] == 18
    for n, k, used in ((1, 1, 1), (1, 5, 5), (1, 20, 6), (3, 20, 18)):
        cell = res["results"][str(n)]["k"][str(k)]
        assert cell["k_used"] == used
        # each try is knn_evaluate on its own pick; mean and sample std over the tries
        top1 = [knn_evaluate(xtr[p], ytr[p], xte, yte, 6, ks=[used])[used]["top1"]
                for p in few_labels.picks(ytr, n, 4, 7)]
        assert [t["top1"] for t in cell["tries"]] == pytest.approx(top1)
        assert cell["top1"] == pytest.approx(np.mean(top1)) and cell["top1_std"] == pytest.approx(np.std(top1, ddof=1))
        assert "top5" in cell and "top5_std" in cell
    assert res["results"]["1"]["k"]["20"]["top1_std"] > 0     # the picks differ, and so do their accuracies
    assert res["notes"] == ["n=1: k=20 clipped to the bank's 6 images", "n=3: k=20 clipped to the bank's 18 images"]
    json.dumps(res)                                           # knn.json / results.json hold it as it is
    whole = knn_evaluate(xtr, ytr, xte, yte, 6, ks=[1, 5, 20])
    table = format_few_labels(res, whole, 300)
    assert table.count("clipped to the bank's 6 images") == 1 and "±" in table and "      6    20*" in table
    assert table.splitlines()[-4].split()[:3] == ["all", "300", "20"]   # the whole bank, then the notes
    one = knn_few_labels(xtr, ytr, xte, yte, 6, ks=[5], temperature=0.07, per_class=[2], tries=1)
    assert one["results"]["2"]["k"]["5"]["top1_std"] is None
    assert "±" not in format_few_labels(one).splitlines()[2]     # one try: no spread to show


def test_the_trainers_final_knn_reports_few_labels(tmp_path, monkeypatch, fake_forward):
    """knn_report(few_labels=True) with knn.few_labels: the few-label k-NN on the features
    its online k-NN kept (extracted once), printed as a table, returned for results.json.
    Only the network's forward passes are faked (fake_forward): online_knn and knn_report
    compose their results as in training."""
    from test_folder import labeled

    from resmlp.core.config import load_config
    from resmlp.eval import knn
    from resmlp.eval.judge import knn_report

    asked = []
    real = knn.online_knn

    def online_knn(*args, keep_features=False, **kwargs):
        asked.append(keep_features)
        return real(*args, keep_features=keep_features, **kwargs)

    class FakeRun:
        is_main, device, world_size, amp_dtype = True, torch.device("cpu"), 1, None
        printed = []

        def print(self, *args):
            self.printed.append(" ".join(map(str, args)))

    monkeypatch.setattr(knn, "online_knn", online_knn)
    cfg = load_config("dino", "resmlp_s12", ["demo=false", f"out={tmp_path}", "data=imagefolder",
                                             f"data.root={labeled(tmp_path / 'lab', per_class=6)}", "knn.k=5",
                                             "knn.few_labels=[1,2]", "knn.tries=3"])
    run = FakeRun()
    assert "knn_few_labels" not in knn_report(run, None, cfg, "epoch 1") and asked == [False]   # periodic: no
    out = knn_report(run, None, cfg, "teacher after training", few_labels=True)
    assert asked[-1] is True and out["knn_k"] == 5
    few = out["knn_few_labels"]
    assert few["tries"] == 3 and few["results"]["1"]["k"]["5"]["k_used"] == 2 and "top1_std" in few["results"]["2"]["k"]["5"]
    table = run.printed[-1]
    assert "k-NN with few labels" in table and table.count("n=1: k=5 clipped to the bank's 2 images") == 1
    cfg.knn.few_labels = None
    assert "knn_few_labels" not in knn_report(run, None, cfg, "end", few_labels=True) and asked[-1] is False
    json.dumps(out)
