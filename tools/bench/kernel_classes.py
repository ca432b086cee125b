"""A profile's kernels by class, each class against its floor (profile.py).

Every kernel of a profiled call is kept and put in one class by its name:

  GEMM         matrix products: cuBLAS (nvjet, cutlass, *gemm*, sm90_xmma), Inductor's
               templates (triton_tem), cuDNN's convolutions; on a CPU aten's mm, addmm, ...
  elementwise  pointwise passes: Inductor's triton_poi, aten's elementwise kernels
  reduction    sums, norms, softmax: Inductor's triton_red and triton_per, aten's reduce_kernel
  copy         memcpy, copies and casts, cat
  other        the rest (index, random, sort, optimizer launches the rules do not name)

A class's floor is what its work needs at the rates measured in the same run: the GEMMs'
FLOPs at the matmul rate, the other named classes' bytes at the device-to-device copy rate
(bytes read plus bytes written). Bytes are those of the tensors the kernel's launching op was
handed, each once: for an Inductor kernel every buffer it reads or writes; for an eager aten
op its inputs (its output is not an argument, so that floor is low); an op whose arguments
carry no shapes (a TensorList) leaves its kernels' bytes unknown, and the class says how much
of its time that is. `other` has no floor.

On a GPU a kernel is a device kernel (its device time, the bytes of its op: the op's longest
kernel takes them). On a CPU, where the ops run on the host, a kernel is an op's own time
(self time, its children's taken out), named by the op: what the CPU tests classify.
No torch import: the records are plain dicts, so a recorded list classifies like a profile.
"""
from __future__ import annotations

import math
import re

CLASSES = ("GEMM", "elementwise", "reduction", "copy", "other")
FLOOR_BY = {"GEMM": "flops", "elementwise": "bytes", "reduction": "bytes", "copy": "bytes"}

# (pattern, class): the first pattern that finds itself in the lower-cased name decides.
# Inductor's prefixes first: its fused names hold the ops they fused (`_to_copy`, `sum`).
_MATMUL_OPS = (r"mm|addmm|bmm|baddbmm|_addmm_activation|matmul|linear|convolution|_convolution|mkldnn_convolution|"
               r"convolution_backward")
_REDUCE_OPS = r"sum|mean|amax|amin|max|min|norm|linalg_vector_norm|var_mean|std|var|topk|sort|_softmax|_log_softmax"
_POINTWISE_OPS = (r"add_?|sub_?|mul_?|div_?|neg|abs|exp|log|sqrt|rsqrt|pow|addcmul_?|addcdiv_?|lerp_?|gelu_?|"
                  r"gelu_backward|relu_?|threshold_backward|sigmoid|tanh|clamp_?|clamp_min_?|where|maximum|"
                  r"minimum|fill_|zero_|_foreach_\w+|_fused_adamw_?")
RULES = tuple((re.compile(p), c) for p, c in (
    (r"^triton_tem", "GEMM"),
    (r"^triton_poi", "elementwise"),
    (r"^triton_(red|per)", "reduction"),
    (r"nvjet|cutlass|gemm|xmma|cublas|splitkreduce|^aten::(" + _MATMUL_OPS + r")$", "GEMM"),
    (r"memcpy|copy|\bcat\b|catarray", "copy"),
    (r"reduce|softmax|layer_norm|^aten::(" + _REDUCE_OPS + r")$", "reduction"),
    (r"elementwise|multi_tensor_apply|^aten::(" + _POINTWISE_OPS + r")$", "elementwise"),
))

