"""Timing and memory helpers of the benchmark: warm up, synchronize, median of repeats."""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    seconds: float                 # median seconds per call over the timed repeats
    first_s: float                 # the first call alone (compilation, allocator, caches)
    warmup_s: float                # every warm-up call together, the first included
    repeats: list = field(default_factory=list)   # seconds per call of each repeat

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats: how far to trust a difference."""
        return (max(self.repeats) - min(self.repeats)) / self.seconds if self.repeats else 0.0

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "first_s": self.first_s, "warmup_s": self.warmup_s,
                "spread": round(self.spread, 4), "repeats": self.repeats}


def measure(fn, device: torch.device, warmup: int = 2, calls: int = 5, repeats: int = 3) -> Timing:
    """Call fn() `warmup` times (the first timed alone), then `repeats` times `calls`
    calls, synchronizing the device around each repeat; median seconds per call."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    sync(device)
    warm = time.perf_counter() - t0
    per_call = []
    for _ in range(max(1, repeats)):
        sync(device)
        t = time.perf_counter()
        for _ in range(max(1, calls)):
            fn()
        sync(device)
        per_call.append((time.perf_counter() - t) / max(1, calls))
    return Timing(statistics.median(per_call), first, warm, per_call)


def measure_interleaved(fns: dict, device: torch.device, warmup: int = 2, calls: int = 5,
                        repeats: int = 3) -> dict:
    """measure() for several functions whose repeats alternate (A B A B ...), so that a
    slow drift of the machine (other processes on a shared CPU) hits all of them alike
    and their ratio stays meaningful. Returns {name: Timing}."""
    first, warm, per_call = {}, {}, {name: [] for name in fns}
    for name, fn in fns.items():
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        first[name] = time.perf_counter() - t0
        for _ in range(max(0, warmup - 1)):
            fn()
        sync(device)
        warm[name] = time.perf_counter() - t0
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            for _ in range(max(1, calls)):
                fn()
            sync(device)
            per_call[name].append((time.perf_counter() - t) / max(1, calls))
    return {name: Timing(statistics.median(per_call[name]), first[name], warm[name], per_call[name])
            for name in fns}


def reset_memory(device: torch.device) -> None:
    """Free what the previous row left and restart the peak counter."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


@contextlib.contextmanager
def threads(n: int | None):
    """torch's intra-op threads set to n for the block (None: unchanged)."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def matmul_rate(device: torch.device, size: int, dtype: torch.dtype, repeats: int = 5) -> dict:
    """Measured dense matmul rate (TFLOP/s) on random data: the ceiling for '% of peak'."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=g)
    t = measure(lambda: a @ b, device, warmup=3, calls=10 if device.type == "cuda" else 2, repeats=repeats)
    return {"size": size, "dtype": str(dtype).replace("torch.", ""),
            "tflops": 2 * size ** 3 / t.seconds / 1e12, **t.as_dict()}


def copy_rate(device: torch.device, mbytes: int, repeats: int = 5) -> dict:
    """Measured device-to-device copy rate (TB/s, bytes read plus bytes written) of one buffer
    of `mbytes` MiB of random data into another: the ceiling for memory-bound kernels, as
    matmul_rate is for the matrix products."""
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.rand(int(mbytes) * 2**20 // 4, device=device, generator=g)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, warmup=3, calls=10 if device.type == "cuda" else 2, repeats=repeats)
    return {"mbytes": int(mbytes), "tb_per_s": 2 * src.numel() * 4 / t.seconds / 1e12, **t.as_dict()}


def count_flops(fn) -> int:
    """FLOPs (2 per multiply-add) of the matmuls and convolutions fn() runs, forward and
    backward, as torch.utils.flop_counter counts them: on the eager code of any compiled
    module (the counter sees each op there, and nothing compiles for it)."""
    from torch.utils.flop_counter import FlopCounterMode

    from resmlp.core.compiling import uncompiled
    with uncompiled(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
