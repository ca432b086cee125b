"""torch.distributed in one place: every command starts here, under torchrun or not.

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK in the environment) `setup()` joins the
process group (NCCL on GPU, gloo on CPU); otherwise the helpers below behave as a
world of one, so callers never branch on "is this distributed".
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import platform

import torch
import torch.distributed as dist

from resmlp.core import device as gpu
from resmlp.core.config import check_choice
from resmlp.core.errors import Preempted, UserError

_host_group = None  # a gloo group beside NCCL's, for host-side flags (any_ranks)


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return rank() == 0


def launch_rank() -> int:
    """This process's rank before setup(): the group's where one is already joined (a caller
    that made it itself sets no RANK: a test's or a notebook's spawned processes), else
    torchrun's RANK."""
    return rank() if is_dist() else int(os.environ.get("RANK", "0"))


def share(batch_size: int) -> int:
    """This process's part of a global batch (at least 1): every `batch_size` key is global."""
    return max(1, int(batch_size) // world_size())


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a Slurm or container limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The autocast dtype each `precision` but auto names (fp32: none, the float32 weights' own).
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISIONS = {dtype: name for name, dtype in AMP_DTYPES.items()}


def amp_dtype(precision: str, device) -> torch.dtype:
    """`precision` -> its autocast dtype. auto, the one place it is decided: bf16 on a GPU
    that has it in hardware (core.device.has_bf16), fp16 on an older one (the trainers add
    GradScaler, core.run.Run), float32 on the CPU."""
    check_choice("precision", precision)
    if precision != "auto":
        return AMP_DTYPES[precision]
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if gpu.has_bf16(device) else torch.float16


def pick_device(requested: str = "auto") -> torch.device:
    """`auto` takes this process's GPU when there is one, else the CPU. A GPU the installed
    torch has no kernels for is refused here, before any work (core.device.arch_problem)."""
    check_choice("device", requested)
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= torch.cuda.device_count():
        raise UserError(f"this process is local rank {local} but the node has {torch.cuda.device_count()} "
                        "GPU(s): start at most one process per GPU (NPROC_PER_NODE), or pass device=cpu")
    problem = gpu.arch_problem(local)
    if problem:
        raise UserError(problem)
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def setup(requested_device: str = "auto") -> torch.device:
    """Join the torchrun process group if there is one; return this process's device."""
    global _host_group
    device = pick_device(requested_device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not is_dist():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
        # Host-side flags go over gloo: an NCCL all-reduce would make the host wait for the GPU.
        _host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return device


def cleanup(together: bool = True) -> None:
    """Leave the process group: the one teardown of trainers, evaluators and tests.

    together: every rank is here on its way out (a normal end, or a stop they agreed on).
    They then meet at a barrier first, so that no rank closes its connections while a peer
    may still be finishing a collective over them (issue 36: a gloo process aborted in
    that teardown, SIGABRT "terminate called without an active exception").
    Leaving on an error that other ranks may never reach skips the barrier: one rank
    waiting there would hold the job until the group's timeout instead of failing now.
    """
    global _host_group
    if is_dist():
        if together:
            dist.barrier(group=_host_group)  # the host-side gloo group beside NCCL: no GPU wait
        dist.destroy_process_group()
    _host_group = None


@contextlib.contextmanager
def leaving():
    """Runs the body, then leaves the process group (cleanup): together when the body ends
    normally or by a stop every rank agreed on (Preempted), at once on any other error."""
    try:
        yield
    except Preempted:
        cleanup()
        raise
    except BaseException:
        cleanup(together=False)
        raise
    cleanup()


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Average over processes, in place, and return it."""
    if is_dist():
        dist.all_reduce(t)
        t /= world_size()
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if is_dist():
        dist.all_reduce(t)
    return t


def any_ranks(*flags: bool) -> list[bool]:
    """Each flag, true on every rank when it is true on any: all of them in one host-side
    all-reduce (a sync point across ranks that does not wait for the GPU); every rank passes
    as many flags, in the same order."""
    if not is_dist():
        return [bool(f) for f in flags]
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_host_group)
    return [bool(v) for v in t.tolist()]


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate the (possibly different-length) tensors of every rank, rank 0's first."""
    if not is_dist():
        return t
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = [torch.zeros_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


def broadcast_object(obj):
    """Rank 0's Python object, on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