# Bytes per element of the dtypes the profiler names (record_shapes); the other names
# (Scalar, ScalarList, TensorList, '') are no tensor of known size.
ELEMENT_BYTES = {"double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                 "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
                 "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
NOT_A_TENSOR = ("Scalar", "ScalarList", "")


def kernel_class(name: str) -> str:
    low = name.lower()
    for pattern, cls in RULES:
        if pattern.search(low):
            return cls
    return "other"


def tensor_bytes(shapes, dtypes) -> int | None:
    """Bytes of an op's tensor arguments, each once; None when one of them has no known size
    (a TensorList, a dtype not in ELEMENT_BYTES) or the profiler recorded none."""
    if not shapes or dtypes is None or len(dtypes) < len(shapes):
        return None
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if dtype in NOT_A_TENSOR:
            continue
        if dtype not in ELEMENT_BYTES or not isinstance(shape, (list, tuple)):
            return None
        total += math.prod(shape) * ELEMENT_BYTES[dtype]
    return total


def kernels_of(events, device: str, dtypes_of=None) -> list[dict]:
    """The profiled kernels, one record {"name", "us", "bytes"} per launch (per op on a CPU),
    from torch.profiler's events (`prof.events()`). `dtypes_of(event)`: its arguments' dtypes
    where the event does not carry them (an older torch)."""
    out = []
    for e in events:
        if e.device_type.name != "CPU" or e.is_async:
            continue
        dtypes = getattr(e, "input_dtypes", None)
        if dtypes is None and dtypes_of is not None:
            dtypes = dtypes_of(e)
        size = tensor_bytes(e.input_shapes, dtypes)
        if device == "cpu":
            out.append({"name": e.name, "us": float(e.self_cpu_time_total), "bytes": size})
            continue
        launched = list(e.kernels)
        longest = max(range(len(launched)), key=lambda i: launched[i].duration, default=None)
        for i, k in enumerate(launched):
            out.append({"name": k.name, "us": float(k.duration), "bytes": size if i == longest else 0})
    return out


def by_name(kernels: list[dict], calls: int) -> list[dict]:
    """Every kernel name once, the longest first: its class, ms and launches per call, and
    its bytes per call (None: some launch's unknown)."""
    table: dict = {}
    for k in kernels:
        t = table.setdefault(k["name"], {"name": k["name"], "class": kernel_class(k["name"]), "us": 0.0, "count": 0,
                                         "bytes": 0})
        t["us"] += k["us"]
        t["count"] += 1
        t["bytes"] = None if t["bytes"] is None or k["bytes"] is None else t["bytes"] + k["bytes"]
    rows = sorted(table.values(), key=lambda t: -t["us"])
    return [{"name": t["name"], "class": t["class"], "ms_per_call": t["us"] / calls / 1e3,
             "count": t["count"] / calls, "gb_per_call": None if t["bytes"] is None else t["bytes"] / calls / 1e9}
            for t in rows]


def classes(kernels: list[dict], calls: int, flops_per_call: float | None, tflops: float | None,
            tb_per_s: float | None) -> dict:
    """{class: its time per call, its kernels per call, its share of the kernels' time, and its
    floor (FLOPs at `tflops`, or bytes at `tb_per_s`: ms per call, and floor / time)}, for
    every class in CLASSES, and "all": the sums."""
    out = {c: {"ms": 0.0, "kernels": 0.0, "gb": 0.0, "unknown_bytes_ms": 0.0} for c in CLASSES}
    for k in kernels:
        c = out[kernel_class(k["name"])]
        c["ms"] += k["us"] / calls / 1e3
        c["kernels"] += 1 / calls
        if k["bytes"] is None:
            c["unknown_bytes_ms"] += k["us"] / calls / 1e3
        else:
            c["gb"] += k["bytes"] / calls / 1e9
    busy = sum(c["ms"] for c in out.values())
    for name, c in out.items():
        c["share"] = c["ms"] / busy if busy else 0.0
        by = FLOOR_BY.get(name)
        c["floor_by"] = by
        if by == "flops":
            c["gflop"] = None if flops_per_call is None else flops_per_call / 1e9
            c["floor_ms"] = None if not (flops_per_call and tflops) else 1e3 * flops_per_call / (tflops * 1e12)
        elif by == "bytes":
            c["floor_ms"] = None if not tb_per_s else 1e3 * c["gb"] * 1e9 / (tb_per_s * 1e12)
        else:
            c["floor_ms"] = None
        c["of_floor"] = c["floor_ms"] / c["ms"] if c["floor_ms"] is not None and c["ms"] else None
    floors = [c["floor_ms"] for c in out.values() if c["floor_ms"] is not None]
    out["all"] = {"ms": busy, "kernels": sum(out[c]["kernels"] for c in CLASSES),
                  "floor_ms": sum(floors) if floors else None}
    return out


def table(summary: dict) -> list[str]:
    """classes()'s result as printed lines."""
    lines = [f"  {'class':12s} {'ms/call':>9s} {'share':>6s} {'kernels':>8s} {'work/call':>15s} {'floor ms':>9s} "
             f"{'floor/time':>10s}"]
    for name in CLASSES:
        c = summary[name]
        work = (f"{c['gflop']:.1f} GFLOP" if c.get("gflop") is not None else "-") if c["floor_by"] == "flops" \
            else f"{c['gb']:.4g} GB" if c["floor_by"] == "bytes" else "-"
        if c["floor_by"] == "bytes" and c["unknown_bytes_ms"]:
            work += "+?"
        floor = "-" if c["floor_ms"] is None else f"{c['floor_ms']:.2f}"
        ratio = "-" if c["of_floor"] is None else f"{100 * c['of_floor']:.0f}%"
        lines.append(f"  {name:12s} {c['ms']:9.2f} {100 * c['share']:5.0f}% {c['kernels']:8.0f} {work:>15s} "
                     f"{floor:>9s} {ratio:>10s}")
    a = summary["all"]
    lines.append(f"  {'all':12s} {a['ms']:9.2f} {'':6s} {a['kernels']:8.0f} {'':15s} "
                 f"{'-' if a['floor_ms'] is None else format(a['floor_ms'], '.2f'):>9s}")
    return lines
