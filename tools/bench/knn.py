"""The bench's knn row: the evaluator's weighted k-NN (eval/knn.py's knn_classify over
eval/knn_search.py's knn_search) on synthetic clustered features, a line per backend of
`knn.backends`:

  torch              ours, the features on the CPU and the search where the bench runs
  torch-device       ours, the features already on the GPU, as the trainer's extraction leaves them
  torch-fp16, -bf16, -fp32   torch-device with the candidate pass in that dtype (knn_search's pass_dtype)
  torch-pass         the candidate pass within the search: its spans in a profile (search_spans)
  torch-raw, -bf16   the floor: chunked matmul + topk, no exact re-rank, no votes
  faiss-gpu, faiss-cpu       knn_search's faiss backend

`knn.baseline`: another eval/knn_search.py (an earlier commit's) timed beside the torch lines
in alternating repeats, with a check that both vote alike. It runs as its file is, in a
process of its own (`python -m bench.knn SPEC`, Baseline): nothing of it is loaded here.
profile.py's k-NN phases search the same features (knn_features) and read the same spans.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from bench.process import child_env, module_argv
from bench.step import Skip
from bench.timing import measure, peak_memory_gb, sync

PASS_DTYPES = {"torch-fp16": torch.float16, "torch-bf16": torch.bfloat16, "torch-fp32": torch.float32}
# the spans of knn_search's candidate pass (eval/knn_search.py's _TorchSearch), what torch-pass sums
PASS_SPANS = ("queries: norms, unit rows", "pass: matmul", "pass: block maxima, merge", "pass: best blocks, recompute")


def knn_family(ctx) -> None:
    k = ctx.p.knn
    made: list = []

    def data():  # made once, by the first line an earlier run did not measure
        if not made:
            made.append(knn_features(k))
        return made[0]
    for backend in k.backends:
        ident = {"backend": str(backend), "n_train": int(k.n_train), "dim": int(k.dim), "k": int(k.k)}
        ctx.attempt("knn", ident, lambda: _knn_one(ctx, str(backend), data()))


def knn_features(k) -> tuple:
    """(train, train labels, test, test labels, classes) on the CPU for a profile's `knn`
    settings: clustered features, so that the vote has something to find (top-1 as a sanity
    check) and the search's rounds are those of the bench's line (profile.py's k-NN phases
    and the baseline's process search the same ones)."""
    return clustered(int(k.n_train), int(k.n_test), int(k.dim), int(k.classes), noise=3.0)


def clustered(n_train: int, n_test: int, dim: int, classes: int, noise: float) -> tuple:
    """(train, train labels, test, test labels, classes) on the CPU, seeded: a N(0, 1)
    centroid per class, each image its class's centroid plus `noise` x N(0, 1) per
    dimension (the linear row's features too, tools/bench/linear.py)."""
    g = torch.Generator().manual_seed(0)
    centroids = torch.randn(classes, dim, generator=g)
    train_y = torch.randint(classes, (n_train,), generator=g)
    train = torch.randn(n_train, dim, generator=g).mul_(noise).add_(centroids[train_y])
    test_y = torch.randint(classes, (n_test,), generator=g)
    test = torch.randn(n_test, dim, generator=g).mul_(noise).add_(centroids[test_y])
    return train, train_y, test, test_y, classes


def search_spans(fn, device: torch.device, calls: int = 1) -> tuple[dict, list]:
    """fn() called `calls` times under torch.profiler: ({phase: {"calls", "device_ms",
    "host_ms"}} of knn_search's spans (eval/knn_search.py SPANS), in the order they first
    ran; [each round's facts, from its mark]). On a GPU a span's device time is its kernels';
    on a CPU, where the work is synchronous, the host's time is both. The profiler adds no
    host sync inside the call."""
    from torch.profiler import ProfilerActivity, profile

    from resmlp.eval.knn_search import SPANS, round_of
    cuda = device.type == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    spans, rounds = {}, []
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        if round_of(e.name) is not None:
            rounds.append(round_of(e.name))
        elif e.name.startswith(SPANS):
            span = spans.setdefault(e.name[len(SPANS):], {"calls": 0, "device_ms": 0.0, "host_ms": 0.0})
            span["calls"] += 1
            span["host_ms"] += e.cpu_time_total / 1e3
            span["device_ms"] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3
    return spans, rounds


def _place(backend: str, dev: torch.device) -> tuple[torch.device, str, torch.dtype | None, bool]:
    """(where the search runs, knn_search's backend, the pass dtype, whether the features
    start on the device) of a searching line; Skip where this machine cannot run it."""
    on_gpu = dev.type == "cuda"
    if backend == "torch":
        return dev, "torch", None, False
    if backend == "torch-device" or backend in PASS_DTYPES:   # as the trainer's extraction leaves them
        if backend == "torch-device" and not on_gpu:
            raise Skip("no GPU")
        return dev, "torch", PASS_DTYPES.get(backend), True
    if backend not in ("faiss-gpu", "faiss-cpu"):
        raise ValueError(f"unknown k-NN backend {backend!r}; choose from torch, torch-device, torch-fp16, "
                         f"torch-bf16, torch-fp32, torch-pass, torch-raw, torch-raw-bf16, faiss-gpu, faiss-cpu")
    try:
        import faiss  # noqa: F401
    except ImportError:
        raise Skip("faiss is not installed") from None
    if backend == "faiss-cpu":
        return torch.device("cpu"), "faiss", None, False
    from resmlp.eval.knn_search import faiss_gpu_works
    if not on_gpu:
        raise Skip("no GPU")
    if not faiss_gpu_works(dev.index or 0):
        raise Skip("faiss's GPU index does not run (exactly) on this GPU")
    return dev, "faiss", None, False


def _knn_one(ctx, backend: str, data) -> dict:
    train, train_y, test, test_y, classes = data
    k, dev = ctx.p.knn, ctx.device
    if backend in ("torch-raw", "torch-raw-bf16"):
        return _knn_raw(ctx, train, test, torch.bfloat16 if backend.endswith("bf16") else torch.float32)
    if backend == "torch-pass":
        return _knn_pass(ctx, train, test)
    where, name, dtype, on_device = _place(backend, dev)
    if on_device:
        train, test = train.to(dev), test.to(dev)
    from resmlp.eval.knn import knn_classify
    from resmlp.eval.knn_search import knn_search
    n = test.shape[0] if where.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    search = functools.partial(knn_search, pass_dtype=dtype)

    def classify(bank, labels, queries):
        return knn_classify(bank, labels, queries, classes, k=int(k.k), temperature=0.07, backend=name,
                            device=where, search=search)
    # Warmed up on a small bank (the libraries, the allocator, the device), then timed on
    # the whole one: ours here and the baseline's in its process in alternating repeats
    # (A B A B), the median.
    classify(train[:4096], train_y[:4096], test[:8])
    baseline = Baseline(k, name, where, on_device, n, dtype) if k.baseline and name == "torch" else None
    times, base_times = [], []
    with baseline or contextlib.nullcontext():
        for _ in range(max(int(k.repeats), 2 if baseline and baseline.runs else 1)):
            sync(dev)
            t0 = time.perf_counter()
            scores = classify(train, train_y, test[:n])
            sync(dev)
            times.append(time.perf_counter() - t0)
            if baseline and baseline.runs:
                base_times.append(baseline.time())
        base_scores = baseline.scores() if baseline and baseline.runs else None
    sec = statistics.median(times)
    out = {"device": where.type, "queries": n, "seconds": sec, "seconds_full": sec * test.shape[0] / n,
           "queries_per_s": n / sec, "top1": float((scores.argmax(1) == test_y[:n]).float().mean() * 100),
           "mem_gb": peak_memory_gb(dev), "repeats": times}
    if dtype is not None:
        out["pass_dtype"] = str(dtype).replace("torch.", "")
    if base_scores is not None:
        b = statistics.median(base_times)
        out.update(baseline=str(k.baseline), baseline_seconds=b, baseline_repeats=base_times, vs_baseline=b / sec,
                   same_as_baseline=bool(torch.equal(scores, base_scores)))
    elif baseline:
        out["baseline_note"] = baseline.note
    return out


def _knn_pass(ctx, train, test) -> dict:
    """knn_search's candidate pass within the search (the torch backend, the features
    already on the device, every round): the seconds of its spans (PASS_SPANS: the queries'
    unit rows, the tiles' matmuls, their block maxima and merges, the best blocks recomputed)
    per call, in a profile of `repeats` calls (search_spans) after a warm-up; also its
    matmuls alone (`matmul_s`) and with the block maxima (`maxima_s`): where the pass's
    time goes. What the exact path adds to it is the `torch-device` line minus this one."""
    from resmlp.eval.knn_search import default_pass_dtype, knn_search
    k, dev = ctx.p.knn, ctx.device
    n = test.shape[0] if dev.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    train, test = train.to(dev), test[:n].to(dev)
    knn_search(train[:4096], test[:8], int(k.k), backend="torch", device=dev, on_host=False)
    repeats = max(1, int(k.repeats))
    spans, rounds = search_spans(lambda: knn_search(train, test, int(k.k), backend="torch", device=dev,
                                                    on_host=False), dev, repeats)

    def seconds(*names):
        return sum(spans[s]["device_ms"] for s in names if s in spans) / 1e3 / repeats
    sec = seconds(*PASS_SPANS)
    stages = {"matmul_s": seconds("pass: matmul"), "maxima_s": seconds("pass: matmul", "pass: block maxima, merge")}
    dtype = str(default_pass_dtype(dev)).replace("torch.", "")
    first = rounds[0]["candidates"] if rounds else None
    return {"device": dev.type, "queries": n, "seconds": sec, "seconds_full": sec * k.n_test / n,
            "queries_per_s": n / sec, "mem_gb": peak_memory_gb(dev), **stages, "rounds": rounds[:len(rounds) // repeats],
            "note": f"{dtype} pass, {first} candidates in its first round, {len(rounds) // repeats} round(s), "
                    f"no re-rank; matmuls alone {stages['matmul_s']:.3f} s, with the block maxima "
                    f"{stages['maxima_s']:.3f} s"}


def _knn_raw(ctx, train, test, dtype) -> dict:
    """The floor of the search alone: unit features already on the device, chunked matmul
    + topk in `dtype`, no exact re-ranking, no votes (what knn_search's candidate pass
    costs at best; bf16 candidates would need a wider margin before the exact re-rank)."""
    k, dev = ctx.p.knn, ctx.device
    n = test.shape[0] if dev.type == "cuda" else min(test.shape[0], int(k.cpu_queries))
    tr = torch.nn.functional.normalize(train.to(dev), dim=1).to(dtype)
    te = torch.nn.functional.normalize(test[:n].to(dev), dim=1).to(dtype)
    rows = max(1, min(4096, (1 << 30) // (4 * tr.shape[0])))

    def search():
        for s in range(0, n, rows):
            (te[s:s + rows] @ tr.T).topk(int(k.k), dim=1)
    t = measure(search, dev, warmup=1, calls=1, repeats=2)
    return {"device": dev.type, "queries": n, "seconds": t.seconds, "seconds_full": t.seconds * test.shape[0] / n,
            "queries_per_s": n / t.seconds, "mem_gb": peak_memory_gb(dev),
            "note": f"{str(dtype).replace('torch.', '')} matmul+topk, features on the device, no exact re-rank"}


# --------------------------------------------------------------------------- the baseline's process

class Baseline:
    """The baseline file's k-NN in a process of its own, which builds the same features
    (knn_features; the line's queries, where the line has them) and warms up as the line does,
    then times one call whenever asked (`time`) and hands back its last scores (`scores`). A baseline
    whose knn_search takes no pass_dtype is not run for a line at another dtype (`runs`
    false, `note` says why). Used as a context: the process ends with the block."""

    def __init__(self, k, name: str, where: torch.device, on_device: bool, queries: int, dtype):
        self.folder = Path(tempfile.mkdtemp(prefix="resmlp_bench_knn_baseline_"))
        self.spec = {"file": str(Path(str(k.baseline)).expanduser()), "knn": OmegaConf.to_container(k),
                     "backend": name, "device": str(where), "on_device": on_device, "queries": queries,
                     "pass_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                     "threads": torch.get_num_threads(), "scores": str(self.folder / "scores.npy")}
        self.runs, self.note, self.proc = False, None, None

    def __enter__(self):
        path = self.folder / "spec.json"
        path.write_text(json.dumps(self.spec))
        self.proc = subprocess.Popen(module_argv("knn", path), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=child_env())
        try:
            said = self._answer()
        except BaseException:
            self.__exit__()
            raise
        self.runs, self.note = "ready" in said, said.get("skip")
        return self

    def _answer(self) -> dict:
        """The process's next answer (its other output, a library's, passes through to stderr)."""
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
            sys.stderr.write(line)
        raise RuntimeError(f"the baseline's process ({self.spec['file']}) exited {self.proc.wait()}; its error "
                           "is on stderr")

    def _ask(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def time(self) -> float:
        return float(self._ask("time")["seconds"])

    def scores(self) -> torch.Tensor:
        self._ask("scores")
        return torch.from_numpy(np.load(self.spec["scores"], allow_pickle=False))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        return False


ANSWER = "knn_baseline: "   # the start of each answer line of the baseline's process


def _say(**fields) -> None:
    print(ANSWER + json.dumps(fields), flush=True)


def baseline_process(spec_path: str) -> int:
    """The baseline's side (`python -m bench.knn SPEC`): one JSON line per request on stdin
    ("time": {"seconds"}; "scores": the last call's scores written to the spec's file)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    file = importlib.util.spec_from_file_location("knn_search_baseline", spec["file"])
    module = importlib.util.module_from_spec(file)
    file.loader.exec_module(module)
    search = module.knn_search
    if spec["pass_dtype"] is not None:
        if "pass_dtype" not in inspect.signature(search).parameters:
            _say(skip=f"{Path(spec['file']).name}'s knn_search takes no pass_dtype: no baseline at "
                      f"{spec['pass_dtype']}")
            return 0
        search = functools.partial(search, pass_dtype=getattr(torch, spec["pass_dtype"]))
    from resmlp.eval.knn import knn_classify
    device = torch.device(spec["device"])
    k = OmegaConf.create(spec["knn"])
    train, train_y, test, _, classes = knn_features(k)
    if spec["on_device"]:
        train, test = train.to(device), test.to(device)
    test = test[:int(spec["queries"])]

    def classify(bank, labels, queries):
        return knn_classify(bank, labels, queries, classes, k=int(k.k), temperature=0.07, backend=spec["backend"],
                            device=device, search=search)
    classify(train[:4096], train_y[:4096], test[:8])
    _say(ready=True)
    scores = None
    for line in sys.stdin:
        if line.strip() == "time":
            sync(device)
            t0 = time.perf_counter()
            scores = classify(train, train_y, test)
            sync(device)
            _say(seconds=time.perf_counter() - t0)
        elif line.strip() == "scores":
            np.save(spec["scores"], scores.numpy(), allow_pickle=False)
            _say(saved=True)
    return 0


if __name__ == "__main__":
    sys.exit(baseline_process(sys.argv[1]))
