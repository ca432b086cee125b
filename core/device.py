"""The GPU a process is given, checked before any work: whether the installed torch has
kernels it can run (`arch_problem`), whether it has bf16 (`has_bf16`, which `precision=auto`
follows, core/dist.py), and how the run's first line names it (`describe_gpu`).

Which builds run where. `torch.cuda.get_arch_list()` names what the wheel carries: `sm_XY`
entries are machine code, which runs on the GPUs of the same major version from minor Y
up (sm_80 runs on an sm 8.6 card, not on sm 7.5 or 9.0; an `a` suffix, sm_90a, on sm 9.0
only); `compute_XY` entries are PTX, which the driver compiles at the first start for any
GPU of capability X.Y or later. A GPU that none of them covers fails at its first kernel
("no kernel image is available for execution on the device"), after the run's start-up, in
a traceback: this module turns that into one line before anything is done. Torch's own
check at CUDA's start is a warning of several lines; that warning is silenced here, where
the line that replaces it is raised.
"""
from __future__ import annotations

import platform
import re
import warnings
from importlib import metadata

import torch

BF16_FROM = (8, 0)   # Ampere: the first GPUs with bf16 in their tensor cores; before, torch emulates it
# torch's warnings at CUDA's start for a GPU its build lacks (torch/cuda/__init__.py), which
# arch_problem's one line replaces
TORCH_ARCH_WARNINGS = r"\s*(Found GPU\d+ .* compute capability|.* with CUDA capability sm_\d+ is not compatible)"
GET_STARTED = "https://pytorch.org/get-started/locally/"


def capability(device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, with torch's build warnings silenced (arch_problem
    says it in one line)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_ARCH_WARNINGS)
        major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def runs_on(entry: str, cap: tuple[int, int]) -> bool:
    """Whether an entry of torch.cuda.get_arch_list() ('sm_86', 'sm_90a', 'compute_90')
    has code a GPU of capability `cap` runs (module docstring)."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", entry)
    if not m:
        return False
    kind, number, suffix = m.group(1), int(m.group(2)), m.group(3)
    built = (number // 10, number % 10)
    if suffix == "a":           # arch-specific features: that GPU only
        return cap == built
    if kind == "compute":       # PTX: compiled by the driver for this GPU or any later one
        return cap >= built
    return cap[0] == built[0] and cap[1] >= built[1]


def arch_problem(index: int) -> str | None:
    """None when the installed torch has kernels that GPU `index` runs (or cannot tell: a
    ROCm build, an empty arch list); else the one line that refuses it."""
    if torch.version.cuda is None:
        return None
    arch = list(torch.cuda.get_arch_list())
    if not arch:
        return None
    cap = capability(index)
    if any(runs_on(entry, cap) for entry in arch):
        return None
    sm = f"sm_{cap[0]}{cap[1]}"
    return (f"the GPU {torch.cuda.get_device_name(index)} is {sm} (compute capability {cap[0]}.{cap[1]}) and the "
            f"installed torch {torch.__version__} was built for {', '.join(arch)} only, so none of its kernels runs "
            f"there: {what_to_install(cap)}; or run on the CPU with device=cpu")


def what_to_install(cap: tuple[int, int]) -> str:
    """The install command of this torch release for a CUDA version whose wheels cover `cap`,
    from the table torch keeps of its releases (torch.cuda.PYTORCH_RELEASES_CODE_CC, where
    this torch has it); else where to find one."""
    releases = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None) or {}
    machine = "aarch64" if platform.machine().lower() == "aarch64" else "x86_64"  # the table's keys
    for cuda, by_machine in sorted(releases.items(), key=lambda kv: [int(x) for x in kv[0].split(".")],
                                   reverse=True):
        if any(runs_on(f"sm_{cc}", cap) for cc in by_machine.get(machine, ())):
            version = torch.__version__.split("+")[0]
            packages = [f"torch=={version}", *_torchvision()]
            return (f"install a torch build for sm_{cap[0]}{cap[1]}, the CUDA {cuda} wheels: pip install "
                    f"{' '.join(packages)} --index-url https://download.pytorch.org/whl/cu{cuda.replace('.', '')}")
    return (f"install a torch build with kernels for sm_{cap[0]}{cap[1]} ({GET_STARTED} lists them; an older CUDA "
            "wheel, or an older torch release, covers older GPUs)")


def _torchvision() -> list[str]:
    """torchvision at its installed version: its wheels are built per CUDA version too."""
    try:
        return [f"torchvision=={metadata.version('torchvision').split('+')[0]}"]
    except metadata.PackageNotFoundError:
        return []


def has_bf16(device) -> bool:
    """Whether a CUDA device computes in bf16 in hardware (`precision=auto` takes it there)."""
    return capability(device) >= BF16_FROM


def describe_gpu(device) -> str:
    """'<name> (sm X.Y, <total> GiB, <free> GiB free)': the run's first line names its GPU so."""
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    major, minor = capability(device)
    name = torch.cuda.get_device_name(device)
    return f"{name} (sm {major}.{minor}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)"

